"""Evaluation for any task: the engines generate, the `[eval]` reward functions grade.

Greedy decoding when `eval.n = 1` (Geometry3K-style), else n samples per problem at
`eval.temperature`: every reward part's mean over all samples (pass@1 for a 0/1 part such as the
verifier's `accuracy`) and, with n > 1, the mean over problems of the best of its n samples
(pass@n). Collective over the world; the generation ranks split the problems.
"""
from __future__ import annotations

import torch.distributed as dist

import model as M
import rollout as R


def evaluate(world, engine: R.Engine | None, scorer, problems: list, procs: M.Processors,
             cfg, version: int, seed: int) -> tuple[dict[str, float], list[R.Episode]]:
    """The evaluation problems on the generation ranks, graded by `[eval] functions`: greedy
    when eval.n = 1 (Geometry3K-style), else n samples at eval.temperature. Metrics: each part's
    mean over every sample (pass@1 for a 0/1 part) as eval/<part>, and with n > 1 the mean over
    problems of its best sample as eval/<part>/pass@n."""
    ev, ro = cfg.eval, cfg.rollout
    local: tuple[list, dict] = ([], {})
    if world.is_gen:
        sp = (R.Sampling(n=1, greedy=True, max_new_tokens=ro.max_new_tokens) if ev.n == 1 else
              R.Sampling(n=ev.n, temperature=ev.temperature, top_p=ro.top_p, top_k=ro.top_k,
                         max_new_tokens=ro.max_new_tokens))
        local = R.rollout(engine, problems[world.gen_index::len(world.gens)], procs, sp,
                          cfg.data.template, scorer, version, group_offset=0,
                          seed=seed + world.gen_index)
    got: list = [None] * world.size
    dist.all_gather_object(got, local, group=world.ctrl)
    eps = sorted((e for g, _ in got for e in g), key=lambda e: e.index)
    out: dict[str, float] = {}
    by_problem: dict[int, list[R.Episode]] = {}
    for e in eps:
        by_problem.setdefault(e.index, []).append(e)
    for part in ["reward"] + sorted({k for e in eps for k in e.parts} - {"errors"}):
        value = (lambda e: e.reward) if part == "reward" else (lambda e, k=part: e.parts.get(k, 0.0))
        out[f"eval/{part}"] = sum(map(value, eps)) / max(1, len(eps))
        if ev.n > 1:
            out[f"eval/{part}/pass@{ev.n}"] = (sum(max(map(value, g)) for g in by_problem.values())
                                              / max(1, len(by_problem)))
    out.update({"eval/response_len": sum(len(e.response_ids) for e in eps) / max(1, len(eps)),
                "eval/n": len(by_problem), "eval/samples": len(eps)})
    return out, eps


def eval_rows(eps: list[R.Episode]) -> list[dict]:
    """An evaluation's generations, one row per sample (eval/step_N.jsonl)."""
    seen: dict[int, int] = {}
    rows = []
    for e in eps:
        j = seen[e.index] = seen.get(e.index, -1) + 1
        rows.append({"index": e.index, "sample": j, "reward": e.reward, "parts": e.parts,
                     "length": len(e.response_ids), "truncated": e.truncated, "version": e.version,
                     "response": e.text})
    return rows
