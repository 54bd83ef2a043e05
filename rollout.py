"""Rollout: the `Episode` record (the only thing that crosses from generation to training) and
the engines (:class:`Engine`: :class:`HFEngine`, `vllm_engine.VLLMEngine`) that produce it.
`rollout()` generates and scores a step's problems (the trainer never calls a reward function);
`rollout_refilled()` adds DAPO's dynamic sampling.
"""
from __future__ import annotations

import importlib
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, NamedTuple, Protocol

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import data
import device as D
import envs
import families
import inputs as I
import loss as L
import model as M
import multiturn
import rewards
import routing as R
import sync as S
from errors import ConfigError


@dataclass
class Episode:
    index: int                  # dataset index of the problem; its images are looked up by it
    group: int                  # prompt number within the step; the G samples of a prompt share it
    prompt_ids: list[int]       # chat prompt, ONE unexpanded placeholder per image (maybe none)
    response_ids: list[int]     # sampled tokens, eos included when sampled
    logprobs: list[float]       # engine's logprob of each response token
    reward: float               # weighted total of the reward functions
    parts: dict[str, float]     # each reward part (accuracy, format, errors, ...)
    version: int                # weight version the engine generated with (partial: its oldest token's)
    truncated: bool             # stopped by max_new_tokens, not by eos
    text: str = ""              # decoded response, for samples.jsonl and debugging
    versions: list[int] = field(default_factory=list)  # partial rollouts: each token's; [] = all `version`
    info: dict = field(default_factory=dict)  # what reward functions returned beside the score (samples only)
    source: str = ""            # its problem's data.sources name ("" for the one data.source)
    routing: torch.Tensor | None = None  # MoE: [R, L, k] experts of the input predicting each token (routing.py)
    prompt_routing: torch.Tensor | None = None  # MoE: [P - 1, L, k] the other prompt tokens' (expanded prompt)
    # multi-turn (multiturn.py): response_ids are every token after the prompt; 1 on the sampled
    # ones, 0 on inserted user / tool turns ([] = all sampled); the turns with their roles
    loss_mask: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    images: list = field(default_factory=list)  # pictures inserted turns showed (after the problem's)


@dataclass(frozen=True)
class Sampling:
    """Sampling knobs, always passed explicitly (transformers otherwise defaults top_k to 50)."""
    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    greedy: bool = False


@dataclass
class Completion:
    ids: list[int]
    logprobs: list[float]
    truncated: bool
    versions: list[int] = field(default_factory=list)  # chunked generation: each token's weight version
    routing: torch.Tensor | None = None  # MoE: [len(ids), L, k] (routing.py)
    prompt_routing: torch.Tensor | None = None  # MoE: the prompt's tokens but the last (routing.py)
    loss_mask: list[int] = field(default_factory=list)  # multi-turn (multiturn.py); [] = all sampled
    turns: list[dict] = field(default_factory=list)
    images: list = field(default_factory=list)  # multi-turn: pictures the inserted turns showed
    env_reward: float | None = None  # multi-turn: the environment's final reward (envs/), if it gives one


Prompt = tuple[list[int], list]  # (unexpanded token ids, PIL images)
Named = list[tuple[str, torch.Tensor]]  # (HF parameter name, tensor) pairs of one bucket


class WeightSource(Protocol):
    """Where one weight sync comes from (sync.Receiver on a generation rank; in a world of one,
    sync.LocalControl): the version and bucket plan, then the buckets in plan order. `partial`
    (set by `control()`): the plan holds only the tensors that change (LoRA), the engine keeps
    the others."""
    partial: bool

    def control(self) -> tuple[int, list]: ...
    def buckets(self) -> Iterable[Named]: ...


