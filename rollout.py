"""Rollout: a step's problems generated (multiturn.generate, over an episode.Engine) and scored
into episode.Episode records (the trainer never calls a reward function); `rollout_refilled()`
adds DAPO's dynamic sampling; the rollout's metrics.
"""
from __future__ import annotations

import random
import time
from typing import Callable, NamedTuple

import torch

import data
import inputs as I
import loss as L
import multiturn
import routing as R
from episode import Check, Engine, Episode, Prompt, Sampling


def rollout(engine: Engine, problems: list, procs: I.Processors, sp: Sampling, *, template: str,
            scorer, version: int | Check, group_offset: int, seed: int,
            turns: multiturn.Turns | None = None) -> tuple[list[Episode], dict[str, float]]:
    """Generate sp.n responses for each problem (`turns`: as conversations, multiturn.py) and
    score them all at once with `scorer` (rewards.RewardRunner: the reward functions; it lives
    across steps). `version`: the engine's weight version, or the check an engine driven ahead
    is handed (episode.Check: each token then records its own). Returns (episodes, timings)."""
    tokenizer = procs.tokenizer
    # an environment's episodes start from its reset: their states, and its first user text
    firsts, states = turns.start(problems, 1 if sp.greedy else sp.n, seed) if turns else (None, None)
    prompts = engine_prompts(problems, procs, template, firsts)
    t0 = time.perf_counter()
    check = version if callable(version) else None
    completions = (multiturn.generate(engine, prompts, sp, seed, check=check, turns=turns,
                                      problems=problems, states=states) if prompts else [])
    t_gen = time.perf_counter() - t0
    rows, texts, samples = [], [], []
    for g, (p, (ids, _), comps) in enumerate(zip(problems, prompts, completions)):
        # MoE: the G samples' equal prompt routing as one tensor (pickled once in the exchange)
        for c, before in zip(comps, R.shared([c.prompt_routing for c in comps])):
            rows.append((g, p, ids, c, before))
            # multi-turn: the last reply is graded
            texts.append(c.turns[-1]["content"] if c.turns else tokenizer.decode(c.ids, skip_special_tokens=True))
            samples.append(reward_sample(p, c, sp.max_new_tokens))
    episodes = []
    for (g, p, ids, c, before), text, parts in zip(rows, texts, scorer.score(texts, samples) if rows else []):
        total, info = parts.pop("reward"), parts.pop("info", {})
        if c.env_reward is not None:  # the environment's (its turns' rewards): a part, added to the total
            parts["env"], total = c.env_reward, total + c.env_reward
        episodes.append(Episode(p.index, group_offset + g, ids, c.ids, c.logprobs, total, parts,
                                min(c.versions, default=None if check else version), c.truncated, text, c.versions, info,
                                routing=c.routing, prompt_routing=before, source=p.source,
                                loss_mask=c.loss_mask, turns=c.turns, images=c.images, kv_kept=c.kv_kept))
    return episodes, {"generate_s": t_gen, "reward_s": time.perf_counter() - t0 - t_gen,
                      "prompts": len(problems), "refill_rounds": 0,
                      "reprefill_tokens": sum(c.reprefilled for cs in completions for c in cs)}


def reward_sample(p, c, max_new_tokens: int) -> dict:
    """The `sample` a reward function gets (rewards/__init__.py) for problem `p`'s response `c` (a
    Completion or an Episode): the same on the generation side and reward_models.TrainerScorer's."""
    return {"answer": p.answer, "problem": p.problem, "index": p.index,
            "response_len": I.sampled_tokens(c), "truncated": c.truncated,
            "max_new_tokens": max_new_tokens, "columns": p.columns, "source": p.source}


def engine_prompts(problems: list, procs: I.Processors, template: str,
                   firsts: list | None = None) -> list[Prompt]:
    """Each problem as an engine's input: its chat prompt's ids (`template` filled in, or an
    environment's first user text from `firsts` where not None; ONE unexpanded placeholder per
    image) and its images."""
    firsts = firsts or [None] * len(problems)
    return [(I.prompt_ids(procs, data.user_text(p, template) if first is None else first, len(p.images)),
             p.images) for p, first in zip(problems, firsts)]


