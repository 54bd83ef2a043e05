"""bench/engine_time.py's modelled engine (bench/e2e.py --engine-time): its time model and the
check protocol, driven through multiturn.generate as pipeline.Producer drives an engine. A stand-in
base class replaces hf_engine.HFEngine (no model loads): only `generate` is the modelled engine's."""
from __future__ import annotations

import random
import statistics
import sys
from types import SimpleNamespace

import multiturn
from episode import Sampling
from tests.util import ROOT

sys.path.append(str(ROOT / "bench"))  # after the core: bench/sync.py must not shadow sync.py (a spawned vLLM process inherits sys.path)
import engine_time as ET  # noqa: E402

ANSWER = 7


class _Base:
    """What _Timed reads of hf_engine.HFEngine: keep, tokens, procs."""

    def __init__(self, keep: bool = False):
        tok = type("Tok", (), {"__len__": lambda self: 50, "convert_tokens_to_ids": lambda self, t: ANSWER})()
        self.keep = keep
        self.tokens = SimpleNamespace(suppressed=(1, 2), stops=(0,), eos=0, vocab_size=64)
        self.procs = SimpleNamespace(tokenizer=tok)


Engine = type("Engine", (ET._Timed, _Base), {})
MODEL = ET.TimeModel(prefill_ms=0.5, decode_ms=10.0, decode_ms_per_seq=1.0, scale=2.0)
PROMPTS = [([100 + i] * (20 + i), []) for i in range(4)]


def engine(keep: bool) -> Engine:
    return Engine(timing=MODEL, keep=keep, sleep=lambda s: None)


def run(keep: bool, new_version_after: int | None = 5):
    """4 prompts x 4 samples; with `new_version_after`, the check returns version 1 from its
    that-many-th call on (a weight arrival mid-batch), else always 0."""
    e, calls = engine(keep), [0]

    def check() -> int:
        calls[0] += 1
        return 1 if new_version_after is not None and calls[0] > new_version_after else 0
    sp = Sampling(n=4, max_new_tokens=48)
    out = multiturn.generate(e, PROMPTS, sp, seed=3, check=check)
    return e, [c for cs in out for c in cs]


def test_time_model_prefill_and_batch_dependent_decode():
    assert MODEL.prefill_s(100) == 2.0 * 0.5 * 100 / 1000
    assert MODEL.decode_s(16) == 2.0 * (10.0 + 16) / 1000 > MODEL.decode_s(1)
    e, comps = run(keep=True, new_version_after=None)
    # no arrival: one prefill of each prompt (its 4 samples share it), one step per position
    assert e.prefilled == sum(len(ids) for ids, _ in PROMPTS)
    assert e.decode_steps == max(len(c.ids) for c in comps)
    running = [sum(len(c.ids) > t for c in comps) for t in range(e.decode_steps)]
    want = MODEL.prefill_s(e.prefilled) + sum(MODEL.decode_s(b) for b in running)
    assert abs(e.modelled_s - want) < 1e-9


def test_keep_never_prefills_again_recompute_does():
    keep, kc = run(keep=True)
    rec, rc = run(keep=False)
    prompt_tokens = sum(len(ids) for ids, _ in PROMPTS)
    # keep: one call, the prompts' prefill only; tokens after the arrival carry version 1
    assert keep.prefilled == prompt_tokens and all(c.reprefilled == 0 and c.kv_kept for c in kc)
    assert any(set(c.versions) == {0, 1} for c in kc)
    # recompute: the call ends at the arrival, each unfinished row prefilled again (prompt + tokens)
    again = sum(c.reprefilled for c in rc)
    assert again > 0 and rec.prefilled == prompt_tokens + again
    assert not any(c.kv_kept for c in rc) and any(set(c.versions) == {0, 1} for c in rc)
    # the same responses' lengths either way (a cut row resumes its drawn length), so recompute
    # costs exactly the second prefill more
    assert [len(c.ids) for c in kc] == [len(c.ids) for c in rc]
    assert [c.truncated for c in kc] == [c.truncated for c in rc]
    assert abs(rec.modelled_s - keep.modelled_s - MODEL.prefill_s(again)) < 1e-9