class Engine(Protocol):
    """What the loop and the sync code need from an inference engine; nothing else is called."""
    OWN_CHANNEL: bool  # True: buckets go over channel.open_channel (`join_weight_channel`);
    #                    False: over the torch sync group, plus `load_weights` for a world of one

    def generate(self, prompts: list[Prompt], sp: "Sampling", seed: int) -> list[list["Completion"]]:
        """sp.n sampled responses per prompt (1 when greedy), with per-token logprobs."""

    def receive_weights(self, source: WeightSource) -> int:
        """Load one sync's weights from `source`; returns the version received."""

    def shutdown(self) -> None:
        """Release the engine's processes and memory."""

    @classmethod
    def start_note(cls, rc, config) -> str:
        """What the engine decided from `[rollout]` (rc) and the model's config (None: not known
        yet, a dry run), said once at start and in the dry run; "" for nothing."""


ENGINES = {"hf": "rollout.HFEngine", "vllm": "vllm_engine.VLLMEngine"}


def engine_class(name: str) -> type:
    """The engine class for `[rollout] engine` (imported on demand: vLLM only where used); a
    ConfigError for a name that is none of ENGINES."""
    if name not in ENGINES:
        raise ConfigError(f"rollout.engine must be {' or '.join(map(repr, ENGINES))}, got {name!r}")
    module, _, cls = ENGINES[name].rpartition(".")
    return getattr(importlib.import_module(module), cls)


def check(rc, tc) -> None:
    """`[rollout]`'s names: a known engine, environment and tools; an environment that shows
    images needs one row per episode (`[train]` tc); ConfigError naming the key."""
    engine_class(rc.engine)
    envs.check(rc.env, rc.tools)
    if envs.extra_images(rc.env) and (tc.share_prompt or tc.packing not in (False, "auto")):
        raise ConfigError(f"rollout.env={rc.env} shows images in its turns: they need one row per "
                          "episode (train.share_prompt = false, train.packing = false)")


def build_engine(cfg, path: str, procs: I.Processors, *, dev: D.Device, device: torch.device,
                 seed: int, max_images: int = 1) -> Engine:
    """This generation rank's engine, from the run's config (`[rollout]`, `[model]`,
    cluster.timeout_s, run.verbose); `max_images`: the most images one prompt holds."""
    max_images += envs.extra_images(cfg.rollout.env)  # pictures an environment shows in its turns
    engine = engine_class(cfg.rollout.engine).from_config(cfg, path, procs, dev=dev, device=device,
                                                          seed=seed, max_images=max_images)
    return multiturn.wrap(engine, cfg.rollout, procs)  # rollout.env / rollout.tools: conversations


class _Interrupt(StoppingCriteria):
    """Ends a generate call at the next decode step once `pending()` (newer weights wait)."""

    def __init__(self, pending: Callable[[], bool]):
        self.pending = pending

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), bool(self.pending()), dtype=torch.bool,
                          device=input_ids.device)


