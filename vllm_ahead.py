"""vLLM driven by a worker thread: the vllm engine running ahead of the trainers (docs/async.md).

With `rollout.max_staleness > 1`, `rollout.stale = "drop"` or `rollout.partial`,
pipeline.Producer's worker thread generates while the rank's main thread receives each weight
sync. vLLM's `LLM` is not thread-safe, so :class:`Owner` lets one thread at a time into it, and
a call the main thread needs while the worker is generating (the weight receive) is posted to
the worker, which runs it at its next decode step. :func:`stepped` is that generation (a call
of `VLLMEngine.generate` handed a check): vLLM's `LLMEngine` stepped by hand (add_request /
step / abort_request) instead of `LLM.generate`, so the worker reaches a check point after
every decode step:

- a receive without `partial` lands in staging buffers in vLLM's worker, loaded at the next
  batch's start (a batch's weights never change mid-batch);
- a receive with `partial` ("recompute") needs the engine empty: the call's requests are
  aborted keeping the tokens and logprobs seen so far, the weights load, and the call ends
  there; the loop above the engines (multiturn.generate) continues every unfinished sample
  under the new weights, prefilled again;
- a receive with `partial = "keep"` (:func:`load_kept`) loads with the requests kept: vLLM's
  scheduler paused (`LLM.sleep(level=0, mode="keep")`), the steps its core made before the pause
  taken in under the old version, the weights loaded, scheduling resumed
  (`LLM.wake_up(tags=["scheduling"])`): the requests decode on over their KV as it is, later
  tokens under the new version. The prefix and encoder caches are reset once the call's
  requests are gone (VLLMEngine.fresh_caches), before any new request could reuse them.

Seeds: as `LLM.generate`'s (row r's samples seed + r * n + j).
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable

from episode import Check, Completion, Prompt, Sampling
from failures import fault_active

class _Task:
    __slots__ = ("fn", "empty", "done", "result", "error")

    def __init__(self, fn: Callable[[], object], empty: bool):
        self.fn, self.empty, self.done, self.result, self.error = fn, empty, False, None, None


class Owner:
    """Which thread is inside one vLLM `LLM` now (it is not thread-safe), and the calls other
    threads posted for it. Invariant: while no thread holds it, the engine runs no request."""

    def __init__(self, who: str, timeout_s: float | None):
        self.who, self.timeout_s = who, timeout_s
        self.cv = threading.Condition()
        self.holder: int | None = None   # thread ident
        self.tasks: list[_Task] = []
        self.calls: list[_Call] = []     # generate calls sharing the engine's steps (share_steps)

    def _give(self) -> None:
        with self.cv:
            self.holder = None
            self.cv.notify_all()

    @contextmanager
    def hold(self):
        """This thread alone in the LLM (a step loop in it runs the posted calls: stepped)."""
        with self.cv:
            if self.holder == threading.get_ident():
                raise RuntimeError("vLLM engine: entered twice by one thread")
            while self.holder is not None:
                self.cv.wait()
            self.holder = threading.get_ident()
        try:
            yield
        finally:
            self._give()

    def needs_empty(self) -> bool:
        return any(t.empty for t in self.tasks)  # read without the lock: a stale read costs a step

    def run_tasks(self, keep: bool = False) -> None:
        """By the holder: every posted call, in order; errors go back to their posters. `keep`:
        only the calls that keep the batch's weights (requests are in flight); one that needs
        the engine empty, and every call after it, waits for the holder's next check."""
        while True:
            with self.cv:
                if not self.tasks or (keep and self.tasks[0].empty):
                    return
                task = self.tasks.pop(0)
            try:
                task.result = task.fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the posting thread
                task.error = e
            with self.cv:
                task.done = True
                self.cv.notify_all()

    def call(self, fn: Callable[[], object], empty: bool) -> object:
        """`fn()` inside the LLM from a thread that does not hold it: run here when nobody holds
        it, else by a holder stepping requests at its next decode step (`empty`: with its
        requests aborted first), else here once the holder lets go. Waits at most timeout_s."""
        task = _Task(fn, empty)
        end = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        with self.cv:
            if self.holder == threading.get_ident():
                raise RuntimeError("vLLM engine: a call posted by the thread that holds it")
            self.tasks.append(task)
            while not task.done and self.holder is not None:
                if task not in self.tasks:  # running: the call bounds itself (VLLMEngine._rpc)
                    self.cv.wait()
                    continue
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    self.tasks.remove(task)
                    raise RuntimeError(f"{self.who}: the vLLM engine's worker thread reached no "
                                       f"decode step within {self.timeout_s:.0f} s "
                                       "(cluster.timeout_s) to take a weight sync")
                self.cv.wait(left)
            mine = not task.done
            if mine:
                self.holder = threading.get_ident()
        if mine:
            try:
                self.run_tasks()
            finally:
                self._give()
        if task.error is not None:
            raise task.error
        return task.result


