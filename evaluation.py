"""Evaluation for any task (docs/evaluation.md): the engines generate, the `[eval]` reward
functions grade. Collective over the world; the generation ranks split the problems.
"""
from __future__ import annotations

import torch.distributed as dist

import inputs as I
import rollout as R
from config import Config, EvalConfig, RolloutConfig
from episode import Engine, Episode, Sampling


def evaluate(world, engine: Engine | None, scorer, problems: list, procs: I.Processors,
             cfg: Config, version: int, seed: int, skipped: int = 0,
             turns=None) -> tuple[dict[str, float], list[Episode]]:
    """The evaluation problems on the generation ranks, graded by `[eval] functions` (a
    data.sources problem: by its source's own reward_functions, where it has them): greedy
    when eval.n = 1 (Geometry3K-style), else n samples at eval.temperature. Metrics: each part's
    mean over every sample (pass@1 for a 0/1 part) as eval/<part>, and with n > 1 the mean over
    problems of the score's best sample (:func:`score_key`) as eval/<score>/pass@n; with
    data.sources the same for each source's problems alone as eval/<name>/...; `skipped`: the
    split's rows left out (prompts over data.max_prompt_len, bad rows) as eval/skipped_rows."""
    ev, ro = cfg.eval, cfg.rollout
    local: tuple[list, dict] = ([], {})
    if world.is_gen:
        local = R.rollout(engine, problems[world.gen_index::len(world.gens)], procs, sampling(ev, ro),
                          template=cfg.data.template, scorer=scorer, version=version,
                          group_offset=0, seed=seed + world.gen_index, turns=turns)
    got: list = [None] * world.size
    dist.all_gather_object(got, local, group=world.ctrl)
    eps = sorted((e for g, _ in got for e in g), key=lambda e: e.index)
    out = {**metrics(eps, ev.n, "eval/"), "eval/skipped_rows": skipped}
    for name in dict.fromkeys(e.source for e in eps if e.source):  # data.sources, in order met
        out.update(metrics([e for e in eps if e.source == name], ev.n, f"eval/{name}/"))
    return out, eps


def score_key(eps: list[Episode]) -> str:
    """The part that is the evaluation's score, the one pass@n is for: `accuracy` where the
    functions give one (the geometry verifier's 0/1 answer check: its `reward` mixes in the
    format), else the functions' total `reward`. Every other part (format, length, ...) is a
    diagnostic: its mean alone (the summary's headline is the same key: tracking.py)."""
    return "accuracy" if any("accuracy" in e.parts for e in eps) else "reward"


def metrics(eps: list[Episode], n: int, prefix: str) -> dict[str, float]:
    """`prefix` + each part's mean over `eps` (and with `n` > 1 the score's pass@n over their
    problems), the mean response length, the problems and samples counted."""
    out: dict[str, float] = {}
    by_problem: dict[int, list[Episode]] = {}
    for e in eps:
        by_problem.setdefault(e.index, []).append(e)
    score = score_key(eps)
    for part in ["reward"] + sorted({k for e in eps for k in e.parts} - {"errors"}):
        value = (lambda e: e.reward) if part == "reward" else (lambda e, k=part: e.parts.get(k, 0.0))
        out[f"{prefix}{part}"] = sum(map(value, eps)) / max(1, len(eps))
        if n > 1 and part == score:
            out[f"{prefix}{part}/pass@{n}"] = (sum(max(map(value, g)) for g in by_problem.values())
                                              / max(1, len(by_problem)))
    out.update({f"{prefix}response_len": sum(I.sampled_tokens(e) for e in eps) / max(1, len(eps)),
                f"{prefix}n": len(by_problem), f"{prefix}samples": len(eps)})
    return out


def sampling(ev: EvalConfig, ro: RolloutConfig) -> Sampling:
    """Evaluation's decoding from `[eval]` (ev) over `[rollout]` (ro): greedy when eval.n = 1,
    else eval.n samples at eval.temperature; eval.max_new_tokens / eval.top_p when set (> 0),
    else the rollout's; top_k is the rollout's."""
    limit = ev.max_new_tokens or ro.max_new_tokens
    if ev.n == 1:
        return Sampling(n=1, greedy=True, max_new_tokens=limit)
    return Sampling(n=ev.n, temperature=ev.temperature, top_p=ev.top_p or ro.top_p,
                      top_k=ro.top_k, max_new_tokens=limit)


def settings(ev: EvalConfig, ro: RolloutConfig) -> dict:
    """What an eval.jsonl row records about how it was made: the split, samples per problem and
    the decoding used (greedy is written as temperature 0.0, top_p 1.0)."""
    sp = sampling(ev, ro)
    return {"split": ev.split, "n": ev.n, "temperature": 0.0 if sp.greedy else sp.temperature,
            "top_p": 1.0 if sp.greedy else sp.top_p, "max_new_tokens": sp.max_new_tokens}


def eval_rows(eps: list[Episode], problems: list) -> list[dict]:
    """An evaluation's generations, one row per sample (eval/step_N.jsonl), each with its
    problem text and gold answer (`problems`: the evaluation set, looked up by index)."""
    by_index = {p.index: p for p in problems}
    seen: dict[int, int] = {}
    rows = []
    for e in eps:
        j = seen[e.index] = seen.get(e.index, -1) + 1
        p = by_index[e.index]
        rows.append({"index": e.index, **({"source": e.source} if e.source else {}), "sample": j,
                     "problem": p.marked, "gold": p.answer, "reward": e.reward, "parts": e.parts,
                     "info": e.info, "length": I.sampled_tokens(e), "truncated": e.truncated,
                     "version": e.version, "response": e.text, **({"turns": e.turns} if e.turns else {})})
    return rows
