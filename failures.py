"""Failure handling: name the culprit, never hang, blame no one wrongly.

:class:`Liveness` (heartbeats and phases in the launcher's store), :func:`guarded` (a failure
becomes one line and exit code 4), :func:`on_signals`, :func:`exit_bad_input` (exit 2),
:func:`world_failed`, :func:`start_barrier`, and the fault injection of the failure tests
(``GRPO_FAULT``). How they work together and every exit code: docs/failures.md.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import os
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from errors import ConfigError, NodeConfigError, StartError, causes, one_line  # noqa: F401  (re-exported)


class Fatal(RuntimeError):
    """An error whose one line says everything (a full disk while saving): :func:`guarded`
    prints it without a traceback and without diagnosing the other ranks."""


def say(line: str) -> None:
    """One line to stderr in ONE write: lines of several ranks sharing a pipe never interleave
    (a write of under PIPE_BUF bytes is atomic; `print` hands text and newline over apart)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def end(code: int) -> None:
    """Exit now with `code`, without interpreter teardown (a failing rank's threads may be stuck
    in C calls), after ending this process's children (vLLM's engine core would otherwise outlive
    the rank, holding its device memory): SIGTERM, then SIGKILL after 3 s."""
    import multiprocessing
    kids = multiprocessing.active_children()
    for kid in kids:
        kid.terminate()
    deadline = time.monotonic() + 3.0
    for kid in kids:
        kid.join(max(deadline - time.monotonic(), 0.0))
        if kid.is_alive():
            kid.kill()
            kid.join(1.0)  # reaped here: this sandbox's init reaps no orphaned zombie
    os._exit(code)


def fault_active(point: str, step: int | None = None) -> bool:
    """True when this rank reaches fault `point` (at `step`, if the spec names one). Several
    specs, comma-separated, inject each (`nan_loss@1,nan_loss@3`: one test run, two faults)."""
    for spec in filter(None, os.environ.get("GRPO_FAULT", "").split(",")):
        name, _, rank = spec.partition(":")
        name, _, at = name.partition("@")
        if name == point and (not at or step == int(at)) and (
                not rank or int(rank) == int(os.environ.get("RANK", 0))):
            return True
    return False