class Batch:
    """One generate call's samples, added to vLLM's `LLMEngine` (`engine`) as requests.

    `render(list of vllm_engine.vllm_prompt inputs)`: vLLM's processed inputs for them;
    `params(sampling, seed)`: a streaming (DELTA) `SamplingParams`."""

    def __init__(self, engine, render: Callable, params: Callable[[Sampling, int], object],
                 prompts: list[Prompt], sp: Sampling, version: int, kept: bool = False):
        self.engine, self.render, self.params = engine, render, params
        self.prompts, self.sp, self.version = prompts, sp, version  # version: of the next tokens
        self.per = 1 if sp.greedy else sp.n
        self.seqs = [Completion([], [], True, [], kv_kept=kept) for _ in range(len(prompts) * self.per)]
        self.live: dict[str, int] = {}            # request id -> its first sample
        self.tag = f"grpo-{id(self):x}"
        self.seed, self.has_images = 0, any(ims for _, ims in prompts)

    def add(self, seed: int, salt: bool = False) -> None:
        """Every row with its n samples, row r's seeded seed + r * n (+ j: vLLM's child index).
        `salt`: the prompts' prefix-cache blocks salted with the batch's version (vLLM's
        `cache_salt`), so no block computed under other weights is reused for them."""
        inputs = self.render(self.prompts) if self.prompts else []
        for r, prompt in enumerate(inputs):
            if salt:
                prompt["cache_salt"] = f"grpo-v{self.version}"
            rid = f"{self.tag}-{r}"
            self.engine.add_request(rid, prompt, self.params(self.sp, seed + r * self.per))
            self.live[rid] = r * self.per

    def start(self, eng) -> None:
        """share_steps: the requests into the running engine (with "keep" salted by version:
        other calls' requests may hold KV of older weights)."""
        self.add(self.seed, salt=eng.keep)

    @staticmethod
    def step(eng, batches: list["Batch"]) -> None:
        """share_steps: one step of vLLM's engine, its outputs to every batch."""
        outputs = eng.llm.llm_engine.step()
        for b in batches:
            b.absorb(outputs)

    @staticmethod
    def load_kept(eng, batches: list["Batch"], lockstep: bool) -> None:
        load_kept(eng, batches, lockstep)

    def absorb(self, outputs) -> None:
        """One engine step's streamed outputs (new tokens of each request, DELTA)."""
        for out in outputs:
            first = self.live.get(out.request_id)
            if first is None:  # an aborted request's late output
                continue
            for c in out.outputs:
                s, ids = first + c.index, list(c.token_ids)
                seq = self.seqs[s]
                if ids:  # vLLM hands the delta's logprobs (all of them when no token is new)
                    lps = c.logprobs[len(c.logprobs) - len(ids):]
                    seq.ids += ids
                    seq.logprobs += [float(lp[t].logprob) for t, lp in zip(ids, lps, strict=True)]
                    seq.versions += [self.version] * len(ids)
                if c.finish_reason is not None:
                    seq.truncated = c.finish_reason == "length"
            if out.finished:
                del self.live[out.request_id]

    def abort(self) -> None:
        """End every request in flight; their samples keep what was seen of them."""
        if self.live:
            self.engine.abort_request(list(self.live))
            self.live.clear()

    def completions(self) -> list[list[Completion]]:
        return [self.seqs[i * self.per:(i + 1) * self.per] for i in range(len(self.prompts))]


