"""Micro-batches: which episodes go through one trainer forward/backward together, the same
count on every trainer rank (FSDP collectives): fixed-size chunks or a token budget, with one
packed row per prompt where the model allows it (`train.share_prompt`)."""
from __future__ import annotations

from importlib.util import find_spec
from itertools import groupby
from typing import Any, Mapping

import torch
import torch.distributed as dist

import device as D
import envs
import inputs as I
import model as M
from config import PACKED_LAYOUTS, TrainConfig
from errors import ConfigError


def plan_micro_batches(lengths: list[int], max_seqs: int, max_tokens: int = 0) -> list[list[int]]:
    """Group sequence indices into micro-batches: `max_tokens > 0`, by length while (sequences x
    longest) fits the budget; else chunks of `max_seqs` in order."""
    if max_tokens <= 0:
        return [list(range(i, min(i + max_seqs, len(lengths)))) for i in range(0, len(lengths), max_seqs)]
    mbs: list[list[int]] = [[]]
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if mbs[-1] and (len(mbs[-1]) + 1) * lengths[i] > max_tokens:  # lengths[i] is the longest
            mbs.append([])
        mbs[-1].append(i)
    return [m for m in mbs if m]


def split_to(mbs: list[list[int]], count: int, n: int) -> list[list[int]]:
    """Split the largest micro-batches (of `n` sequences in all) until there are `count` of them
    (every trainer rank runs the same number: FSDP collectives)."""
    while len(mbs) < count:
        k = max(range(len(mbs)), key=lambda j: len(mbs[j]))
        if len(mbs[k]) < 2:
            raise ValueError(f"cannot make {count} micro-batches from {n} sequences")
        half = len(mbs[k]) // 2
        mbs[k:k + 1] = [mbs[k][:half], mbs[k][half:]]
    return mbs


def resolve_layout(tc: TrainConfig, procs: I.Processors, model_path: str, device: torch.device,
                   env: str = "") -> tuple[M.RowLayout, list[str]]:
    """At start, the trainer's row layout (model.RowLayout; the config is left as written):
    `train.packing = "auto"` decided (on where the device's packed layout was measured faster for
    this kind of micro-batch (:func:`_auto`) and the environment `env` (rollout.env) shows no
    images in its turns) and said. A model whose layers take no 4-D mask (linear attention)
    packs too, each sequence from a zero state (model.bind_sequences), one sequence per episode
    (its prompt copied: a recurrent state cannot let G responses read one prompt), with the note
    that `train.share_prompt` falls back to that. Returns the layout and the lines to print."""
    row, notes, packing = D.TABLE[device.type], [], tc.packing
    if packing == "auto":
        on, why = _auto(row, tc)
        if envs.extra_images(env) > 0:
            on, why = False, "the environment's turns show images: one row per episode"
        packing = on
        notes.append(f"train.packing {'on' if on else 'off'} (auto: {why})")
    packed = None if not packing else packing if packing in PACKED_LAYOUTS else row.packed_attention
    if packed == "varlen" and row.varlen_package and not find_spec(row.varlen_package):
        raise ConfigError(f"train.packing: the varlen layout runs under flash_attention_2, which "
                          f"needs the {row.varlen_package} package on {device.type} (not installed); "
                          "train.packing = \"segments\" packs without it")
    layout = M.RowLayout(packed, tc.share_prompt and procs.packs_exactly)
    if not procs.packs_exactly and tc.share_prompt:
        notes.append(f"note: {model_path} has layers that take no 4D mask (linear attention): "
                     "train.share_prompt falls back to one sequence per episode")
    return layout, notes


def _auto(row: D.Device, tc: TrainConfig) -> tuple[bool, str]:
    """What "auto" picks on the device `row` for `[train]` tc (device.Device.auto_packing), and
    why, as bench/packing.py measured it (docs/benchmarks.md)."""
    layout = f"{row.kind}'s {row.packed_attention} layout"
    if row.auto_packing == "always":
        return True, f"{layout}, measured faster than padded rows"
    if row.auto_packing == "rows" and not tc.micro_batch_tokens:
        return True, f"{layout}, measured faster than padded micro-batches of micro_batch_size rows"
    if row.auto_packing == "rows":
        return False, (f"{layout} measured slower than length-sorted micro-batches of "
                       "train.micro_batch_tokens; train.packing = true uses it")
    return False, f"{layout} has not run on hardware yet; train.packing = true uses it"


