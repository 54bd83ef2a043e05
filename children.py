"""A generation rank's engine processes (vLLM's engine core and workers, multiprocessing's
helpers): they never outlive the rank, and their death ends the rank at once.

- :func:`start_reaper`: a small watchdog process of its own session that keeps a list of the
  rank's descendants (read from /proc every half second) and, once the rank is gone however it
  ended (a `kill -9` included, where no cleanup of the rank's runs), kills every one of them
  still alive (the same pid with the same start time), then exits. The rank too is followed by
  pid and start time, so a reused pid never makes another job's processes its own, and
  multiprocessing's resource tracker is left to clean up the shared memory (:func:`spared`).
  Linux's /proc, so the same on CPU, GPU and NPU nodes.
- :class:`Watch`: a thread of the rank that polls the engine's processes (the multiprocessing
  children the engine started: vLLM's engine core) and, when one ends while the engine is in
  use, ends the rank with one line naming it, its pid and its exit code or signal
  (failures.fail_now), so the job stops within seconds instead of waiting on a dead engine.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

import failures


def _stat(proc: str, pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name: [0] the state, [1] the parent's pid,
    [19] the start time (field 22, clock ticks since boot); None for no such process."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    return s[s.rindex(")") + 2:].split()


def _started(proc: str, pid: int) -> str | None:
    """The start time of live process `pid` (a zombie counts as gone), None if there is none."""
    f = _stat(proc, pid)
    return None if f is None or f[0] in "ZX" else f[19]


def _tree(proc: str, root: int, me: int) -> list[tuple[int, str]]:
    """Every descendant of `root` but `me`, as (pid, start time)."""
    kids: dict[int, list] = {}
    for d in os.listdir(proc):
        if d.isdigit() and (f := _stat(proc, int(d))):
            kids.setdefault(int(f[1]), []).append((int(d), f[19]))
    out, todo = [], [root]
    while todo:
        for pid, start in kids.get(todo.pop(), []):
            if pid != me:
                out.append((pid, start))
                todo.append(pid)
    return out


def spared(proc: str, pid: int) -> bool:
    """Not the engine's to kill: multiprocessing's resource tracker. Once every process holding
    its pipe is gone it unlinks the shared memory they leaked (vLLM's message queues) and exits;
    killed, it would leave those segments in /dev/shm."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def reap(rank: int, proc: str = "/proc", interval: float = 0.5, grace: float = 10.0,
         kill: Callable[[int, int], None] = os.kill, sleep: Callable[[float], None] = time.sleep,
         clock: Callable[[], float] = time.monotonic) -> list[int]:
    """The reaper's loop (module docstring): follow `rank` by pid AND start time (its pid reused
    by another process counts as its end, never as the rank), listing its descendants every
    `interval` s; once it is gone, SIGKILL each listed one still alive with the same start time,
    but :func:`spared` ones, which get `grace` s to exit by themselves first. Returns the pids
    killed. `proc`, `kill`, `sleep`, `clock`: injectable for tests."""
    me, born, last = os.getpid(), _started(proc, rank), []
    while born is not None and _started(proc, rank) == born:
        now = _tree(proc, rank, me)
        if _started(proc, rank) != born:  # ended (its pid maybe reused) while listing: the older list
            break
        last = now
        sleep(interval)
    waiting = [(p, s) for p, s in last if spared(proc, p)]
    killed = _kill_alive(proc, kill, [p for p in last if p not in waiting])
    deadline = clock() + grace
    while any(_started(proc, p) == s for p, s in waiting) and clock() < deadline:
        sleep(interval)
    return killed + _kill_alive(proc, kill, waiting)  # stuck past its grace: killed after all (its segments leak)


def _kill_alive(proc: str, kill: Callable[[int, int], None], listed: list[tuple[int, str]]) -> list[int]:
    """SIGKILL each of `listed` (pid, start time) still alive with that start time; their pids."""
    killed = []
    for pid, start in listed:
        if _started(proc, pid) == start:
            killed.append(pid)
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return killed


def start_reaper() -> subprocess.Popen:
    """The watchdog of this process's descendants (see the module docstring)."""
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def how(code: int) -> str:
    """A process's exit code as words: "exit code 1", "killed by SIGKILL"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Watch:
    """Polls `processes` (multiprocessing.Process objects this rank started) every `interval`
    seconds; the first that ends calls `on_death(line)`, unless :meth:`stop` came first."""

    def __init__(self, processes: list, what: str, on_death: Callable[[str], None],
                 interval: float = 0.5):
        self.processes, self.what, self.on_death, self.interval = list(processes), what, on_death, interval
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for p in self.processes:
                code = p.exitcode
                if code is not None and not self._stop.is_set():
                    own = failures.engine_error()  # what it wrote before it died, if anything
                    self.on_death(f"{self.what} process {p.name} (pid {p.pid}) died ({how(code)})"
                                  + (f"; the engine's own error: {own}" if own else ""))
                    return

    def stop(self) -> None:
        """Before the engine's own shutdown ends those processes on purpose."""
        self._stop.set()


if __name__ == "__main__":  # the reaper process (start_reaper)
    reap(int(sys.argv[1]))
