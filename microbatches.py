"""Micro-batches: which episodes go through one trainer forward/backward together, the same
count on every trainer rank (FSDP collectives): fixed-size chunks or a token budget, with one
packed row per prompt where the model allows it (`train.share_prompt`)."""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

import inputs as I


def plan_micro_batches(lengths: list[int], max_seqs: int, max_tokens: int = 0,
                       count: int | None = None) -> list[list[int]]:
    """Group sequence indices into micro-batches.

    `max_tokens > 0`: sort by length and fill each micro-batch while (sequences x longest) stays
    within the budget (less padding than fixed-size chunks); else chunks of `max_seqs` in order.
    `count`: split the largest micro-batches until there are `count` of them, because every
    trainer rank must run the same number of forward/backward passes (FSDP collectives).
    """
    if max_tokens > 0:
        mbs: list[list[int]] = [[]]
        for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            if mbs[-1] and (len(mbs[-1]) + 1) * lengths[i] > max_tokens:  # lengths[i] is the longest
                mbs.append([])
            mbs[-1].append(i)
        mbs = [m for m in mbs if m]
    else:
        mbs = [list(range(i, min(i + max_seqs, len(lengths)))) for i in range(0, len(lengths), max_seqs)]
    return _split_to(mbs, count, len(lengths))


def _split_to(mbs: list[list[int]], count: int | None, n: int) -> list[list[int]]:
    """Split the largest micro-batches until there are `count` of them."""
    while count is not None and len(mbs) < count:
        k = max(range(len(mbs)), key=lambda j: len(mbs[j]))
        if len(mbs[k]) < 2:
            raise ValueError(f"cannot make {count} micro-batches from {n} sequences")
        half = len(mbs[k]) // 2
        mbs[k:k + 1] = [mbs[k][:half], mbs[k][half:]]
    return mbs


def shares_prompt(tc, procs: I.Processors) -> bool:
    """One packed row per prompt: `train.share_prompt`, where the model's layers allow it
    exactly (model.packs_exactly; else one row per episode, said at start)."""
    return tc.share_prompt and procs.packs_exactly


def plan_share(episodes: list, idx: list[int], images: Mapping[int, Any], procs: I.Processors,
               tc, count: int | None = None) -> list[list[int]]:
    """This rank's micro-batches over its episodes `idx` (positions into `idx`).

    With `train.share_prompt` and a token budget, the units are the runs of consecutive episodes
    of one prompt (a packed row: prompt once + every response) so the budget counts what is
    really computed; else each episode is a unit (prompt + response). Fixed-size micro-batches
    take the episodes in order, so G-aligned sizes keep each group in one packed row."""
    n_img = [I.image_tokens(procs, images[episodes[i].index]) for i in idx]
    if not (shares_prompt(tc, procs) and tc.micro_batch_tokens > 0):
        lengths = [len(episodes[i].prompt_ids) - 1 + len(episodes[i].response_ids) + n
                   for i, n in zip(idx, n_img)]
        return plan_micro_batches(lengths, tc.micro_batch_size, tc.micro_batch_tokens, count)
    units: list[list[int]] = []
    for j, i in enumerate(idx):
        if units and episodes[idx[units[-1][0]]].group == episodes[i].group:
            units[-1].append(j)
        else:
            units.append([j])
    lengths = [len(episodes[idx[u[0]]].prompt_ids) - 1 + n_img[u[0]]
               + sum(len(episodes[idx[j]].response_ids) for j in u) for u in units]
    mbs = [[j for k in mb for j in units[k]]
           for mb in plan_micro_batches(lengths, len(units), tc.micro_batch_tokens)]
    return _split_to(mbs, count, len(idx))


def agree_plans(shares: list[list[int]], episodes: list, images: Mapping[int, Any],
                procs: I.Processors, tc, train_group) -> list[list[list[int]]]:
    """The micro-batch plan of each mini-batch share (`shares[j]`: this rank's episodes of
    mini-batch j), with the same number of micro-batches per mini-batch on every trainer rank
    (FSDP collectives); one all-reduce for all of them."""
    plans = [plan_share(episodes, sh, images, procs, tc) for sh in shares]
    n = torch.tensor([len(p) for p in plans])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=train_group)
    return [plan_share(episodes, sh, images, procs, tc, count=int(c))
            for sh, c in zip(shares, n.tolist())]