def _units(episodes: list, idx: list[int], images: Mapping[int, Any], procs: I.Processors,
           share: bool) -> tuple[list[list[int]], list[int]]:
    """The sequences of this rank's episodes `idx` (positions into `idx`): the runs of one
    prompt with `share` (prompt once + every response), else one episode each; and each one's
    tokens (images expanded)."""
    units = ([[j for j, _ in run] for _, run in groupby(enumerate(idx), key=lambda ji: episodes[ji[1]].group)]
             if share else [[j] for j in range(len(idx))])
    lengths = [I.sequence_tokens(procs, [episodes[idx[j]] for j in u],
                                 images[episodes[idx[u[0]]].index]) for u in units]
    return units, lengths


def plan_share(episodes: list, idx: list[int], images: Mapping[int, Any], procs: I.Processors,
               tc: TrainConfig, layout: M.RowLayout) -> list[list[int]]:
    """This rank's micro-batches over its episodes `idx` (positions into `idx`). Packed rows
    (`layout.packed`): the sequences (:func:`_units`) first-fit into micro-batches of
    `micro_batch_tokens` (0: `micro_batch_size` x the longest; one longer sequence alone), each
    one packed row; with `share_prompt` and a token budget the units are a prompt's runs (what
    is really computed); else each episode, fixed-size in order."""
    # a prompt's runs where they are what is computed: packed rows, or counted against a budget
    share = layout.share_prompt and (layout.packed or tc.micro_batch_tokens > 0)
    units, lengths = _units(episodes, idx, images, procs, share)
    if layout.packed:
        budget = tc.micro_batch_tokens or tc.micro_batch_size * max(lengths)
        plan = [sorted(r) for r in I.first_fit(lengths, max(budget, max(lengths)))]
    else:
        plan = plan_micro_batches(lengths, tc.micro_batch_size, tc.micro_batch_tokens)
    return [[j for u in mb for j in units[u]] for mb in plan]


def rank_shares(episodes: list, images: Mapping[int, Any], procs: I.Processors, tc: TrainConfig,
                layout: M.RowLayout, n_trainers: int) -> tuple[list[list[list[int]]], float, int]:
    """Every mini-batch's episodes per trainer rank (`shares[j][r]`, positions in the step), the
    step's `train/rank_token_imbalance` (max over ranks / mean of their tokens) and
    `train/oversized_sequences` (sequences, an episode or with `layout.share_prompt` a prompt's
    row, longer than `micro_batch_tokens` > 0: each alone in a micro-batch over the budget;
    nothing splits a sequence). Contiguous equal slices; with packed rows (`layout.packed`)
    balanced by tokens: longest sequence first to the rank with the fewest tokens that has room,
    every rank the same number of sequences (verl's and AReaL's balanced partitions). A prompt's
    G responses stay together where they divide evenly."""
    size = len(episodes) // tc.mini_batches
    per = size // n_trainers
    shares, tokens, oversized = [], [0] * n_trainers, 0
    for j in range(tc.mini_batches):
        mb = list(range(j * size, (j + 1) * size))
        units, lengths = _units(episodes, mb, images, procs, layout.packed and layout.share_prompt)
        if len(units) % n_trainers:  # prompt groups that do not divide evenly: episodes
            units, lengths = _units(episodes, mb, images, procs, False)
        part = (_balance(lengths, n_trainers) if layout.packed else
                [list(range(r * per, (r + 1) * per)) for r in range(n_trainers)])
        shares.append([sorted(mb[k] for u in p for k in units[u]) for p in part])
        if tc.micro_batch_tokens:  # over the sequences plan_share lays out (a shared prompt's: one)
            sizes = _units(episodes, mb, images, procs, layout.share_prompt)[1]
            oversized += sum(n > tc.micro_batch_tokens for n in sizes)
        for r, p in enumerate(part):
            tokens[r] += sum(lengths[u] for u in p)
    return shares, max(tokens) / max(1e-9, sum(tokens) / n_trainers), oversized


def _balance(lengths: list[int], n: int) -> list[list[int]]:
    """Indices into `n` parts of equal count, longest first to the lightest part with room."""
    room, load, parts = len(lengths) // n, [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min((r for r in range(n) if len(parts[r]) < room), key=lambda r: (load[r], r))
        parts[r].append(i)
        load[r] += lengths[i]
    return parts


def agree_plans(shares: list[list[int]], episodes: list, images: Mapping[int, Any],
                procs: I.Processors, tc: TrainConfig, layout: M.RowLayout,
                train_group) -> list[list[list[int]]]:
    """The micro-batch plan of each mini-batch share (`shares[j]`: this rank's episodes of
    mini-batch j), with the same number of micro-batches per mini-batch on every trainer rank
    (FSDP collectives: :func:`split_to`); one all-reduce for all of them."""
    plans = [plan_share(episodes, sh, images, procs, tc, layout) for sh in shares]
    n = torch.tensor([len(p) for p in plans])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=train_group)
    return [split_to(p, int(c), len(sh)) for p, sh, c in zip(plans, shares, n.tolist())]
