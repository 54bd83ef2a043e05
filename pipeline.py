"""Engines running ahead of the trainers (`rollout.max_staleness = k >= 1`).

On a generation rank a worker thread (:class:`Producer`) runs the engine over the seeded prompt
stream, batch after batch (batch `s` = `data.step_problems(s)`'s share of this rank), into a
queue of finished groups. The rank's main thread stays in lock-step with every other rank (the
step's exchange and weight sync: world.py's groups, entered in the same order everywhere) and
only hands things over: at each step it takes the oldest `per_gen` groups (:meth:`take`), at
each sync it receives the new weights into the receiver's buffers (:meth:`receive_weights`), which the
worker loads at a batch's start, and with `rollout.partial` at the engine's next decode step:
the engine is handed :meth:`Producer.check` (episode.Engine.generate), which loads them and
returns their version, so the engine's call ends there and the batch goes on under them
(multiturn.generate). So the trainers wait for the engines only when the
queue is empty, and the engines wait for the trainers only at the staleness bound:

- `rollout.stale = "wait"` (AReaL's rule): batch `s` starts only once the engine can hold the
  weights the trainers have at step `s - k`, so every group is at most k versions old when
  trained, and step `t` trains exactly batch `t` (as the synchronous loop does);
- `"drop"` (verl's): the worker starts a batch whenever fewer than k + 1 wait in the queue;
  groups more than k versions old when taken are dropped and counted, and the stream moves on
  (the position, :meth:`position`, is saved with each checkpoint).

k = 1 with "wait" is the one-step overlap (batch s sampled with version s - 1, exactly).

An engine with its own weight channel (vLLM: `OWN_CHANNEL`, an episode.AheadEngine) receives in
its own processes, and its `LLM` takes one thread at a time: the sync is posted to the engine
(`receive_ahead`), which runs it at the worker's next decode step (vllm_ahead.py): into staging
buffers loaded at the next batch's start, or with `rollout.partial` loaded at once, ending the
engine's call (the batch goes on under the new weights). (k = 1 with "wait" and no partial
stays the main thread's overlap there: :class:`Generation`.)

A pause (evaluation, :meth:`Producer.paused`) with `rollout.partial` ends the batch in flight at
its next decode step (the check raises) and makes it again after, from its start.
"""
from __future__ import annotations

import functools
import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from typing import Callable, NamedTuple

from episode import Check, Engine
from failures import fault_active


class Bound(NamedTuple):
    """The staleness rule: `k`, "wait" or "drop", and the version the trainers hold at `step`
    (`version0` at `step0`, one more per step when the sync is on)."""
    k: int
    stale: str
    step0: int
    version0: int
    syncs: bool

    def version_at(self, step: int) -> int:
        return self.version0 + (max(0, step - self.step0) if self.syncs else 0)


class _Stopped(Exception):
    """Raised at a check point when the producer is stopped: ends the worker quietly."""


class _Paused(Exception):
    """Raised at a check point when a pause is asked: the batch in flight is made again after."""


