"""pipeline.Producer (engines running ahead, rollout.max_staleness = k) with a stand-in engine
and scripted trainers, and the hf engine's partial generation (a check, multiturn.generate's
loop) with a real tiny model:
every token records its version, and its logprob is the one that version's weights give."""
from __future__ import annotations

import threading
import time
from collections import deque

import pytest
import torch

import pipeline as P
import hf_engine as HF
import episode as E

PER = 2  # groups per batch
G = 2    # episodes per group


class Engine:
    OWN_CHANNEL = False

    def __init__(self):
        self.loaded = []

    def load_weights(self, named, adopt=False):
        self.loaded.append(dict(named))


class Source:
    """A sync.Receiver stand-in: one sync of `version` with one tensor."""

    def __init__(self, version):
        self.version = version

    def control(self):
        return self.version, [[]]

    def buckets(self):
        yield [("w", torch.tensor([float(self.version)]))]


def batch(index, version, check=None):
    return [E.Episode(index, g, [1], [2, 3], [0.0, 0.0], 0.0, {}, version, False)
            for g in range(PER) for _ in range(G)], {"generate_s": 0.01, "reward_s": 0.0,
                                                      "prompts": PER, "refill_rounds": 0}


def settle(producer, queued, timeout=10.0):
    """Until the worker waits (idle) with `queued` batches in its queue."""
    end = time.time() + timeout
    while time.time() < end:
        with producer.cv:
            if producer.idle and len(producer.queue) == queued:
                return
        time.sleep(0.01)
    raise AssertionError(f"worker not idle with {queued} queued: {len(producer.queue)}")


def test_wait_runs_k_ahead_and_never_past_the_bound():
    k = 2
    p = P.Producer(Engine(), batch, P.Bound(k, "wait", 0, 0, True), (0, 0), limit=8)
    try:
        settle(p, k + 1)  # batches 0..k with version 0, then batch k+1 needs version 1
        assert [q[0] for q in p.queue] == [0, 1, 2]
        for step in range(8):
            eps, st = p.take(PER, p.bound.version_at(step) - k, 10)
            assert {e.index for e in eps} == {step}          # step t trains batch t
            assert [e.group for e in eps] == [10, 10, 11, 11]
            assert all(step - e.version <= k for e in eps)
            assert min(step - e.version for e in eps) == min(step, k)  # it really ran ahead
            assert st["dropped"] == 0 and st["position"][0] == step + 1
            p.receive_weights(Source(step + 1))
            settle(p, min(k + 1, 7 - step))  # slow trainers: the worker is at the bound again
    finally:
        p.stop()


def test_drop_at_the_bound_counts_and_moves_the_stream_on():
    engine = Engine()
    p = P.Producer(engine, batch, P.Bound(1, "drop", 0, 0, True), (0, 0), limit=None)
    try:
        settle(p, 2)  # k + 1 batches of version 0, then the queue is full
        for v in (1, 2, 3):
            p.receive_weights(Source(v))
        eps, st = p.take(PER, 2, 0)  # the trainers at version 3, k = 1: version 0 is stale
        assert st["dropped"] == 2 * PER
        assert {e.index for e in eps} == {2} and {e.version for e in eps} == {3}
        assert engine.loaded[-1]["w"].item() == 3.0  # the newest weights, loaded at batch start
    finally:
        p.stop()


def test_drop_refills_the_queue_after_a_take_without_waiting_for_a_sync():
    """"drop" bounds the queue, not the versions: a take makes room and the worker starts its
    next batch at once (it used to sleep until the next weight sync woke it)."""
    p = P.Producer(Engine(), batch, P.Bound(1, "drop", 0, 0, True), (0, 0), limit=None)
    try:
        settle(p, 2)
        p.take(PER, 0, 0)
        settle(p, 2)  # batch 2 made with no sync in between
        assert [q[0] for q in p.queue] == [1, 2] and p.loaded == 0
    finally:
        p.stop()


def test_position_resumes_inside_a_batch():
    p = P.Producer(Engine(), batch, P.Bound(1, "drop", 5, 5, True), (5, 1), limit=None)
    try:
        eps, st = p.take(PER, 0, 0)
        assert [e.index for e in eps] == [5, 5, 6, 6]  # batch 5's second group, then batch 6
        assert st["position"] == [6, 1]
    finally:
        p.stop()


