"""The trainer ranks' side of a step: the policy and its optimizer, and one update on episodes.

- :class:`Trainer`: the record a trainer rank holds (policy sharded with FSDP2, optional frozen
  reference, AdamW, LR schedule, weight sender); `None` on generation-only ranks.
- :func:`train_step`: advantages -> which responses count (:func:`loss.keep_mask`) -> the step's
  global loss denominator (:func:`loss.loss_denominator`) -> micro-batched forward/backward
  with gradient accumulation -> clip -> optimizer step, and the step's training metrics.
- :func:`plan_micro_batches`: fixed-size or token-budget micro-batches, the same count on every
  trainer rank.

Every micro-batch loss is divided by the step's GLOBAL denominator, so the accumulated gradient
equals the full-batch gradient whatever the micro-batching or the number of ranks (tested).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

import loss as L
import model as M
import sync as S
from failures import fault_active

_SUMMED = ("kl", "clip_frac_low", "clip_frac_high", "ratio_mean", "tis_weight_mean", "approx_kl")


@dataclass
class Trainer:
    policy: Any              # the model, sharded with FSDP2 over the trainer mesh
    ref: Any                 # frozen reference policy (only when loss.kl_coef > 0), else None
    opt: torch.optim.Optimizer
    sched: Any               # LR schedule, stepped once per optimizer step
    sender: S.Sender         # weight sync to the engines
    device: torch.device


def build(model_path: str, world, device: torch.device, mc, tc, lc, sc,
          channel: S.CommChannel | None = None) -> Trainer:
    """Policy (FSDP2), optional frozen reference, AdamW, LR schedule, weight sender, from
    `[model]` (mc), `[train]` (tc), `[loss]` (lc) and `[sync]` (sc)."""
    from torch.distributed.device_mesh import DeviceMesh

    # train(): transformers loads in eval mode, where activation checkpointing never runs
    policy = M.load_model(model_path, dtype=torch.float32, device=device).train()
    # Never DeviceMesh(ranks) over a subset: that calls new_group on the whole world.
    mesh = DeviceMesh.from_group(world.train_group, device.type)
    M.apply_fsdp(policy, mesh, mixed_precision=mc.mixed_precision,
                 checkpointing=mc.activation_checkpointing)
    ref = None
    if lc.kl_coef > 0:  # frozen reference, sharded like the policy; only when used
        ref = M.apply_fsdp(M.load_model(model_path, torch.float32, device).eval(), mesh,
                           mixed_precision=mc.mixed_precision)
        ref.requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=tc.lr, betas=(tc.beta1, tc.beta2),
                            weight_decay=tc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / tc.warmup_steps) if tc.warmup_steps else 1.0)
    sender = S.Sender(policy, mc.dtype, sc.bucket_mb, group=world.sync_group, src=0,
                      is_root=world.is_root, device=device, channel=channel)
    return Trainer(policy, ref, opt, sched, sender, device)


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
    while count is not None and len(mbs) < count:
        k = max(range(len(mbs)), key=lambda j: len(mbs[j]))
        if len(mbs[k]) < 2:
            raise ValueError(f"cannot make {count} micro-batches from {len(lengths)} sequences")
        half = len(mbs[k]) // 2
        mbs[k:k + 1] = [mbs[k][:half], mbs[k][half:]]
    return mbs


def accumulate_gradients(tr: Trainer, episodes: list, idx: list[int], adv: torch.Tensor,
                         keep: torch.Tensor, denom: float, images: Mapping[int, Any], *,
                         procs: M.Processors, train_group, n_trainers: int, lc, tc,
                         temperature: float, max_new_tokens: int,
                         step: int | None = None) -> dict[str, float]:
    """Forward/backward over this rank's episodes `idx` in micro-batches; gradients accumulate.

    `images[e.index]` is episode e's image; `denom` the step's global loss denominator. Returns
    this rank's sums for the step's metrics.
    """
    ip, tk = procs.image_processor, procs.tokens
    lengths = [len(episodes[i].prompt_ids) - 1 + len(episodes[i].response_ids)
               + M.n_image_tokens_of(ip, images[episodes[i].index]) for i in idx]
    plan = plan_micro_batches(lengths, tc.micro_batch_size, tc.micro_batch_tokens)
    n = torch.tensor([len(plan)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=train_group)
    plan = plan_micro_batches(lengths, tc.micro_batch_size, tc.micro_batch_tokens, count=int(n))
    sums = dict.fromkeys(("loss", "entropy", "tokens", "slots", "resp_tokens", *_SUMMED), 0.0)
    lp_diff = 0.0
    for mb in plan:
        chunk = [idx[j] for j in mb]
        eps = [episodes[i] for i in chunk]
        batch = M.collate(eps, [images[e.index] for e in eps], ip, tk, tr.device)
        mask = batch["response_mask"].float() * keep[chunk].float().unsqueeze(1).to(tr.device)
        lp, ent = M.sequence_logprobs(tr.policy, batch, tk, temperature)
        ref_lp = None
        if lc.kl_coef > 0:
            with torch.no_grad():
                ref_lp, _ = M.sequence_logprobs(tr.ref, batch, tk, temperature)
        behaviour = batch["engine_logprobs"]
        # One update per batch: the proximal ("old") policy is the current one, so the ratio is
        # 1 in value with the gradient of the policy gradient; the engine's logprobs enter only
        # through truncated importance sampling (engine/trainer mismatch, one-step staleness).
        loss, m = L.policy_loss(
            lp, lp.detach(), adv[chunk].to(lp.device), mask, clip_low=lc.clip_low,
            clip_high=lc.clip_high, aggregation=lc.aggregation, kl_coef=lc.kl_coef,
            ref_logprobs=ref_lp, kl_estimator=lc.kl_estimator, max_response_len=max_new_tokens,
            tis_cap=lc.tis_cap or None, behaviour_logprobs=behaviour if lc.tis_cap else None,
            loss_denominator=float(denom))
        if fault_active("nan_loss", step):  # tests: a non-finite loss
            loss = loss * float("nan")
        # FSDP2 averages gradients over the trainer ranks; the loss is already normalised by the
        # global denominator, so undo the average to get exactly the full-batch gradient.
        (loss * n_trainers).backward()
        rmask = batch["response_mask"].bool()
        ntok = float(rmask.sum())
        sums["loss"] += float(loss.detach())
        for k in _SUMMED:
            sums[k] += float(m[k]) * ntok
        sums["entropy"] += float(ent.detach()[rmask].sum())
        sums["tokens"] += float(batch["attention_mask"].sum())
        sums["slots"] += float(batch["attention_mask"].numel())
        sums["resp_tokens"] += ntok
        if rmask.any():
            lp_diff = max(lp_diff, float((lp.detach() - behaviour)[rmask].abs().max()))
    sums["micro_batches"] = float(len(plan))
    sums["lp_diff"] = lp_diff
    return sums


def train_step(tr: Trainer, episodes: list, images: Mapping[int, Any], *, world,
               procs: M.Processors, tc, lc, rc, step: int) -> dict[str, float]:
    """One optimizer step on this trainer's share of the step's episodes (every trainer rank
    calls it with the same `episodes`, sorted by group). `[train]` tc, `[loss]` lc, `[rollout]`
    rc. Returns the step's training metrics (the same on every trainer rank)."""
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
    adv = L.group_advantages(rewards, rc.group_size, scale_by_std=lc.scale_by_std).float()  # [N]
    truncated = torch.tensor([e.truncated for e in episodes])
    keep = L.keep_mask(rewards, rc.group_size, truncated, drop_zero_variance=lc.drop_zero_variance,
                       exclude_truncated=lc.exclude_truncated)
    n_dropped = int(L.zero_variance_groups(rewards, rc.group_size).sum()) if lc.drop_zero_variance else 0
    # Excluded episodes stay in the micro-batches with a zero mask, so every trainer rank runs
    # the same number of forward/backward passes (FSDP collectives); they leave the loss and its
    # denominator (loss.py's convention). Compute is not saved; the batch is not refilled.
    denom = L.loss_denominator([len(e.response_ids) for e in episodes], keep.tolist(),
                               lc.aggregation, rc.max_new_tokens)
    per = len(episodes) // len(world.trainers)
    mine = list(range(world.trainer_index * per, (world.trainer_index + 1) * per))
    sums = accumulate_gradients(tr, episodes, mine, adv, keep, max(1.0, denom), images,
                                procs=procs, train_group=world.train_group,
                                n_trainers=len(world.trainers), lc=lc, tc=tc,
                                temperature=rc.temperature, max_new_tokens=rc.max_new_tokens,
                                step=step)
    grad_norm = torch.nn.utils.clip_grad_norm_(tr.policy.parameters(), tc.grad_clip)
    grad_norm = float(S.full_tensor(grad_norm))
    # All trainer ranks see the same global norm, so they agree on skipping a non-finite step.
    skipped = not (grad_norm == grad_norm and abs(grad_norm) != float("inf"))
    if not skipped:
        tr.opt.step()
        tr.sched.step()
    tr.opt.zero_grad(set_to_none=True)
    # One reduction for all sums, one for the max.
    lp_diff = sums.pop("lp_diff")
    keys = list(sums)
    vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(vec, group=world.train_group)
    tot = dict(zip(keys, vec.tolist()))
    mx = torch.tensor([lp_diff], dtype=torch.float64)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=world.train_group)
    ntok = max(1.0, tot["resp_tokens"])
    out = {"loss": tot["loss"], "grad_norm": grad_norm, "kl": tot["kl"] / ntok,
           "entropy": tot["entropy"] / ntok, "logprob_diff/max": float(mx[0]),
           "train/skipped": float(skipped), "train/dropped_groups": float(n_dropped),
           "train/lr": tr.sched.get_last_lr()[0],
           "train/padding_frac": 1.0 - tot["tokens"] / max(1.0, tot["slots"]),
           "train/micro_batches": tot["micro_batches"] / len(world.trainers)}
    for k in ("clip_frac_low", "clip_frac_high", "ratio_mean", "tis_weight_mean", "approx_kl"):
        out[f"train/{k}"] = tot[k] / ntok
    out["advantage/mean"] = float(adv.mean())
    out["advantage/abs_mean"] = float(adv.abs().mean())
    return out