def test_tokens_and_long_tailed_lengths():
    _, comps = run(keep=True, new_version_after=None)
    for c in comps:
        assert c.ids and all(t not in (1, 2) for t in c.ids)  # never a suppressed id
        assert (c.ids[-1] == 0) == (not c.truncated) and 0 not in c.ids[:-1]
        assert len(c.logprobs) == len(c.ids)
    rng = random.Random(0)
    lengths = [ET.draw_length(rng, 48) for _ in range(4000)]
    assert 10 <= statistics.median(lengths) <= 14           # median max_new_tokens / 4
    assert 0.02 <= sum(n >= 48 for n in lengths) / 4000 <= 0.07  # the tail max_new_tokens cuts


def test_follows_the_trainers_recent_train_time(tmp_path):
    """`follow`: the scale makes a step's modelled generation (follow s at scale 1) take the
    median of the last 4 written steps' time/train_s (step 0's not: one-off costs); a line still
    being written is not read."""
    metrics = tmp_path / "metrics.jsonl"
    e = Engine(timing=MODEL, sleep=lambda s: None, follow=(0.5, metrics))
    sp = Sampling(n=1, max_new_tokens=4)
    e.generate(PROMPTS[:1], sp, seed=0)
    assert e.timing.scale == MODEL.scale  # nothing written yet: the starting scale
    metrics.write_text('{"step": 0, "time/train_s": 7.0}\n')  # step 0: one-off costs, not followed
    e.generate(PROMPTS[:1], sp, seed=0)
    assert e.timing.scale == MODEL.scale
    metrics.write_text("".join(f'{{"step": {i}, "time/train_s": {t}}}\n' for i, t in enumerate((7.0, 9.0, 0.1, 0.2, 0.3, 0.4)))
                       + '{"step": 6, "time/train_s": 5')
    e.generate(PROMPTS[:1], sp, seed=0)
    assert abs(e.timing.scale - 0.25 / 0.5) < 1e-12


def test_concurrent_calls_share_the_decode_steps_and_keep_their_tokens():
    """rollout.batches_in_flight: two generate calls from two threads at once decode together
    (vllm_ahead.share_steps, the vLLM path's own loop): fewer decode steps than the two one after
    the other, each step's time that of both calls' running samples, and every call's tokens
    those it makes alone (each call draws from its own seed). The second call starts while the
    first decodes, and the stepping is handed over when the first ends first."""
    import threading
    import time
    sp = Sampling(n=4, max_new_tokens=48)
    alone = [engine(True) for _ in range(2)]
    solo = [[c.ids for cs in e.generate(PROMPTS[2 * i:2 * i + 2], sp, 10 + i, check=lambda: 0) for c in cs]
            for i, e in enumerate(alone)]
    spent: list[float] = []
    e = Engine(timing=MODEL, keep=True, sleep=spent.append)
    gate, out = threading.Event(), [None, None]

    def call(i: int) -> None:
        def check() -> int:
            if i == 0 and e.decode_steps == 3 and not gate.is_set():  # the second call starts
                gate.set()                                             # while this one decodes
                while len(e.owner.calls) < 2:
                    time.sleep(0.001)
            return 0
        out[i] = [c.ids for cs in e.generate(PROMPTS[2 * i:2 * i + 2], sp, 10 + i, check=check) for c in cs]
    first = threading.Thread(target=call, args=(0,))
    first.start()
    gate.wait(10)
    call(1)
    first.join(10)
    assert out == solo
    assert e.decode_steps < sum(a.decode_steps for a in alone)
    assert e.decode_steps >= max(a.decode_steps for a in alone)
    assert sum(spent) < sum(a.modelled_s for a in alone)  # a shared step costs less than two
    assert e.owner.holder is None and e.owner.calls == []