def stepped(eng, prompts: list[Prompt], sp: Sampling, seed: int, check: Check) -> list[list[Completion]]:
    """`eng.generate(prompts, sp, seed, check)` (vllm_engine.VLLMEngine, or a stand-in with
    `llm`, `owner`, `render`, `stream_params`, `weight_version`, `keep`, `fresh_caches`), in the
    thread that drives it: vLLM's `LLMEngine` stepped by hand, the call's requests among those of
    every concurrent call (:func:`share_steps`). `check()` gives the call's version. After each
    decode step: posted calls that keep the weights run at once; one that loads weights
    (`empty`), or a check that returns another version, ends the call: requests aborted (their
    samples keep their tokens so far), posted calls run. With `eng.keep` (rollout.partial =
    "keep") posted calls run with the requests kept (:func:`load_kept`) and the call goes on,
    each token recording the version `check()` gave before its step. What `check` raises ends
    the call the same way."""
    batch = Batch(eng.llm.llm_engine, eng.render, eng.stream_params, prompts, sp, 0, kept=eng.keep)
    batch.seed = seed
    share_steps(eng, batch, check)
    return batch.completions()


class _Call:
    """One generate call among those sharing an engine's decode steps (:func:`share_steps`)."""
    __slots__ = ("batch", "check", "thread", "version", "started", "ended", "error")

    def __init__(self, batch, check: Check):
        self.batch, self.check, self.thread = batch, check, threading.get_ident()
        self.version, self.started, self.ended, self.error = None, False, False, None


def share_steps(eng, batch, check: Check) -> None:
    """Run `batch` to its end on `eng`, whose decode steps every concurrent call shares
    (continuous batching across calls: episode.Engine.STEPS_SHARED; `rollout.batches_in_flight`).

    One thread at a time steps (`eng.owner`'s holder): each step advances every started call's
    requests, then hands each call its own check. A call made while another thread steps is
    registered and waits: the stepper starts it (its check's version, `batch.start(eng)`) at its
    next step, ends it, or, when its own call ends, hands the stepping over to it. The engine
    (`eng`): `owner`, `keep`, `fresh_caches()`, `stale_caches`; a batch (:class:`Batch`, or
    bench/engine_time.py's modelled one): `start(eng)`, `live`, `abort()`, `version` (of its
    next tokens), `has_images`, and its class's `step(eng, batches)` (one decode step of all of
    them) and `load_kept(eng, batches, lockstep)`. With one call at a time this is the plain
    loop: start, step, check, until the batch ends or the check ends it."""
    owner, me = eng.owner, _Call(batch, check)
    with owner.cv:
        if owner.holder == me.thread:
            raise RuntimeError("vLLM engine: entered twice by one thread")
        owner.calls.append(me)
        while not me.ended and owner.holder not in (None, me.thread):
            owner.cv.wait()
        if me.ended:  # by the stepper (done, or its error): this thread never stepped
            owner.calls.remove(me)
        else:
            owner.holder = me.thread
    if not me.ended:
        _step_calls(eng, me)
    if me.error is not None:
        raise me.error


def _end(owner: Owner, call: _Call, error: BaseException | None = None) -> None:
    call.batch.abort()
    with owner.cv:
        call.ended, call.error = True, error
        owner.cv.notify_all()


def _step_calls(eng, me: _Call) -> None:
    """By the holder: step every started call until `me` ends, then hand the steps over (or,
    with no call left, run the posted calls, reset stale caches and let go)."""
    owner, keep, kind = eng.owner, eng.keep, type(me.batch)
    # tests (GRPO_FAULT=hold_for_weights, pipeline.Producer.check): a check may hold this thread
    # until weights come; vLLM's core, a process of its own, would decode on meanwhile, so with
    # keep every check runs with the core paused too (the schedule the hold pins, on any machine)
    lockstep = keep and fault_active("hold_for_weights")
    try:
        while not me.ended:
            live = [c for c in _calls(owner) if c.started and not c.ended]
            if not live:  # the engine is empty: posted calls, then no stale cache is reused
                owner.run_tasks()
                if keep and eng.stale_caches:
                    eng.fresh_caches()
            _start_calls(eng, owner, live)
            live = _running(owner)
            if not live:
                continue
            kind.step(eng, [c.batch for c in live])
            live = _running(owner)
            if live and not keep and owner.needs_empty():  # a load ends every call
                for c in live:
                    _end(owner, c)
                continue
            if keep and live and (owner.tasks or lockstep):
                kind.load_kept(eng, [c.batch for c in live], lockstep)
                live = _running(owner)  # the steps taken in may have ended some
            for c in live:
                try:
                    version = c.check()
                except BaseException as e:  # noqa: BLE001 - raised in the call's own thread
                    _end(owner, c, e)
                    continue
                if keep:
                    c.batch.version = version
                elif version != c.version:
                    _end(owner, c)
            if not keep and owner.tasks and any(not c.ended for c in live):
                owner.run_tasks(keep=True)  # posted since the checks: a weight load waits for them
    except BaseException as e:
        for c in [c for c in _calls(owner) if not c.ended]:
            _end(owner, c, e if c is me else RuntimeError(f"the engine's stepping failed: {e!r}"))
        raise
    finally:
        with owner.cv:
            owner.calls.remove(me)
            nxt = next((c for c in owner.calls if not c.ended), None)
            if nxt is not None:  # its thread steps on (the engine stays held)
                owner.holder = nxt.thread
                owner.cv.notify_all()
        if nxt is None:
            try:
                owner.run_tasks()
                if keep:
                    eng.fresh_caches()  # a load mid-call: no new request reuses the old weights' KV
            finally:
                owner._give()