def together(group, what: str, fn: Callable[[], object], here: bool = True) -> None:
    """`fn()` where `here` (one rank's write, or every rank's), then every rank of `group` stops
    if one failed (collective; that rank's error raised again, the others' a RuntimeError naming
    `what`), instead of the others going on into a collective that waits until the run is torn
    down (checkpoint.py's save: rank 0 then never removes `step_N.tmp`, or a peer's DCP save
    makes it again after rank 0 removed it)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    failed = None
    try:
        if here:
            fn()
    except (Exception, CheckpointException) as e:
        failed = e
    bad = torch.tensor([failed is not None], dtype=torch.int32)
    dist.all_reduce(bad, group=group)
    if failed is not None:
        raise failed
    if bad.item():
        raise RuntimeError(f"{what} failed on another rank")


def inject_start(timeout_s: float) -> None:
    """Tests: an engine slower to start than the collective timeout `timeout_s` (1.5 times it)."""
    if fault_active("slow_engine_start"):
        time.sleep(1.5 * timeout_s)


def start_barrier(live: "Liveness", timeout_s: float, key: str, name: str = "start") -> None:
    """Every rank meets here within `timeout_s` (config `key`), a deadline longer than any
    collective's (cluster.timeout_s); past it, a RuntimeError saying so. A count in the store,
    not a collective: `dist.barrier` has no `timeout` before torch 2.13 (the hardware runs
    2.10 / 2.11)."""
    store, ns = live.store, f"{live.ns}/meet/{name}"
    store.add(ns, 1)
    deadline = time.monotonic() + timeout_s
    while (arrived := store.add(ns, 0)) < live.world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"start-up timed out: {arrived} of {live.world} ranks were ready "
                               f"within {key} = {timeout_s:g} s")
        time.sleep(0.05)


def inject(step: int, live: "Liveness") -> None:
    """Tests: a rank killed mid-run (`die`), alive but stuck (`hang`), or raising its own
    error (`raise`) at `step`."""
    if fault_active("die", step):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault_active("hang", step):
        live.phase(step, "hung")
        time.sleep(10 ** 6)
    if fault_active("raise", step):
        raise ValueError(f"injected fault at step {step}")
    if fault_active("kill_engine", step):  # tests: vLLM's engine core killed outright
        import multiprocessing
        for kid in multiprocessing.active_children():
            if "EngineCore" in kid.name:
                os.kill(kid.pid, signal.SIGKILL)


@dataclass
class Diagnosis:
    """Who is to blame for a failed collective, as seen from one rank."""
    dead: list[int] = field(default_factory=list)            # heartbeat stopped, no exit, no signal
    failed: list[int] = field(default_factory=list)          # reported their own failure
    signalled: dict[int, str] = field(default_factory=dict)  # rank -> "SIGTERM" / "SIGINT"
    stuck: list[int] = field(default_factory=list)           # alive, in another phase
    line: str = ""


class Liveness:
    """Heartbeats (a daemon thread bumps `hb/<rank>` every 0.5 s) and phases ("step 3:
    rollout") in the launcher's key-value store, to name the culprit of a failure; the heartbeat
    thread also ends this process within a beat once another rank posts an abort notice, even
    when the main thread is stuck in a C call."""
    INTERVAL = 0.5

    def __init__(self, rank: int, roles: list[str]):
        import torch.distributed as dist
        self.store = dist.distributed_c10d._get_default_store()
        self.store.set_timeout(datetime.timedelta(seconds=5))  # diagnosis must not hang either
        self.rank, self.world, self.roles = rank, len(roles), roles
        self.role = roles[rank]
        Liveness.current = self  # fail_now's (a thread that finds this rank broken)
        self.ns = f"grpo/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.where: tuple[int | None, str] = (None, "start-up")
        self.phase(None, "start-up")  # a rank is never shown without a phase
        self._stop = threading.Event()
        self.failing = False
        self.ending = threading.Lock()  # the first of {failure report, signal stop} prints
        threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()

    def _beat(self) -> None:
        while not self._stop.wait(self.INTERVAL):
            try:
                self.store.add(f"{self.ns}/hb/{self.rank}", 1)
                failed = self.store.check([f"{self.ns}/abort"])
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return
            if failed and not self.failing and self.ending.acquire(blocking=False):
                say(f"error: rank {self.rank} ({self.role}) stopping: {self.abort_notice()}")
                end(5)

    def abort(self, why: str) -> None:
        """Tell every rank to stop (their heartbeat threads exit the process within a beat)."""
        try:
            self.store.set(f"{self.ns}/failed/{self.rank}", "1")
            self.store.set(f"{self.ns}/abort", why)
        except Exception:  # noqa: BLE001
            pass

    def abort_notice(self) -> str | None:
        """The failing rank's notice, if one was posted."""
        try:
            k = f"{self.ns}/abort"
            return self.store.get(k).decode() if self.store.check([k]) else None
        except Exception:  # noqa: BLE001
            return None

    def phase(self, step: int | None, what: str) -> None:
        """Record where this rank is: "step 3: train" (or `what` alone before the loop)."""
        self.where = (step, what)
        self.store.set(f"{self.ns}/phase/{self.rank}", what if step is None else f"step {step}: {what}")

    def where_text(self) -> str:
        step, what = self.where
        return f"during {what}" if step is None else f"at step {step} ({what})"

    def close(self) -> None:
        self._stop.set()
        self.store.set(f"{self.ns}/exit/{self.rank}", "1")

    def diagnose(self) -> Diagnosis:
        """Who is dead, who was stopped by a signal, who is stuck, and where every rank was.
        Takes 1.5 s (three heartbeats)."""
        if self.world == 1:
            return Diagnosis()
        others = [r for r in range(self.world) if r != self.rank]
        try:
            count = lambda: [self.store.add(f"{self.ns}/hb/{r}", 0) for r in range(self.world)]  # noqa: E731
            before = count()
            time.sleep(3 * self.INTERVAL)
            after = count()
            has = lambda k: self.store.check([f"{self.ns}/{k}"])  # noqa: E731
            failed = [r for r in others if has(f"failed/{r}")]
            ended = {r for r in others if has(f"exit/{r}")} | set(failed)
            signalled = {r: self.store.get(f"{self.ns}/signal/{r}").decode()
                         for r in others if has(f"signal/{r}")}
            phases = [self.store.get(f"{self.ns}/phase/{r}").decode() if has(f"phase/{r}")
                      else "start-up" for r in range(self.world)]  # not even Liveness built yet
        except Exception as e:  # noqa: BLE001
            return Diagnosis(line=f"could not diagnose ({type(e).__name__}: the launcher's store "
                                  "is gone)")
        dead = [r for r in others if after[r] == before[r] and r not in ended and r not in signalled]
        stuck = [r for r in others if r not in dead and r not in ended and r not in signalled
                 and phases[r] != phases[self.rank]]
        name = lambda r: f"rank {r} ({self.roles[r]})"  # noqa: E731
        who = [f"{name(r)} failed (see its own line)" for r in failed]
        who += [f"{name(r)} died (no heartbeat)" for r in dead]
        if not who:  # else a signal is the launcher stopping the survivors of that failure
            who = [f"{name(r)} was stopped by {s}" for r, s in signalled.items()]
        if not who:
            who = ["no rank died; " + (", ".join(f"{name(r)} is stuck in '{phases[r]}'" for r in stuck)
                                       or "none is in another phase")]
        line = "; ".join(who) + "; last phases: " + " | ".join(f"{r}:{p}" for r, p in enumerate(phases))
        return Diagnosis(dead, failed, signalled, stuck, line)


_COMM = re.compile(r"gloo|nccl|hccl|connection (closed|reset|refused)|timed out|broken pipe|"
                   r"socket|by peer", re.IGNORECASE)


def is_communication_error(e: BaseException) -> bool:
    """A failed or timed-out collective (the culprit may be another rank), as opposed to this
    rank's own error. gloo raises plain RuntimeErrors, so the message decides."""
    import torch.distributed as dist
    return isinstance(e, getattr(dist, "DistError", ())) or bool(_COMM.search(str(e)))


def on_signals(live: Liveness | None) -> None:
    """SIGINT and SIGTERM end this rank with one line and exit code 128 + signal: "stopped by
    SIGTERM at step N (phase)", or, when torchrun stops the survivors of a failed rank, that
    failure. Handled in a thread woken through `signal.set_wakeup_fd`, so a main thread stuck in
    a C call still stops at once. `live` is None before the world exists."""
    def stop(signum: int) -> None:
        lock = live.ending if live else _EARLY
        if not lock.acquire(timeout=60):
            os._exit(128 + signum)
        name = signal.Signals(signum).name
        rank = int(os.environ.get("RANK", "0"))
        who = f"rank {rank}" + (f" ({live.role})" if live else "")
        why = None
        if live is not None:
            live.failing = True  # the heartbeat thread no longer acts on an abort notice
            try:
                live.store.set(f"{live.ns}/signal/{live.rank}", name)
            except Exception:  # noqa: BLE001
                pass
            if signum == signal.SIGTERM:
                why = live.abort_notice()
                if why is None:
                    d = live.diagnose()
                    why = "; ".join(f"rank {r} ({live.roles[r]}) died (no heartbeat)"
                                    for r in d.dead) or None
        if why:
            say(f"error: {who} stopped by the launcher after: {why}")
        else:
            where = live.where_text() if live else "during start-up"
            say(f"error: {who} stopped by {name} {where}")
        end(128 + signum)

    def handler(signum, frame):  # the main thread, when it gets to run Python code
        if live is not None and live.failing:  # already reporting its failure, or stopping
            return
        stop(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handler)
    if live is None or threading.current_thread() is not threading.main_thread():
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)

    def watch() -> None:
        while True:
            got = os.read(r, 1)
            if got and got[0] in (signal.SIGINT, signal.SIGTERM):
                stop(got[0])
    threading.Thread(target=watch, daemon=True, name="signals").start()


