"""A modelled engine for `bench/e2e.py --engine-time MODEL`: the hf engine with its compute
replaced by a wall-clock model of a real vLLM engine, so that generation does not compete with
the trainers for this machine's CPU (on real hardware it has devices of its own).

:class:`TimedEngine` is hf_engine.HFEngine (its weights are the tiny model's, loaded from every
sync as a real run loads them) whose `generate` samples no model: it sleeps what the modelled
engine would spend, and emits synthetic tokens. Everything around it is the real code:
pipeline.Producer, its queue and staleness bound, the weight versions, multiturn.generate's
partial rollouts, the trainers' real compute. It implements episode.Engine.generate's `check`
protocol as the hf engine does: `check()` before the first token and after every decode step;
without "keep" the call ends at the step where the version changed (multiturn.generate then
continues each unfinished row as prompt + tokens so far, which this engine prefills again:
"recompute"), with `rollout.partial = "keep"` the call goes on (no second prefill), each
token recording the version it was sampled with.

The time model (:class:`TimeModel`), per call: prefill of every row's tokens (a row's n samples
share its prefill, as vLLM's prefix cache makes them), `prefill_ms` a token; then one decode step
per token position, `decode_ms + decode_ms_per_seq * B` for the B samples still running
(memory-bound decode: the weights read once a step, plus each sequence's KV). Everything is
multiplied by `scale`. Weight loads are the tiny model's real copies, not modelled.

The scale: generation and training take comparable time a step, as on real hardware where each
has its own devices (an 8B engine on one H100 is faster than these 2 shared CPU cores train the
tiny model, so the scale is below 1). bench/e2e.py first measures the modelled generate seconds
a step at scale 1 (a synchronous run) and hands over `follow`, that over its `--gen-ratio` (a
synchronous step's generation time over its train time); the engine then sets
`scale = median(last 4 steps' time/train_s) / follow` at each call (step 0 left out: its
train time holds one-off costs, 10x a step's), from the run's own
metrics.jsonl (rank 0 writes it; same machine). This machine's speed drifts up to 2x within
minutes with the other jobs on it, so a scale fixed from one calibration run left the engine
twice as fast as the trainers a few runs later; following the trainers' recent train time keeps
the two sides comparable while each step's generation time still varies with its responses'
lengths (the tail). `follow` null: the scale stays fixed.

Parameters (MODELS), from published vLLM serving sweeps of an 8B model, one GPU, bf16:
- "8b-h100": Llama-3.1-8B-Instruct on one H100-80GB, vLLM 0.21.0, concurrency sweep of
  InferenceBench (yobitelcomm.github.io/bench/recipes/concurrency-sweep/): median TPOT 6.48 ms at
  concurrency 1 and 10.94 ms at 16, so decode = 6.18 ms + 0.297 ms per running sequence (the
  concurrency-64 point, 46.9 ms, is dominated by queued prefills and is not a decode figure).
  Prefill 0.032 ms a token: 2 x 8e9 FLOP a token at half of the H100's 989 bf16 TFLOP/s, which
  the same sweep's 14 ms TTFT at concurrency 1 for a short chat prompt bounds from above.
- "8b-a100": Llama-3.1-8B-Instruct on one A100-40GB, vLLM 0.23.0 (johnmusgrave.com/p/
  vllm-throughput-latency-sweep-on): 75 tokens/s at concurrency 1 (13.3 ms a step) and 6.6x that
  throughput at concurrency 8 (16.2 ms a step): decode = 12.9 ms + 0.41 ms per sequence. Prefill
  0.10 ms a token (2 x 8e9 FLOP at half of 312 TFLOP/s).

Response lengths (:func:`draw_length`): long-tailed, log-normal with median max_new_tokens / 4 and
sigma 0.8, so about 4% of samples run to max_new_tokens and about half the batches of 16 hold one
(the tail the batch waits for). Tokens: ordinary ids of the tokenizer, each sample emitting the
`<answer>` token with its own probability (so target_fraction rewards differ within a group and
the advantages are not all zero); engine logprob -log(ordinary vocabulary), what a random tiny
model's near-uniform distribution gives.

Run as a script it is train.py with this engine in place of the hf one (GRPO_ENGINE_TIME: JSON
{"model": name, "scale": float}); bench/e2e.py launches it under torchrun.
"""
from __future__ import annotations

import functools
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ENV = "GRPO_ENGINE_TIME"