def test_worker_error_reaches_the_main_thread():
    def broken(index, version, check):
        raise ValueError("reward crashed in batch 0")
    p = P.Producer(Engine(), broken, P.Bound(1, "wait", 0, 0, True), (0, 0), limit=4)
    with pytest.raises(ValueError, match="reward crashed"):
        p.take(PER, 0, 0)
    p.stop()


def test_partial_loads_new_weights_between_chunks_and_pause():
    engine = Engine()
    mid, resume = threading.Event(), threading.Event()
    seen = []

    def chunked(index, version, check):  # a batch whose engine calls `check` once
        if index == 0:
            mid.set()
            assert resume.wait(10)
        seen.append((index, version, check()))
        return batch(index, version)

    p = P.Producer(engine, chunked, P.Bound(1, "wait", 0, 0, True), (0, 0), limit=3, partial=True)
    try:
        assert mid.wait(10)
        p.receive_weights(Source(1))  # arrives while batch 0 is in flight
        resume.set()
        p.take(PER, 0, 0)
        assert seen[0] == (0, 0, 1)  # started with 0, its check loaded 1
        settle(p, 2)  # batches 1 and 2 (limit 3)
        p.receive_weights(Source(2))
        with p.paused():  # evaluation: worker idle, newest weights in the engine
            assert p.loaded == 2 and p.idle
    finally:
        p.stop()


def test_a_pause_ends_a_partial_batch_and_makes_it_again_after():
    """With partial rollouts a pause (evaluation) ends the batch in flight at its next check
    (the check raises) and the worker makes that batch again, from its start, after the pause."""
    engine = Engine()
    inside, tries = threading.Event(), []

    def make(index, version, check):
        tries.append(index)
        while index == 0 and len(tries) == 1:  # the first try of batch 0 decodes until paused
            inside.set()
            check()
            time.sleep(0.01)
        check()
        return batch(index, version)

    p = P.Producer(engine, make, P.Bound(1, "wait", 0, 0, True), (0, 0), limit=1, partial=True)
    try:
        assert inside.wait(10)
        with p.paused():
            assert p.idle and p.queue == deque()
        eps, _ = p.take(PER, 0, 0)
        assert tries == [0, 0] and {e.index for e in eps} == {0}
    finally:
        p.stop()


def test_hold_for_weights_and_settle_pin_the_schedule_on_any_machine(monkeypatch):
    """The tests' schedule hooks (GRPO_FAULT): `hold_for_weights` holds the first batch made
    ahead of the trainers after its first decode step until newer weights come, so its tokens
    span two versions whichever side is faster; `settle` returns once the worker waits at the
    bound (or is held). Batch 0, which the trainers need before any sync, is never held."""
    monkeypatch.setenv("GRPO_FAULT", "hold_for_weights")
    engine = Engine()
    seen: dict[int, list[int]] = {}

    def make(index, version, check):
        v, got = check(), []
        for _ in range(4):  # four decode steps, the engine's check after each
            got.append(v)
            v = check()
        seen[index] = got
        return batch(index, min(got))
    p = P.Producer(engine, make, P.Bound(4, "wait", 0, 0, True), (0, 0), limit=8, partial=True)
    try:
        p.take(PER, -4, 0)                   # step 0 trains batch 0
        p.settle()
        assert p.holding and 1 not in seen   # batch 1 (ahead) held after one decode step
        p.receive_weights(Source(1))         # the sync after step 0
        p.take(PER, -3, 0)
        assert seen[0] == [0, 0, 0, 0] and seen[1] == [0, 1, 1, 1]
        p.settle()                           # batches 2..5 (5 needs version 1), then the bound
        assert p.idle and [q[0] for q in p.queue] == [2, 3, 4, 5]
        assert all(seen[i] == [1] * 4 for i in (2, 3, 4, 5))  # held once only
    finally:
        p.stop()


