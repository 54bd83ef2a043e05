"""A generation rank's engine processes (vLLM's engine core and workers, multiprocessing's
helpers): they never outlive the rank, and their death ends the rank at once.

- :func:`start_reaper`: a small watchdog process of its own session that keeps a list of the
  rank's descendants (read from /proc every half second) and, once the rank is gone however it
  ended (a `kill -9` included, where no cleanup of the rank's runs), kills every one of them
  still alive (the same pid with the same start time), then exits. Linux's /proc, so the same
  on CPU, GPU and NPU nodes.
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
from typing import Callable

REAPER = r"""
import os, signal, sys, time
rank, me = int(sys.argv[1]), os.getpid()

def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    return s[s.rindex(")") + 2:].split()   # state, ppid, ..., starttime at [19]

def tree(root):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            f = stat(d)
            if f:
                kids.setdefault(int(f[1]), []).append((int(d), f[19]))
    out, todo = [], [root]
    while todo:
        for pid, start in kids.get(todo.pop(), []):
            if pid != me:
                out.append((pid, start))
                todo.append(pid)
    return out

last = []
while True:
    f = stat(rank)
    if f is None or f[0] in "ZX":
        break
    last = tree(rank)
    time.sleep(0.5)
for pid, start in last:
    f = stat(pid)
    if f is not None and f[19] == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


def start_reaper() -> subprocess.Popen:
    """The watchdog of this process's descendants (see the module docstring)."""
    return subprocess.Popen([sys.executable, "-c", REAPER, str(os.getpid())],
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
                    self.on_death(f"{self.what} process {p.name} (pid {p.pid}) died ({how(code)})")
                    return

    def stop(self) -> None:
        """Before the engine's own shutdown ends those processes on purpose."""
        self._stop.set()