def _running(owner: Owner) -> list[_Call]:
    """The started calls not ended, those whose requests are all done ended first."""
    for c in [c for c in _calls(owner) if c.started and not c.ended and not c.batch.live]:
        _end(owner, c)
    return [c for c in _calls(owner) if c.started and not c.ended]


def _calls(owner: Owner) -> list[_Call]:
    """The registered calls now (other threads add and remove theirs)."""
    with owner.cv:
        return list(owner.calls)


def _start_calls(eng, owner: Owner, live: list[_Call]) -> None:
    """The calls registered since the last step: each its check's version, then its requests.
    With "keep" after a load mid-call (caches stale) a batch with images waits for the engine
    to empty: vLLM's encoder cache is keyed by the image alone (prompts are salted by version)."""
    for c in [c for c in _calls(owner) if not c.started and not c.ended]:
        if live and eng.stale_caches and c.batch.has_images:
            continue
        try:
            c.version = c.batch.version = c.check()
            c.batch.start(eng)
            c.started = True
        except BaseException as e:  # noqa: BLE001 - raised in the call's own thread
            _end(owner, c, e)


def load_kept(eng, batches: list, lockstep: bool = False) -> None:
    """The posted calls (weight loads) between two decode steps with `batches`' requests kept:
    vLLM's scheduler paused with them held (`LLM.sleep(level=0, mode="keep")`), what its core
    had stepped before the pause taken in under each batch's version (:func:`queued_steps`),
    the calls run, scheduling resumed (`LLM.wake_up(tags=["scheduling"])`). `lockstep`: the
    owner's calls' checks called first, paused (the tests' lockstep in :func:`_step_calls`)."""
    engine = eng.llm.llm_engine
    eng.llm.sleep(level=0, mode="keep")
    try:
        if lockstep:
            for c in [c for c in _calls(eng.owner) if c.started and not c.ended]:
                try:
                    c.check()
                except BaseException as e:  # noqa: BLE001 - raised in the call's own thread
                    _end(eng.owner, c, e)
        for _ in range(queued_steps(engine)):
            outputs = engine.step()
            for b in batches:
                b.absorb(outputs)
        eng.owner.run_tasks()
    finally:
        eng.llm.wake_up(tags=["scheduling"])


def queued_steps(engine) -> int:
    """The engine core's outputs that `engine.step()` has not taken yet. vLLM 0.23's core runs
    in a process of its own (`SyncMPClient`) and steps on its own while requests run; the
    client's output thread puts each message it gets on `outputs_queue` in order, and resolves
    a utility call's reply (such as `sleep`'s, sent once the core paused) only after every
    message before it, so once `LLM.sleep` returns the queue holds exactly the steps made before
    the pause. An in-process core (`InprocClient`) steps only in `step()`: none. Another client
    (a vLLM this was not written for): one line, not a guess."""
    core = engine.engine_core
    queue = getattr(core, "outputs_queue", None)
    if queue is not None:
        return queue.qsize()
    if type(core).__name__ == "InprocClient":
        return 0
    raise RuntimeError(f"rollout.partial = \"keep\": vLLM's engine client {type(core).__name__} has "
                       "no outputs_queue; which tokens came before a weight load cannot be told")