def test_batches_in_flight_overlap_and_queue_in_stream_order():
    """rollout.batches_in_flight = 3 at k = 2: three batches start at once (each in its own
    thread, the engine sharing its steps among them); a later batch that ends first waits in
    flight so the queue stays in stream order; a pause ends every batch in flight and makes each
    again from its start; the engine is idle only with no batch in flight."""
    started, release, made = [], {i: threading.Event() for i in range(8)}, []

    def make(index, version, check):
        started.append(index)
        while not release[index].wait(0.01):
            check()
        made.append(index)
        return batch(index, version)
    p = P.Producer(Engine(), make, P.Bound(2, "wait", 0, 0, True), (0, 0), limit=8, partial=True, lanes=3)
    try:
        end = time.time() + 10
        while sorted(started) != [0, 1, 2] and time.time() < end:
            time.sleep(0.01)
        assert sorted(started) == [0, 1, 2] and not p.idle   # three at once, none a fourth
        release[2].set()
        while made != [2] and time.time() < end:
            time.sleep(0.01)
        time.sleep(0.05)
        assert made == [2] and not p.queue                  # 2 waits for 0 and 1
        with p.cv:
            p.pause_asked = True                            # a pause: 0 and 1 end at their checks
            while p.flight.keys() != {2} and time.time() < end:
                p.cv.wait(0.05)
            assert sorted(p.redo) == [0, 1]
            p.pause_asked = False
            p.cv.notify_all()
        release[0].set()
        release[1].set()
        got = [p.take(PER, -2, 0) for _ in range(3)]
        assert [{e.index for e in eps} for eps, _ in got] == [{0}, {1}, {2}]
        assert got[0][1]["in_flight"] == 3                  # rollout/batches_in_flight
        assert started.count(0) == started.count(1) == 2 and started.count(2) == 1
    finally:
        for e in release.values():
            e.set()
        p.stop()


def test_hf_calls_end_at_a_new_version_and_each_token_keeps_its_own_logprob(tiny_dir):
    """Partial rollouts on the hf engine: the check handed to it returns a new version after its
    third decode step, which ends the call; multiturn.generate continues the samples under the
    new weights. Each token's version is recorded and its engine logprob equals the trainer's
    recomputation under that version's weights (fp32, 1e-4), on the tokens of each version."""
    import data
    import inputs as I
    import model as M
    import multiturn
    import synthetic
    path = tiny_dir("qwen2_5_vl")
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    engine = HF.HFEngine(path, torch.float32, procs, torch.device("cpu"))
    weights = [{n: t.detach().clone() for n, t in engine.model.named_parameters()}]
    g = torch.Generator().manual_seed(0)
    weights.append({n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in weights[0].items()})
    checks, now = [], [None]

    def check():  # version 0, then 1 from the check after the third decode step on
        checks.append(1)
        v = int(len(checks) >= 4)
        if now[0] != v:
            with torch.no_grad():
                for n, t in engine.model.named_parameters():
                    t.copy_(weights[v][n])
            now[0] = v
        return v
    problems = synthetic.make_synthetic(2, seed=3)
    prompts = [(I.prompt_ids(procs, data.user_text(p), 1), p.images) for p in problems]
    out = multiturn.generate(engine, prompts, E.Sampling(n=2, max_new_tokens=8), seed=1, check=check)
    comps = [c for cs in out for c in cs]
    assert all(len(c.versions) == len(c.ids) for c in comps)
    assert any(set(c.versions) == {0, 1} for c in comps)
    assert all(c.versions[:3] == [0] * min(3, len(c.ids)) for c in comps)
    eps = [E.Episode(p.index, i, prompts[i][0], c.ids, c.logprobs, 0.0, {}, min(c.versions),
                     c.truncated, "", c.versions) for i, (p, cs) in enumerate(zip(problems, out)) for c in cs]
    images = [problems[e.group].images for e in eps]
    batch_ = I.collate(eps, images, procs, torch.device("cpu"))
    for v in (0, 1):
        with torch.no_grad():
            for n, t in engine.model.named_parameters():
                t.copy_(weights[v][n])
            lp, _ = M.sequence_logprobs(engine.model, batch_, procs.tokens, 1.0)
        own = batch_.response_mask.bool() & (batch_.token_versions == v)
        assert own.any()
        gap = float((lp[own] - batch_.engine_logprobs[own]).abs().max())
        assert gap <= 1e-4, (v, gap)
