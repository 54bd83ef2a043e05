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

    def add(self, seed: int) -> None:
        """Every row with its n samples, row r's seeded seed + r * n (+ j: vLLM's child index)."""
        inputs = self.render(self.prompts) if self.prompts else []
        for r, prompt in enumerate(inputs):
            rid = f"{self.tag}-{r}"
            self.engine.add_request(rid, prompt, self.params(self.sp, seed + r * self.per))
            self.live[rid] = r * self.per

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
    `llm`, `owner`, `render`, `stream_params`, `weight_version`, and with `keep` a
    `fresh_caches`), in the thread that drives it.

    Calls posted before the batch run first; `check()` gives the call's version. After each
    decode step: posted calls that keep the weights run at once; one that loads weights
    (`empty`), or a check that returns another version, ends the call: requests aborted (their
    samples keep their tokens so far), posted calls run. With `eng.keep` (rollout.partial =
    "keep") posted calls run with the requests kept (:func:`load_kept`) and the call goes on,
    each token recording the version `check()` gave before its step. What `check` raises ends
    the call the same way."""
    engine, keep = eng.llm.llm_engine, getattr(eng, "keep", False)
    # tests (GRPO_FAULT=hold_for_weights, pipeline.Producer.check): a check may hold this thread
    # until weights come; vLLM's core, a process of its own, would decode on meanwhile, so with
    # keep every check runs with the core paused too (the schedule the hold pins, on any machine)
    lockstep = keep and fault_active("hold_for_weights")
    with eng.owner.hold():
        eng.owner.run_tasks()
        version = check()
        batch = Batch(engine, eng.render, eng.stream_params, prompts, sp, version, kept=keep)
        try:
            batch.add(seed)
            while batch.live:
                batch.absorb(engine.step())
                if keep and batch.live:
                    if eng.owner.tasks or lockstep:
                        load_kept(eng, batch, check if lockstep else None)
                    batch.version = check()
                    continue
                if not batch.live or eng.owner.needs_empty() or check() != version:
                    break
                if eng.owner.tasks:  # posted since the check: a weight load waits for it
                    eng.owner.run_tasks(keep=True)
        finally:
            batch.abort()
            eng.owner.run_tasks()
            if keep:
                eng.fresh_caches()  # a load mid-call: no new request reuses the old weights' KV
    return batch.completions()


def load_kept(eng, batch: Batch, check: Check | None = None) -> None:
    """The posted calls (weight loads) between two decode steps with `batch`'s requests kept:
    vLLM's scheduler paused with them held (`LLM.sleep(level=0, mode="keep")`), what its core
    had stepped before the pause taken in under the batch's version (:func:`queued_steps`),
    the calls run, scheduling resumed (`LLM.wake_up(tags=["scheduling"])`). `check`: called
    first, paused (the tests' lockstep in :func:`stepped`)."""
    engine = eng.llm.llm_engine
    eng.llm.sleep(level=0, mode="keep")
    try:
        if check is not None:
            check()
        for _ in range(queued_steps(engine)):
            batch.absorb(engine.step())
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