_EARLY = threading.Lock()


def exit_bad_input(e: ConfigError) -> int:
    """A config or start-up error that every rank finds alike: ONE line (rank 0; for a
    config.NodeConfigError, the node's first rank) and exit code 2 on every rank. Under torchrun
    the ranks first meet in the launcher's store (at most 60 s), so that torchrun's SIGTERM finds
    none still working. A plain process returns 2."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or (isinstance(e, NodeConfigError) and os.environ.get("LOCAL_RANK") == "0"):
        say(f"{getattr(e, 'prefix', 'config error')}: {e}")
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():  # found after start-up (a refused
            sys.stdout.flush()                               # resume): no teardown that aborts
            sys.stderr.flush()
            end(2)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    signal.signal(signal.SIGINT, lambda *_: os._exit(2))
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        try:
            import torch.distributed as dist
            size = int(os.environ.get("WORLD_SIZE", "1"))
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=datetime.timedelta(seconds=60))
            key = f"grpo/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/bad_input"
            if store.add(key, 1) >= size:
                store.set(key + "/all", "1")
            store.wait([key + "/all"], datetime.timedelta(seconds=60))
        except Exception:  # noqa: BLE001 - a rank that never arrives: exit anyway
            pass
    end(2)


def world_failed(e: BaseException, timeout_s: float) -> int:
    """Setting up the world failed, before any failure handling exists: ONE line naming this
    rank, MASTER_ADDR, MASTER_PORT and the timeout; returns exit code 4. A network error prints
    no traceback; any other error prints its traceback first."""
    env = os.environ
    network = is_communication_error(e)
    if not network:
        traceback.print_exc()
    hint = "; is rank 0's node up, and MASTER_PORT open to this one?" if network else ""
    say(f"error: rank {env.get('RANK', '0')} could not set up the world (MASTER_ADDR="
        f"{env.get('MASTER_ADDR', '?')}, MASTER_PORT={env.get('MASTER_PORT', '?')}, "
        f"cluster.timeout_s = {timeout_s:g} s): {one_line(e).rstrip('.')}{hint}")
    return 4


class EngineLog:
    """What the processes an engine starts (vLLM's engine core and workers) write, passed on to
    this rank's stdout and stderr line by line, the last `keep` lines kept: when the engine
    dies, its own error (the last exception line of the traceback it logged, often 100 lines
    above this rank's failure line) goes into that line (:func:`engine_error`). Use
    :meth:`attached` around starting the engine: the processes started inside inherit the pipes
    (vLLM logs to stdout, Python's tracebacks go to stderr)."""
    current: "EngineLog | None" = None
    _LINE = re.compile(r"(?:^|\] )((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)): (.+)$")

    def __init__(self, keep: int = 400):
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        EngineLog.current = self

    @contextlib.contextmanager
    def attached(self):
        sys.stdout.flush()
        sys.stderr.flush()
        own = {fd: self._tee(fd) for fd in (1, 2)}
        try:
            yield self
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, out in own.items():  # this rank's own streams again; the engine keeps the pipes
                os.dup2(out, fd)

    def _tee(self, fd: int) -> int:
        """Point `fd` at a pipe read by a thread that copies it to (a copy of) what `fd` was."""
        r, w = os.pipe()
        out = os.dup(fd)
        os.dup2(w, fd)
        os.close(w)
        threading.Thread(target=self._pump, args=(r, out), daemon=True, name="engine-log").start()
        return out

    def _pump(self, r: int, out: int) -> None:
        rest = b""
        while chunk := os.read(r, 65536):
            os.write(out, chunk)
            *whole, rest = (rest + chunk).split(b"\n")
            self.lines.extend(ln.decode(errors="replace") for ln in whole)

    def error(self) -> str | None:
        """The last exception line the engine's processes wrote ("RuntimeError: CPU Generator
        does not use offset"), not vLLM's own EngineDeadError, or None."""
        for line in reversed(list(self.lines)):
            if re.search(r"\b(WARNING|INFO|DEBUG)\b", line[:80]):  # a logged, survived error
                continue
            m = self._LINE.search(line.rstrip())
            if m and not m.group(1).endswith("EngineDeadError"):
                return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"
        return None


def engine_error(wait_s: float = 1.0) -> str | None:
    """The engine's own error line (:meth:`EngineLog.error`) of the current :class:`EngineLog`,
    or None. Waits up to `wait_s` for it: the engine logs its traceback just before it dies,
    and the pipe may not be read yet."""
    log = EngineLog.current
    deadline = time.monotonic() + wait_s
    while log is not None:
        if (line := log.error()) or time.monotonic() > deadline:
            return line
        time.sleep(0.05)
    return None


def fail_now(why: str) -> None:
    """From any thread: end this rank at once with one line ("error: rank 2 (generation) failed
    at step 2 (rollout): <why>"), tell the other ranks (they stop within a beat), exit 4. Before
    the world exists: the line and exit 4."""
    live = getattr(Liveness, "current", None)
    if live is None:
        say(f"error: rank {os.environ.get('RANK', '0')} failed: {why}")
        end(4)
    if not live.ending.acquire(timeout=60):  # another failure or a stop is already ending it
        return
    live.failing = True
    line = f"rank {live.rank} ({live.role}) failed {live.where_text()}: {why}"
    say(f"error: {line}")
    live.abort(line)
    end(4)


def guarded(live: Liveness, job: Callable[[], int]) -> int:
    """Run `job`; any failure ends THIS rank at once with a line naming the culprit (torchrun
    then stops the others, which print their own view). Config and start-up errors pass
    through (:func:`exit_bad_input`)."""
    rank, role = live.rank, live.role
    try:
        code = job()
        live.close()
        return code
    except ConfigError:
        raise
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        if isinstance(e, (SystemExit, KeyboardInterrupt)):
            raise
        live.failing = True  # this rank reports its own failure; keep beating meanwhile
        with live.ending:    # a signal stop under way wins: it ends the process
            where = live.where_text()
            if isinstance(e, Fatal):  # its cause a failed collective: name who died (a save)
                d = (live.diagnose() if any(is_communication_error(c) for c in causes(e))
                     else Diagnosis())
                tail = f"; {d.line}" if d.dead or d.failed or d.signalled else ""
                say(f"error: rank {rank} ({role}) failed {where}: {e}{tail}")
                live.abort(f"rank {rank} ({role}) failed {where}: {e}{tail}")
                end(4)
            notice = live.abort_notice() if is_communication_error(e) else None
            if notice:  # another rank failed first: this error is only its consequence
                say(f"error: rank {rank} ({role}) stopping: {notice}")
                end(5)
            d = live.diagnose() if is_communication_error(e) else Diagnosis()
            tail = f"; {d.line}" if d.line else ""
            what = one_line(e)
            own = (engine_error() if any(type(c).__name__ == "EngineDeadError" for c in causes(e))
                   else None)
            if own:  # vLLM's own message says only "see the stack trace above"
                what = f"{type(e).__name__}, the engine's own error: {own}"
            if not (d.dead or d.failed or d.signalled):  # else this error is only a consequence
                traceback.print_exc()        # first: the culprit line stays the last word
            say(f"error: rank {rank} ({role}) failed {where}: {what}{tail}")
            live.abort(f"rank {rank} ({role}) failed {where} ({type(e).__name__}){tail}")
            end(4)