@dataclass(frozen=True)
class TimeModel:
    """Seconds of a modelled engine (module docstring): prefill per token, decode per step."""
    prefill_ms: float
    decode_ms: float
    decode_ms_per_seq: float
    scale: float = 1.0

    def prefill_s(self, tokens: int) -> float:
        return self.scale * self.prefill_ms * tokens / 1000

    def decode_s(self, running: int) -> float:
        return self.scale * (self.decode_ms + self.decode_ms_per_seq * running) / 1000


MODELS = {"8b-h100": TimeModel(prefill_ms=0.032, decode_ms=6.18, decode_ms_per_seq=0.297),
          "8b-a100": TimeModel(prefill_ms=0.10, decode_ms=12.9, decode_ms_per_seq=0.41)}


def draw_length(rng: random.Random, max_new_tokens: int) -> int:
    """A response's length before max_new_tokens cuts it (module docstring); >= 1."""
    return max(1, round(math.exp(rng.gauss(math.log(max(1.0, max_new_tokens / 4)), 0.8))))


class _Batch:
    """One generate call's samples on the time model, in vllm_ahead.share_steps (its batch
    protocol): drawn from the call's own seed, so interleaving with other calls changes no token."""

    def __init__(self, eng, rows, sp, seed: int, checked: bool):
        self.rng, self.version, self.aborted = random.Random(seed), None, False
        self.room, self.per = sp.max_new_tokens, 1 if sp.greedy else sp.n
        self.tokens, self.has_images = sum(len(ids) for ids, _ in rows), any(ims for _, ims in rows)
        self.eos, self.answer, self.ordinary = eng.tokens.eos, eng.answer, eng.ordinary
        self.samples = []
        for ids, _ in rows:
            cut = eng.pending.pop(tuple(ids), None)
            for _ in range(self.per):
                left, p = cut or (draw_length(self.rng, sp.max_new_tokens), self.rng.random() * 0.5)
                self.samples.append(_Sample(list(ids), left, p))

    def running(self) -> list[_Sample]:
        return [] if self.aborted else [s for s in self.samples if not s.ended and len(s.ids) < self.room]

    @property
    def live(self) -> bool:
        return bool(self.running())

    def abort(self) -> None:
        self.aborted = True

    def start(self, eng) -> None:
        """The prefill (a row's n samples share it, as vLLM's prefix cache makes them)."""
        eng.prefilled += self.tokens
        eng._spend(eng.timing.prefill_s(self.tokens))

    @staticmethod
    def step(eng, batches: list["_Batch"]) -> None:
        """One decode step of every batch: its time that of all their running samples."""
        running = [(b, b.running()) for b in batches]
        eng._spend(eng.timing.decode_s(sum(len(r) for _, r in running)))
        eng.decode_steps += 1
        for b, samples in running:
            for s in samples:
                s.left -= 1
                s.ended = s.left == 0
                s.ids.append(b.eos if s.ended else
                             b.answer if b.rng.random() < s.answer_p else b.rng.choice(b.ordinary))
                s.versions.append(b.version)

    @staticmethod
    def load_kept(eng, batches: list["_Batch"], lockstep: bool) -> None:
        eng.owner.run_tasks()  # nothing is posted to the modelled engine: its weights load at checks


class _Sample:
    def __init__(self, row: list[int], left: int, answer_p: float):
        self.row, self.left, self.answer_p = row, left, answer_p
        self.ids: list[int] = []
        self.versions: list[int] = []
        self.ended = False  # sampled its stop token


def __getattr__(name: str):
    """`TimedEngine` on first use (hf_engine imports torch and transformers; bench/e2e.py reads
    MODELS without them)."""
    if name == "TimedEngine":
        return _engine_class()
    raise AttributeError(name)


@functools.cache
def _engine_class() -> type:
    from hf_engine import HFEngine
    return type("TimedEngine", (_Timed, HFEngine), {"__module__": __name__, "__doc__": _Timed.__doc__,
                                                    "STEPS_SHARED": True})


