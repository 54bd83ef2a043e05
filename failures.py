"""Failure handling: name the culprit, never hang.

- :class:`Liveness`: heartbeats and phases in the launcher's key-value store. The loop marks its
  phase in one line (``live.phase(step, "train")``); when something fails, :meth:`Liveness.report`
  says which ranks died (heartbeat stopped) and where every other rank was (a rank alive in
  another phase is the stuck one).
- :func:`guarded`: runs the job; an exception becomes ONE line naming this rank, its role, the
  error and the report, an abort notice that stops every other rank within a heartbeat, and
  exit code 4 (no teardown that could hang).
- :func:`on_sigterm`: torchrun stops the survivors of a failed rank with SIGTERM; say so.
- :func:`fault_active` / :func:`inject`: fault injection for the failure tests, off unless
  ``GRPO_FAULT=<point>[@<step>][:<rank>]`` is set.
"""
from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable

import config as C


def fault_active(point: str, step: int | None = None) -> bool:
    """True when this rank reaches fault `point` (at `step`, if the spec names one)."""
    spec = os.environ.get("GRPO_FAULT")
    if not spec:
        return False
    name, _, rank = spec.partition(":")
    name, _, at = name.partition("@")
    if name != point or (at and step != int(at)):
        return False
    return not rank or int(rank) == int(os.environ.get("RANK", 0))


def inject(step: int, live: "Liveness") -> None:
    """Tests: a rank killed mid-run (`die`) or alive but stuck (`hang`) at `step`."""
    if fault_active("die", step):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault_active("hang", step):
        live.phase(step, "hung")
        time.sleep(10 ** 6)


class Liveness:
    """Heartbeats and phases in the launcher's key-value store, to name the culprit of a failure.

    A daemon thread bumps `hb/<rank>` every 0.5 s; the loop records its phase ("step 3:
    rollout"). When a collective fails or times out, `report()` names the ranks whose heartbeat
    stopped (dead: killed, crashed, lost node) and every rank's last phase (a rank alive but stuck
    in another phase is the hung one). The failing rank then posts an abort notice; every other
    rank's heartbeat thread ends its process within a beat, even when its main thread is stuck
    in a C call (a hung engine) and on nodes whose launcher does not know of the failure.
    """
    INTERVAL = 0.5

    def __init__(self, rank: int, roles: list[str]):
        import torch.distributed as dist
        self.store = dist.distributed_c10d._get_default_store()
        self.store.set_timeout(datetime.timedelta(seconds=5))  # diagnosis must not hang either
        self.rank, self.world, self.roles = rank, len(roles), roles
        self.ns = f"grpo/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._stop = threading.Event()
        self.failing = False
        threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()

    def _beat(self) -> None:
        while not self._stop.wait(self.INTERVAL):
            try:
                self.store.add(f"{self.ns}/hb/{self.rank}", 1)
                failed = self.store.check([f"{self.ns}/abort"])
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return
            if failed and not self.failing:  # another rank failed: stop now, even if
                # this rank's main thread is stuck in a C call (a hung engine, a collective)
                why = self.store.get(f"{self.ns}/abort").decode()
                print(f"error: rank {self.rank} ({self.roles[self.rank]}) stopping: {why}",
                      file=sys.stderr, flush=True)
                os._exit(5)

    def abort(self, why: str) -> None:
        """Tell every rank to stop (their heartbeat threads exit the process within a beat)."""
        try:
            self.store.set(f"{self.ns}/abort", why)
        except Exception:  # noqa: BLE001
            pass

    def phase(self, step: int | None, what: str) -> None:
        """Record where this rank is: "step 3: train" (or `what` alone before the loop)."""
        self.store.set(f"{self.ns}/phase/{self.rank}", what if step is None else f"step {step}: {what}")

    def close(self) -> None:
        self._stop.set()
        self.store.set(f"{self.ns}/exit/{self.rank}", "1")

    def report(self) -> str:
        """One line: who is dead, and where every rank was."""
        try:
            count = lambda: [self.store.add(f"{self.ns}/hb/{r}", 0) for r in range(self.world)]  # noqa: E731
            before = count()
            time.sleep(3 * self.INTERVAL)
            after = count()
            ended = {r for r in range(self.world) if self.store.check([f"{self.ns}/exit/{r}"])}
            dead = [r for r in range(self.world)
                    if r != self.rank and after[r] == before[r] and r not in ended]
            phases = []
            for r in range(self.world):
                k = f"{self.ns}/phase/{r}"
                phases.append(self.store.get(k).decode() if self.store.check([k]) else "?")
        except Exception as e:  # noqa: BLE001
            return f"could not diagnose ({type(e).__name__}: the launcher's store is gone)"
        where = [f"{r}:{p}" for r, p in enumerate(phases)]
        # Alive ranks elsewhere than this one are the likely stuck ones.
        stuck = [r for r in range(self.world) if r not in dead and r not in ended
                 and phases[r] != phases[self.rank]]
        who = (", ".join(f"rank {r} ({self.roles[r]})" for r in dead) + " died (no heartbeat)"
               if dead else "no rank died; " + (", ".join(
                   f"rank {r} ({self.roles[r]}) is stuck in '{phases[r]}'" for r in stuck)
                   or "a rank is stuck (compare phases)"))
        return f"{who}; last phases: " + " | ".join(where)


def on_sigterm(live: Liveness) -> None:
    """torchrun stops the survivors of a failed rank with SIGTERM: say who stopped and why."""
    def handler(signum, frame):
        print(f"error: rank {live.rank} ({live.roles[live.rank]}) stopped by the launcher; "
              f"{live.report()}", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def guarded(live: Liveness, job: Callable[[], int]) -> int:
    """Run `job`; any failure ends THIS rank at once with a line naming the culprit (torchrun
    then stops the others, which print their own view). A config error found after start-up
    (every rank finds it) is printed once and every rank exits 2."""
    rank, role = live.rank, live.roles[live.rank]
    try:
        code = job()
        live.close()
        return code
    except C.ConfigError as e:  # the same verdict on every rank (e.g. a refused resume)
        if rank == 0:
            print(f"config error: {e}", file=sys.stderr, flush=True)
        live.close()
        sys.stdout.flush()
        os._exit(2)  # no teardown of the process group that could hang or abort
    except Exception as e:  # noqa: BLE001 - report, then exit without a hanging teardown
        live.failing = True  # this rank reports its own failure; keep beating meanwhile
        report = live.report()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: rank {rank} ({role}) failed: {type(e).__name__}: {msg[:300]}; {report}",
              file=sys.stderr, flush=True)
        live.abort(f"rank {rank} ({role}) failed ({type(e).__name__}); {report}")
        if "died" not in report:
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(4)