def sampling(ro) -> Sampling:
    """A training rollout's sampling from `[rollout]` (ro): rollout.group_size samples per prompt
    at its temperature, top_p, top_k, up to max_new_tokens."""
    return Sampling(n=ro.group_size, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                    max_new_tokens=ro.max_new_tokens)


def refill_problems(pool: list, n: int, seed: int, round: int) -> list:
    """The `n` distinct problems of refill `round` (>= 1) from `pool`, seeded by exactly (`seed`,
    `round`) (`seed`: the step's sampling seed), so a resumed run draws the same ones."""
    rng = random.Random(f"refill:{seed}:{round}")
    return [pool[i] for i in rng.sample(range(len(pool)), min(n, len(pool)))]


class Refill(NamedTuple):  # DAPO's refills (rollout_refilled)
    pool: list   # where they are drawn from: the whole split
    rounds: int  # at most this many extra rounds (0: none)


def rollout_refilled(roll: Callable[..., tuple[list[Episode], dict]], problems: list,
                     n: int, seed: int, refill: Refill,
                     group_offset: int) -> tuple[list[Episode], dict[str, float]]:
    """DAPO dynamic sampling: `len(problems)` groups (of `n` samples) whose rewards are not all
    equal. `roll(problems, seed=...)`: :func:`rollout` of them, groups numbered from 0.

    Round 0 rolls out `problems` with `seed` (exactly that when `rounds = 0` or every group
    varies); round r rolls out `refill_problems(pool, len(problems), seed, r)` with seed
    `seed + r * 1_000_003`. The first valid groups in round order are kept, renumbered
    `group_offset + k`, padded with zero-variance ones at the bound (docs/loss.md). Stats:
    summed timings, `prompts`, `refill_rounds`.
    """
    need = len(problems)
    valid: list[list[Episode]] = []
    zero: list[list[Episode]] = []
    stats = {"generate_s": 0.0, "reward_s": 0.0, "prompts": 0, "refill_rounds": 0, "reprefill_tokens": 0}
    batch, rnd = problems, 0
    while True:
        eps, st = roll(batch, seed=seed + rnd * 1_000_003)
        if not refill.rounds:
            for e in eps:
                e.group += group_offset
            return eps, st
        for k in ("generate_s", "reward_s", "prompts", "reprefill_tokens"):
            stats[k] += st[k]
        if eps:
            flat = torch.tensor([e.reward for e in eps], dtype=torch.float64)
            is_zero = L.zero_variance_groups(flat, n).tolist()
            for i, z in enumerate(is_zero):
                (zero if z else valid).append(eps[i * n:(i + 1) * n])
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
    (all ranks, refills included) and `rollout/reprefill_tokens` (tokens prefilled again after
    a weight arrival, multiturn.generate; all ranks) from the generation ranks' stats; with engines running ahead
    (pipeline.Producer.take) `rollout/stale_dropped` and `rollout/queue_groups` (summed over the
    ranks), `time/engine_idle_frac` (their mean) and `rollout/batches_in_flight` (their most)."""
    out = {"rollout/refill_rounds": max((s["refill_rounds"] for s in stats), default=0),
           "rollout/prompts_drawn": sum(s["prompts"] for s in stats),
           "rollout/reprefill_tokens": sum(s.get("reprefill_tokens", 0) for s in stats)}
    ahead = [s for s in stats if "dropped" in s]
    if ahead:
        out["rollout/stale_dropped"] = sum(s["dropped"] for s in ahead)
        out["rollout/queue_groups"] = sum(s["queue_groups"] for s in ahead)
        out["time/engine_idle_frac"] = sum(s["engine_idle_frac"] for s in ahead) / len(ahead)
        out["rollout/batches_in_flight"] = max(s["in_flight"] for s in ahead)
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