class _Timed:
    """hf_engine.HFEngine whose `generate` is the time model (module docstring): the class
    `TimedEngine` of this module is it over HFEngine, sharing its decode steps among concurrent
    calls as vLLM does (STEPS_SHARED; `rollout.batches_in_flight`). `sleep`: how modelled time passes (tests
    pass a recorder). Counters: `prefilled` (tokens), `decode_steps`, `modelled_s`."""

    def __init__(self, *args, timing: TimeModel, keep: bool = False, sleep=time.sleep,
                 follow: tuple[float, Path] | None = None, **kw):
        super().__init__(*args, keep=keep, **kw)
        self.timing, self.sleep = timing, sleep
        self.follow = follow  # (modelled generate s a step at scale 1, the run's metrics.jsonl)
        self.pending: dict[tuple, tuple[int, float]] = {}  # row cut by a check -> (tokens left, answer_p)
        self.prefilled = self.decode_steps = 0
        self.modelled_s = 0.0
        tk, tok = self.tokens, self.procs.tokenizer
        skip = set(tk.suppressed) | set(tk.stops)
        self.ordinary = [i for i in range(min(len(tok), tk.vocab_size)) if i not in skip]
        self.answer = tok.convert_tokens_to_ids("<answer>")
        if self.answer not in set(self.ordinary):
            raise ValueError("the modelled engine emits the tokenizer's `<answer>` token (the tiny "
                             f"model's); this tokenizer has none it may sample ({self.answer})")
        self.logprob = -math.log(len(self.ordinary))
        from vllm_ahead import Owner
        self.owner, self.stale_caches = Owner("the modelled engine", None), False  # share_steps's

    def fresh_caches(self) -> None:
        """share_steps's: the modelled engine has no caches to reset."""

    @classmethod
    def from_config(cls, cfg, path: str, procs, *, dev, device, seed: int, max_images: int = 1):
        import model as M
        spec = json.loads(os.environ[ENV])
        timing = MODELS[spec["model"]]
        timing = TimeModel(timing.prefill_ms, timing.decode_ms, timing.decode_ms_per_seq, float(spec["scale"]))
        follow = spec.get("follow") and (float(spec["follow"]), Path(cfg.run.out_dir) / "metrics.jsonl")
        return cls(path, M.DTYPES[cfg.model.dtype], procs, device, timing=timing,
                   keep=cfg.rollout.partial == "keep", follow=follow)

    def _follow_trainers(self) -> None:
        """With `follow`: the scale that makes a step's modelled generation take the trainers'
        recent train time (module docstring); the written lines of metrics.jsonl only."""
        if self.follow is None or not self.follow[1].exists():
            return
        rows = [json.loads(x) for x in self.follow[1].read_text().split("\n")[:-1]]  # a line being written has no newline yet
        train = [r["time/train_s"] for r in rows if r["step"] >= 1][-4:]  # step 0's holds one-off costs
        if train:
            self.timing = replace(self.timing, scale=statistics.median(train) / self.follow[0])

    def _spend(self, seconds: float) -> None:
        self.modelled_s += seconds
        self.sleep(seconds)

    def generate(self, rows, sp, seed: int, check=None) -> list[list]:
        """episode.Engine.generate on the time model: one prefill of the rows, then decode steps
        until every sample ended or ran out of sp.max_new_tokens, or (without keep) until
        `check` returns another version than the call's first. Calls from several threads at
        once share the decode steps as vLLM's do (STEPS_SHARED: the project's own
        vllm_ahead.share_steps drives them), a step's time that of all their running samples."""
        from vllm_ahead import share_steps
        self._follow_trainers()
        batch = _Batch(self, rows, sp, seed, checked=check is not None)
        share_steps(self, batch, check or (lambda: None))
        return self._completions(batch.samples, batch.per, len(rows), check is not None, sp.max_new_tokens)

    def _completions(self, samples: list[_Sample], per: int, n_rows: int, checked: bool, room: int):
        from episode import Completion
        out: list[list[Completion]] = [[] for _ in range(n_rows)]
        for i, s in enumerate(samples):
            if not s.ended and len(s.ids) < room:  # cut by the check: continued as row + tokens so far
                self.pending[tuple(s.row + s.ids)] = (s.left, s.answer_p)
            out[i // per].append(Completion(s.ids, [self.logprob] * len(s.ids), truncated=not s.ended,
                                            versions=s.versions if checked else [],
                                            kv_kept=self.keep and checked))
        return out


def main() -> int:
    """train.py with TimedEngine as the hf engine (GRPO_ENGINE_TIME says the model and scale)."""
    spec = json.loads(os.environ.get(ENV) or "null")
    if not spec or spec.get("model") not in MODELS:
        raise SystemExit(f"{ENV} must be JSON {{\"model\": one of {sorted(MODELS)}, \"scale\": s}}")
    import engines
    import train
    engines.ENGINES["hf"] = "bench.engine_time.TimedEngine"
    return train.main()


if __name__ == "__main__":
    sys.exit(main())