class HFEngine:
    """transformers generation on this rank's device, with its own copy of the weights."""
    OWN_CHANNEL = False

    def __init__(self, path: str, dtype: torch.dtype, procs: I.Processors, device: torch.device):
        self.model = M.load_model(path, dtype=dtype, device=device).eval()
        self.procs, self.tokens, self.device = procs, procs.tokens, device
        # MoE: what each generate call routed is recorded (routing.capture) and kept per token
        self.experts = (getattr(M.text_config(self.model.config), "num_experts", 0)
                        if families.moe_routers(self.model) else 0)

    @classmethod
    def start_note(cls, rc, config) -> str:
        return ""  # no prefix cache, nothing decided

    @classmethod
    def from_config(cls, cfg, path: str, procs: I.Processors, *, dev: D.Device,
                    device: torch.device, seed: int, max_images: int = 1) -> "HFEngine":
        return cls(path, M.DTYPES[cfg.model.dtype], procs, device)

    # Partial rollouts (pipeline.Producer sets these): `between()` loads the newest weights and
    # returns their version, before each generate call of a batch; `interrupt()` is True when
    # newer weights wait, which ends the call at its next decode step (the batch then goes on
    # under them); `chunk` > 0 caps the tokens of one call (tests)
    between: Callable[[], int] | None = None
    interrupt: Callable[[], bool] | None = None
    chunk: int = 0

    def generate(self, prompts: list[Prompt], sp: Sampling, seed: int) -> list[list[Completion]]:
        if self.between is not None and not sp.greedy:
            return self._chunked(prompts, sp, seed)
        resp, lp, routes, before = self._sample(prompts, sp, seed)
        per_prompt = 1 if sp.greedy else sp.n
        result: list[list[Completion]] = [[] for _ in prompts]
        for row, (r, l, x, b) in enumerate(zip(resp, lp, routes, before)):
            n, stopped = self._cut(r)
            result[row // per_prompt].append(Completion(r[:n], l[:n], truncated=not stopped,
                                                        routing=None if x is None else x[:n],
                                                        prompt_routing=b))
        return result

    def _cut(self, r: list[int]) -> tuple[int, bool]:
        """Tokens up to the first stop (included), and whether there is one."""
        stops = self.tokens.stops
        n = next((j + 1 for j, t in enumerate(r) if t in stops), None)
        return (len(r), False) if n is None else (n, True)

    def _chunked(self, prompts: list[Prompt], sp: Sampling, seed: int) -> list[list[Completion]]:
        """sp.n responses per prompt in chunks, each ended by `interrupt()` (or `chunk`): each
        chunk continues the unfinished ones (prompt + their tokens so far, prefilled again) with
        the weights `between()` loaded; every token records the version it was sampled with.
        Chunk c's sampling seed is `seed + c * 7919` (reproducible for a given schedule)."""
        seqs = [Completion([], [], True) for _ in prompts for _ in range(sp.n)]
        owner = [p for p in range(len(prompts)) for _ in range(sp.n)]
        live, c = list(range(len(seqs))), 0
        while live:
            version = self.between()
            n_new = min(self.chunk or sp.max_new_tokens, sp.max_new_tokens - len(seqs[live[0]].ids))
            rows = prompts if c == 0 else [(prompts[owner[i]][0] + seqs[i].ids, prompts[owner[i]][1])
                                           for i in live]
            resp, lp, routes, before = self._sample(rows, replace(sp, n=sp.n if c == 0 else 1,
                                                                  max_new_tokens=n_new), seed + c * 7919)
            for i, r, l, x, b in zip(live, resp, lp, routes, before):
                n, stopped = self._cut(r[:n_new])
                seqs[i].ids += r[:n]
                seqs[i].logprobs += l[:n]
                seqs[i].versions += [version] * n
                seqs[i].truncated = not stopped
                if x is not None:  # each chunk's tokens as that chunk routed their predictors
                    seqs[i].routing = x[:n] if c == 0 else torch.cat([seqs[i].routing, x[:n]])
                    seqs[i].prompt_routing = b if c == 0 else seqs[i].prompt_routing  # chunk 0's prefill
            live = [i for i in live if seqs[i].truncated and len(seqs[i].ids) < sp.max_new_tokens]
            c += 1
        return [seqs[p * sp.n:(p + 1) * sp.n] for p in range(len(prompts))]

    @torch.no_grad()
    def _sample(self, prompts: list[Prompt], sp: Sampling, seed: int) -> tuple[list, list, list, list]:
        """One transformers generate call: every row's sampled tokens and their logprobs
        (lists; rows prompt-major, sp.n per prompt, 1 when greedy), up to max_new_tokens, and
        for a MoE model each row's routing [T, L, k] and its prompt's but the last token's
        [P - 1, L, k] (routing.generated_routing, routing.prompt_routing; else None)."""
        tk = self.tokens
        images = [im for _, ims in prompts for im in ims]
        mm, mm_kw = {}, {}
        counts = iter(())
        if images:
            ip = self.procs.image_processor
            mm = I.image_inputs(ip, images)
            counts = iter(I.n_image_tokens(mm["image_grid_thw"], ip.merge_size))
        rows = [I.expand_images(ids, [next(counts) for _ in ims], tk.image_pad) for ids, ims in prompts]
        width = max(map(len, rows))
        # left padding: generated tokens line up; positions (mRoPE) come from the mask
        ids = torch.tensor([[tk.pad] * (width - len(r)) + r for r in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        knobs = (dict(do_sample=False) if sp.greedy else
                 dict(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k))
        if mm:  # images: their pixels, grids and where their tokens sit (mRoPE)
            mm_kw = dict(pixel_values=mm["pixel_values"].to(self.device, self.model.dtype),
                         image_grid_thw=mm["image_grid_thw"].to(self.device),
                         mm_token_type_ids=(ids == tk.image_pad).int())
        if self.interrupt is not None:
            knobs["stopping_criteria"] = StoppingCriteriaList([_Interrupt(self.interrupt)])
        with D.fork_rng(self.device), (R.capture(self.model) if self.experts else nullcontext()) as calls:
            torch.manual_seed(seed)  # fork_rng: the device type explicitly (NPU: not "cuda")
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, **mm_kw,
                num_return_sequences=1 if sp.greedy else sp.n, max_new_tokens=sp.max_new_tokens,
                suppress_tokens=list(tk.suppressed), eos_token_id=list(tk.stops), pad_token_id=tk.pad,
                output_logits=True, return_dict_in_generate=True, **knobs)
        resp = out.sequences[:, width:]                                   # [P*n, T]
        logits = torch.stack(out.logits, 1)                               # [P*n, T, V] raw
        temp = 1.0 if sp.greedy else sp.temperature
        lp, _ = M.token_logprobs(logits, resp, tk, temp)
        if not self.experts:
            return resp.tolist(), lp.tolist(), [None] * resp.shape[0], [None] * resp.shape[0]
        routes = list(R.generated_routing(calls, *resp.shape, self.experts).cpu())
        per = resp.shape[0] // len(rows)                                  # rows prompt-major
        before = R.prompt_routing(calls, [len(rows[i // per]) for i in range(resp.shape[0])], self.experts)
        return resp.tolist(), lp.tolist(), routes, before

    @torch.no_grad()
    def load_weights(self, named: list[tuple[str, torch.Tensor]], adopt: bool = False) -> None:
        """Copy `named` (sync.wire_pieces' names) into the model, or with `adopt` make a whole
        tensor the model's storage (it must outlive the model: sync.Receiver's buffers do)."""
        if not hasattr(self, "_targets"):
            params = list(self.model.named_parameters())
            self._targets = {name: (params[pos][1], index)
                             for name, _, pos, index in S.wire_pieces(self.model)}
        for name, t in named:
            p, index = self._targets[name]
            if (not index and adopt and t.dtype == p.dtype and t.device == p.device
                    and t.shape == p.shape):
                if p.data_ptr() != t.data_ptr():
                    p.data = t
            else:
                (p[index] if index else p).copy_(t)

    def receive_weights(self, source: WeightSource) -> int:
        """Every bucket of a sync, in order, adopted as this engine's weights (the receiver's
        buffers live across syncs, so later syncs land in place with no copy)."""
        version, _ = source.control()
        for named in source.buckets():
            self.load_weights(named, adopt=True)
        return version

    def named_parameters(self):
        return self.model.named_parameters()

    def shutdown(self) -> None:
        self.model = None


def rollout(engine: Engine, problems: list, procs: I.Processors, sp: Sampling, *, template: str,
            scorer: rewards.RewardRunner, version: int, group_offset: int,
            seed: int) -> tuple[list[Episode], dict[str, float]]:
    """Generate sp.n responses for each problem and score them all at once with `scorer` (the
    reward functions; it lives across steps). Returns (episodes, timings)."""
    tokenizer = procs.tokenizer
    prompts = [(I.prompt_ids(procs, data.user_text(p, template), len(p.images)), p.images)
               for p in problems]
    t0 = time.perf_counter()
    kw = {"problems": problems} if getattr(engine, "takes_problems", False) else {}  # multi-turn
    completions = engine.generate(prompts, sp, seed, **kw) if prompts else []
    t_gen = time.perf_counter() - t0
    rows, texts, samples = [], [], []
    for g, (p, (ids, _), comps) in enumerate(zip(problems, prompts, completions)):
        # MoE: the G samples' equal prompt routing as one tensor (pickled once in the exchange)
        for c, before in zip(comps, R.shared([getattr(c, "prompt_routing", None) for c in comps])):
            rows.append((g, p, ids, c, before))
            # multi-turn: the last reply is graded
            texts.append(c.turns[-1]["content"] if c.turns else tokenizer.decode(c.ids, skip_special_tokens=True))
            samples.append({"answer": p.answer, "problem": p.problem, "index": p.index,
                            "response_len": I.sampled_tokens(c),
                            "truncated": c.truncated,
                            "max_new_tokens": sp.max_new_tokens, "columns": p.columns,
                            "source": p.source})
    episodes = []
    for (g, p, ids, c, before), text, parts in zip(rows, texts, scorer.score(texts, samples) if rows else []):
        total, info = parts.pop("reward"), parts.pop("info", {})
        if c.env_reward is not None:  # the environment's own grade: a part, added to the total
            parts["env"], total = c.env_reward, total + c.env_reward
        episodes.append(Episode(p.index, group_offset + g, ids, c.ids, c.logprobs, total, parts,
                                min(c.versions, default=version), c.truncated, text, c.versions, info,
                                routing=c.routing, prompt_routing=before, source=p.source,
                                loss_mask=c.loss_mask, turns=c.turns, images=c.images))
    return episodes, {"generate_s": t_gen, "reward_s": time.perf_counter() - t0 - t_gen,
                      "prompts": len(problems), "refill_rounds": 0}


def refill_problems(pool: list, n: int, seed: int, round: int) -> list:
    """The `n` distinct problems of refill `round` (>= 1) from `pool`, seeded by exactly (`seed`,
    `round`) (`seed`: the step's sampling seed), so a resumed run draws the same ones."""
    rng = random.Random(f"refill:{seed}:{round}")
    return [pool[i] for i in rng.sample(range(len(pool)), min(n, len(pool)))]


class Refill(NamedTuple):  # DAPO's refills (rollout_refilled)
    pool: list   # where they are drawn from: the whole split
    rounds: int  # at most this many extra rounds (0: none)


def rollout_refilled(engine: Engine, problems: list, procs: I.Processors, sp: Sampling,
                     template: str, scorer: rewards.RewardRunner, version: int, group_offset: int,
                     seed: int, refill: Refill) -> tuple[list[Episode], dict[str, float]]:
    """DAPO dynamic sampling: `len(problems)` groups whose rewards are not all equal.

    Round 0 is :func:`rollout` (exactly it when `rounds = 0` or every group varies); round r
    rolls out `refill_problems(pool, len(problems), seed, r)` with seed `seed + r * 1_000_003`.
    The first valid groups in round order are kept, renumbered `group_offset + k`, padded with
    zero-variance ones at the bound (docs/loss.md). Stats: summed timings, `prompts`,
    `refill_rounds`.
    """
    if not refill.rounds:
        return rollout(engine, problems, procs, sp, template=template, scorer=scorer,
                       version=version, group_offset=group_offset, seed=seed)
    need = len(problems)
    valid: list[list[Episode]] = []
    zero: list[list[Episode]] = []
    stats = {"generate_s": 0.0, "reward_s": 0.0, "prompts": 0, "refill_rounds": 0}
    batch, rnd = problems, 0
    while True:
        eps, st = rollout(engine, batch, procs, sp, template=template, scorer=scorer,
                          version=version, group_offset=0, seed=seed + rnd * 1_000_003)
        for k in ("generate_s", "reward_s", "prompts"):
            stats[k] += st[k]
        if eps:
            flat = torch.tensor([e.reward for e in eps], dtype=torch.float64)
            is_zero = L.zero_variance_groups(flat, sp.n).tolist()
            for i, z in enumerate(is_zero):
                (zero if z else valid).append(eps[i * sp.n:(i + 1) * sp.n])
        if len(valid) >= need or rnd >= refill.rounds:
            break
        rnd += 1
        batch = refill_problems(refill.pool, need, seed, rnd)
    stats["refill_rounds"] = rnd
    kept = (valid + zero)[:need]
    for k, group in enumerate(kept):
        for e in group:
            e.group = group_offset + k
    return [e for group in kept for e in group], stats


def refill_metrics(stats: list[dict]) -> dict[str, float]:
    """`rollout/refill_rounds` (the most any generation rank ran) and `rollout/prompts_drawn`
    (all ranks, refills included) from the generation ranks' stats; with engines running ahead
    (pipeline.Producer.take) `rollout/stale_dropped` and `rollout/queue_groups` (summed over the
    ranks) and `time/engine_idle_frac` (their mean)."""
    out = {"rollout/refill_rounds": max((s["refill_rounds"] for s in stats), default=0),
           "rollout/prompts_drawn": sum(s["prompts"] for s in stats)}
    ahead = [s for s in stats if "dropped" in s]
    if ahead:
        out["rollout/stale_dropped"] = sum(s["dropped"] for s in ahead)
        out["rollout/queue_groups"] = sum(s["queue_groups"] for s in ahead)
        out["time/engine_idle_frac"] = sum(s["engine_idle_frac"] for s in ahead) / len(ahead)
    return out


def staleness_metrics(episodes: list[Episode], version: int) -> dict[str, float]:
    """Over the step's response tokens: how many versions each is behind the trainers'
    `version` (mean, max); `rollout/partial_frac`: the share of episodes whose tokens span
    versions (partial rollouts). `rollout/staleness`: the oldest episode's (its oldest token)."""
    ages = [version - v for e in episodes for v in I.token_versions(e)]
    return {"rollout/staleness": max((version - e.version for e in episodes), default=0),
            "rollout/staleness_mean": sum(ages) / max(1, len(ages)),
            "rollout/staleness_max": max(ages, default=0),
            "rollout/partial_frac": sum(len(set(e.versions)) > 1 for e in episodes) / max(1, len(episodes))}


def episode_metrics(episodes: list[Episode], stats: list[dict], version: int,
                    sources: list[str] = ()) -> dict[str, float]:
    """A step's rollout metrics (reward parts, lengths, staleness, generation time and rate);
    `stats` holds each generation rank's timings, `version` the trainers' weight version;
    `sources` (data.sources' names): each one's share of the episodes (`data/<name>/frac`) and,
    where it has any this step, their mean reward (`reward/<name>/mean`)."""
    n = max(1, len(episodes))
    out = {"reward/mean": sum(e.reward for e in episodes) / n,
           "response_len/mean": sum(I.sampled_tokens(e) for e in episodes) / n,
           "response/truncated_frac": sum(e.truncated for e in episodes) / n,
           **staleness_metrics(episodes, version),
           # generation ranks run in parallel: the step waits for the slowest
           "time/generate_s": max((s["generate_s"] + s["reward_s"] for s in stats), default=0.0),
           **refill_metrics(stats)}
    for k in sorted({k for e in episodes for k in e.parts}):
        out[f"reward/{k}"] = sum(e.parts.get(k, 0.0) for e in episodes) / n
    out["reward/errors"] = sum(e.parts.get("errors", 0.0) for e in episodes)
    for name in sources:
        mine = [e.reward for e in episodes if e.source == name]
        out[f"data/{name}/frac"] = len(mine) / n
        if mine:
            out[f"reward/{name}/mean"] = sum(mine) / len(mine)
    out |= multiturn.turn_metrics(episodes)
    out["rollout/response_tokens"] = sum(I.sampled_tokens(e) for e in episodes)
    if out["time/generate_s"] > 0:
        out["time/gen_tokens_per_s"] = out["rollout/response_tokens"] / out["time/generate_s"]
    return out