class Producer:
    """The generation worker of one generation rank (see the module docstring).

    `make(index, version, check)` generates and scores batch `index` of the prompt stream with
    the engine's current weights (`version`), handing the engine `check` (None: no check):
    (episodes sorted by group, stats). `position` (batch, groups already taken
    from it) is where the stream starts: (step, 0) for a fresh or "wait" run, the checkpoint's
    for "drop". `limit`: no batch at or after it ("wait": run.steps; "drop": None)."""

    def __init__(self, engine: Engine, make: Callable[[int, int, Check | None], tuple[list, dict]], bound: Bound,
                 position: tuple[int, int], limit: int | None, partial: bool = False, lanes: int = 1):
        self.engine, self.make, self.bound, self.limit = engine, make, bound, limit
        self.loaded = bound.version0        # the version in the engine
        self.staged: tuple[int, dict] | None = None  # received, not yet loaded: (version, name -> tensor)
        self.queue: deque = deque()         # [batch index, groups left, stats, groups taken] in stream order
        self.index, self.skip = position    # the next batch to start; groups of the first taken already
        self.out = self.index               # the next batch to queue
        self.lanes = lanes                  # batches generated at once (rollout.batches_in_flight)
        self.flight: dict[int, tuple | None] = {}  # started batches not queued -> (groups, stats) once made
        self.redo: list[int] = []           # batches a pause ended, made again from their start
        self.most = 0                       # the most batches generating at once since the last take
        self.cv = threading.Condition()
        self.weights = threading.Lock()     # the receiver's buffers: written by receive, read by _load
        self.error: BaseException | None = None
        self.stopping = self.pause_asked = self.idle = False
        self._checks: dict[int, int] = {}   # check points of each batch in flight
        self._held = False                  # GRPO_FAULT's hold happened
        self.holding = False
        self.idle_s, self._idle_since, self._last_take = 0.0, None, time.perf_counter()
        self.own, self.partial = engine.OWN_CHANNEL, partial
        if self.own and engine.weight_version != self.loaded:
            raise RuntimeError(f"the engine holds weight version {engine.weight_version}, the "
                               f"trainers {self.loaded}")
        self.threads: list[threading.Thread] = []  # batch threads (lanes > 1)
        self.thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the worker threads
    def _next(self) -> int:
        return min(self.redo) if self.redo else self.index

    def _may_start(self) -> bool:
        if (self.pause_asked or self.error is not None or len(self.flight) >= self.lanes
                or (self.limit is not None and self._next() >= self.limit)):
            return False
        if self.flight and self.partial and not self._held and fault_active("hold_for_weights"):
            return False  # tests: one batch at a time until the hold, which holds every batch's steps
        if self.bound.stale == "drop":
            return len(self.queue) + len(self.flight) <= self.bound.k
        have = max(self.loaded, self.staged[0] if self.staged else self.loaded)
        return have >= self.bound.version_at(self._next() - self.bound.k)

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Under self.cv: wait until `ready()` or a stop; the time no batch is in flight
        meanwhile is engine idle time."""
        while not ready() and not self.stopping:
            self._idle(not self.flight)
            self.cv.wait()
        self._idle(False)
        if self.stopping:
            raise _Stopped

    def _idle(self, idle: bool) -> None:
        if idle and not self.idle:
            self.idle, self._idle_since = True, time.perf_counter()
            self.cv.notify_all()
        elif not idle and self.idle:
            self.idle_s += time.perf_counter() - self._idle_since
            self.idle, self._idle_since = False, None

    def _run(self) -> None:
        """Start each batch once the staleness rule lets it and a lane is free: made here with
        one lane, else in a thread of its own (the engine shares its decode steps among them)."""
        try:
            while True:
                with self.cv:
                    self._wait(self._may_start)
                    index = self._next()
                    if index in self.redo:
                        self.redo.remove(index)
                    else:
                        self.index += 1
                    self.flight[index], self._checks[index] = None, 0
                    self.most = max(self.most, sum(v is None for v in self.flight.values()))
                if self.lanes == 1:
                    self._make(index)
                    continue
                thread = threading.Thread(target=self._make, args=(index,), name=f"engine-batch-{index}",
                                          daemon=True)
                self.threads.append(thread)
                thread.start()
        except _Stopped:
            return
        except BaseException as e:  # the main thread raises it at its next take
            with self.cv:
                self.error = e
                self.cv.notify_all()

    def _make(self, index: int) -> None:
        """Batch `index`, queued in stream order once it and every batch before it are made.
        With one lane its weights load at its start (they change mid-batch only with partial,
        at the checks); a pause ends it to be made again from its start."""
        try:
            if self.lanes == 1:
                self._load()
            check = functools.partial(self.check, index) if self.partial or self.own else None
            episodes, stats = self.make(index, self.loaded, check)
        except BaseException as e:
            with self.cv:
                del self.flight[index]
                if isinstance(e, _Paused):
                    self.redo.append(index)
                elif not isinstance(e, _Stopped) and self.lanes > 1:
                    self.error = e
                self.cv.notify_all()
            if self.lanes == 1 and not isinstance(e, _Paused):
                raise
            return
        groups: dict[int, list] = {}
        for e in episodes:
            groups.setdefault(e.group, []).append(e)
        with self.cv:
            self.flight[index] = (list(groups.values()), stats)
            while self.flight.get(self.out) is not None:
                made, stats = self.flight.pop(self.out)
                skip, self.skip = (self.skip, 0)
                self.queue.append([self.out, made[skip:], stats, skip])
                self.out += 1
            self.cv.notify_all()

    def check(self, index: int) -> int:
        """What the engine is handed for batch `index` (episode.Check): before a batch's first
        token and after each decode step. Raises to stop. With partial rollouts it also raises
        to end the batch on a pause, and loads the newest weights received (an own-channel
        engine loaded them itself) and returns their version, so the engine's call ends once
        newer weights are in (or, with `rollout.partial = "keep"`, decodes on under them over
        its KV as it is); without (an own-channel engine's batch) the weights stay."""
        self._checks[index] += 1
        if self.partial and self._checks[index] == 2 and not self._held and fault_active("hold_for_weights"):
            self._hold_for_weights(index)
        if self.stopping:
            raise _Stopped
        if not self.partial:
            return self.loaded
        if self.pause_asked:
            raise _Paused
        if self.own:
            with self.cv:
                self.loaded = max(self.loaded, self.engine.weight_version)
        elif self.staged is not None:
            self._load()
        return self.loaded

    def _hold_for_weights(self, index: int, timeout_s: float = 120.0) -> None:
        """Tests (`GRPO_FAULT=hold_for_weights`): the first batch generated ahead of the trainers
        waits after its first decode step until newer weights come, so its episodes span two
        versions on any machine, whichever side is faster. Only a batch the trainers do not need
        for their next sync (its index past the step of the weights the engine holds) waits."""
        with self.cv:
            trainers_at = self.bound.step0 + (self.loaded - self.bound.version0)
            if not self.bound.syncs or index <= trainers_at:
                return
            self._held = self.holding = True
            self.cv.notify_all()
            end = time.monotonic() + timeout_s
            while not (self.staged is not None or self.pause_asked or self.stopping
                       or (self.own and self.engine.weights_waiting())) and time.monotonic() < end:
                self.cv.wait(0.05)
            self.holding = False

    def settle(self) -> None:
        """Tests (`GRPO_FAULT=fill_queue@step`, Generation.episodes): until the worker waits at the bound
        (its queue as full as the staleness rule lets it be), so a step finds the engine as far
        ahead as it can be on any machine (or held by `hold_for_weights`)."""
        with self.cv:
            while not (self.idle or self.holding or self.error or not self.thread.is_alive()):
                self.cv.wait(timeout=1.0)

    def _load(self) -> None:
        if self.own:  # what the engine staged (receive_ahead), if anything
            got = self.engine.load_staged()
            with self.cv:
                self.loaded = self.loaded if got is None else got
                if self.staged is not None and self.staged[0] <= self.loaded:
                    self.staged = None
                self.cv.notify_all()
            return
        with self.weights:
            if self.staged is not None:
                version, named = self.staged
                self.engine.load_weights(list(named.items()))
                self.loaded, self.staged = version, None
        with self.cv:
            self.cv.notify_all()

    # ------------------------------------------------------------------ the main thread
    def receive_weights(self, source) -> int:
        """One weight sync into the receiver's buffers (`source`: sync.Receiver); the worker
        loads them at its next check point (own channel: the engine receives them there).
        Returns the version received."""
        if self.own:
            version = self.engine.receive_ahead(source, stage=not self.partial)
        else:
            version, _ = source.control()  # waits for the trainers; the worker goes on meanwhile
            with self.weights:
                named = dict(self.staged[1]) if self.staged else {}
                for bucket in source.buckets():
                    named.update(bucket)
                self.staged = (version, named)
        with self.cv:
            if self.own and self.partial:
                self.loaded = max(self.loaded, version)
            elif self.own and version > self.loaded:
                self.staged = (version, {})
            self.cv.notify_all()
        return version

    def take(self, n: int, min_version: int, group_offset: int) -> tuple[list, dict]:
        """The oldest `n` groups whose version (their oldest token's) is at least `min_version`,
        renumbered `group_offset + j`; older ones are dropped. Waits while the queue is empty.
        Stats: the batches' summed timings, `dropped` (groups), `queue_groups` (left queued),
        `engine_idle_frac` and `in_flight` (the most batches generating at once; both since the
        last take), `position`."""
        out, dropped, stats = [], 0, {"generate_s": 0.0, "reward_s": 0.0, "prompts": 0,
                                       "refill_rounds": 0, "reprefill_tokens": 0}
        with self.cv:
            while len(out) < n:
                self._wait_for_queue()
                entry = self.queue[0]
                if entry[2] is not None:  # a batch's timings count once, at its first take
                    for key in stats:
                        stats[key] = (max if key == "refill_rounds" else sum)((stats[key], entry[2].get(key, 0)))
                    entry[2] = None
                group = entry[1].pop(0)
                entry[3] += 1
                if min(e.version for e in group) < min_version:
                    dropped += 1
                else:
                    out.append(group)
                if not entry[1]:
                    self.queue.popleft()
                    self.cv.notify_all()  # "drop": room in the queue for the worker's next batch
            now = time.perf_counter()
            idle = self.idle_s + (now - self._idle_since if self._idle_since else 0.0)
            self.idle_s, self._idle_since = 0.0, (now if self.idle else None)
            stats.update(dropped=dropped, queue_groups=sum(len(q[1]) for q in self.queue), in_flight=self.most,
                         engine_idle_frac=idle / max(1e-9, now - self._last_take),
                         position=self.position())
            self._last_take, self.most = now, sum(v is None for v in self.flight.values())
        for j, group in enumerate(out):
            for e in group:
                e.group = group_offset + j
        return [e for g in out for e in g], stats

    def _wait_for_queue(self) -> None:
        while not self.queue:
            if self.error is not None:
                raise self.error
            if not self.thread.is_alive():
                raise RuntimeError("the engine worker ended with nothing queued (the prompt stream "
                                   "ran past rollout's limit)")
            self.cv.wait(timeout=1.0)

    def position(self) -> list[int]:
        """[batch, groups of it already taken]: where a resumed run's stream starts."""
        if self.queue:
            return [self.queue[0][0], self.queue[0][3]]
        return [self.out, self.skip]

    @contextmanager
    def paused(self):
        """The worker idle at a check point with the newest weights loaded (evaluation uses the
        engine meanwhile, in the main thread, without the worker's check points)."""
        with self.cv:
            self.pause_asked = True
            self.cv.notify_all()
            while not (self.idle or self.error or not self.thread.is_alive()):
                self.cv.wait(timeout=1.0)
        self._load()
        try:
            yield
        finally:
            with self.cv:
                self.pause_asked = False
                self.cv.notify_all()

    def stop(self) -> None:
        """End the worker at its next check point (with partial rollouts the next decode step;
        without, a batch in flight finishes first)."""
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        for thread in [self.thread, *self.threads]:
            thread.join()


def stages_received(ro) -> bool:
    """Whether a generation rank's engine stages a received version (`[rollout]` ro): vLLM
    running ahead without partial rollouts (:class:`Generation` starts a Producer, which
    receives with stage = not partial), i.e. max_staleness > 1, or >= 1 with stale = "drop"."""
    ahead = ro.max_staleness > 1 or (ro.max_staleness >= 1 and ro.stale == "drop")
    return ro.engine == "vllm" and ahead and not ro.partial


def staging_memory_line(cfg, world, dev, device, model_path: str) -> str:
    """The start-up memory line of engines that stage received versions (device.staging_memory;
    "" when none does), refused (ConfigError on every rank) where the copy cannot fit. Trainer
    rank 0 decides, its device standing for the engines' (same kind), before any model loads."""
    if not stages_received(cfg.rollout):
        return ""
    import torch.distributed as dist

    import device as D
    import model as M
    from errors import ConfigError
    decided = [None]
    if world.rank == 0:
        n = sum(p.numel() for p in M.model_from_config(model_path, meta=True).parameters())
        decided = [D.staging_memory(cfg.rollout, cfg.model.dtype, n, D.total_memory(dev, device))]
    if world.size > 1:
        dist.broadcast_object_list(decided, src=0, group=world.ctrl)
    line, fits = decided[0]
    if not fits:
        raise ConfigError(line)
    return line


class Generation:
    """A generation rank's episodes for each step: generated in the step (k = 0), one step ahead
    in this thread between the exchange and the sync (k = 1, "wait", no partial, with an engine
    that receives weights in its own processes: vLLM), or by a :class:`Producer` running ahead
    in a worker thread.
    `make(step, version)`: batch `step` of the prompt stream with weights `version` (train.generate)."""

    def __init__(self, engine, cfg, world, progress, make: Callable[[int, int], tuple[list, dict]]):
        self.cfg, self.world, self.make, self.engine = cfg, world, make, engine
        self.pending, self.producer = None, None
        ro = cfg.rollout
        if not (world.is_gen and ro.max_staleness) or (
                engine.OWN_CHANNEL and ro.max_staleness == 1 and ro.stale == "wait" and not ro.partial):
            return
        bound = Bound(ro.max_staleness, ro.stale, progress.step, progress.version, cfg.sync.enabled)
        position = (tuple(progress.stream[world.gen_index]) if ro.stale == "drop" and progress.stream
                    else (progress.step, 0))
        self.producer = Producer(engine, make, bound, position,
                                 limit=cfg.run.steps if ro.stale == "wait" else None,
                                 partial=ro.partial, lanes=ro.batches_in_flight)

    def episodes(self, step: int, version: int) -> tuple[list, dict]:
        if self.producer is not None:
            if fault_active("fill_queue", step):  # tests: the engine as far ahead as it may be
                self.producer.settle()
            per_gen = self.cfg.rollout.prompts_per_step // len(self.world.gens)
            return self.producer.take(per_gen, self.producer.bound.version_at(step) - self.producer.bound.k,
                                      self.world.gen_index * per_gen)
        local, self.pending = self.pending or self.make(step, version), None
        return local

    def after_exchange(self, step: int, version: int, live) -> None:
        """k = 1 in this thread: step + 1's batch with the current weights while the trainers
        train on this one; the sync waits for both. Colocated (cluster.colocate, never ahead):
        the engine sleeps, the device the trainer's until the sync wakes it."""
        if self.world.colocated:
            self.engine.sleep()
            return
        if (self.world.is_gen and self.producer is None and self.cfg.rollout.max_staleness
                and step + 1 < self.cfg.run.steps):
            live.phase(step, f"rollout of step {step + 1} (overlap)")
            self.pending = self.make(step + 1, version)

    def loader(self):
        """What a sync loads into on this rank: the engine, or the producer's staging."""
        return self.producer or self.engine

    def paused(self):
        return self.producer.paused() if self.producer is not None else nullcontext()

    def close(self) -> None:
        if self.producer is not None:
            self.producer.stop()
