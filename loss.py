"""GRPO advantages and policy losses: pure functions on tensors.

Owns the maths of one update and every fact about it: group-relative advantages, which responses
are trained on (:func:`keep_mask`), the clipped policy-gradient term, truncated importance
sampling (TIS) for the engine/trainer mismatch, the KL penalty to a reference policy, and loss
aggregation with an explicit global denominator (:func:`loss_denominator`). No model, no
optimizer, no torch.distributed: the trainer asks this module for the step's denominator and
passes it to every micro-batch.

Shapes: ``B`` responses of up to ``T`` tokens; ``logprobs``, ``old_logprobs``, ``mask`` are
``[B, T]``; ``advantages`` is ``[B]`` (one per response, broadcast over its tokens).

Excluded responses (one convention, every aggregation): a response left out of the update (its
group has zero reward variance under DAPO's dynamic sampling, or it was cut at the length limit
with ``exclude_truncated``) leaves the loss entirely, exactly as if it had not been sampled: its
tokens leave "token-mean"'s count, it leaves the sequence count of "seq-mean-token-mean", and
"seq-mean-token-sum-norm" normalises by (kept responses) x max_response_len. (TRL instead keeps
masked responses in its sequence counts; here a dropped response never dilutes the others.)

A new objective is one new function: build the per-token loss (e.g. a variant of
:func:`clipped_pg`), add :func:`kl_penalty` if wanted, and reduce with :func:`aggregate`;
:func:`policy_loss` is itself only that composition.

Left out on purpose: dual-clip PPO, value functions, entropy bonus, the ``[-20, 20]`` log-ratio
and ``[-10, 10]`` KL clamps verl adds for stability (the formulas here are exactly those in
the docstrings, so an independent implementation matches to rounding).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


# --------------------------------------------------------------------------- advantages
def group_advantages(rewards: Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """GRPO advantages: ``A = (r - mean_g) / (std_g + eps)``, or ``r - mean_g`` (Dr. GRPO).

    ``rewards`` is ``[N]`` in consecutive groups of ``group_size`` (the G samples of one prompt).
    ``std_g`` is torch's default, unbiased (N-1) std. A zero-variance group gives A = 0.
    ``group_size`` must be >= 2: the unbiased std of one sample is nan, and a group of one has
    no baseline to compare with (verl silently uses mean 0, std 1 there, i.e. A = r; a GRPO run
    with G = 1 is a configuration mistake, so this raises instead).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group of one has no baseline), got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)                      # [N/G, G]
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)                                # [N]


def zero_variance_groups(rewards: Tensor, group_size: int, atol: float = 0.0) -> Tensor:
    """``BoolTensor[N/G]``: True where every reward of the group is equal (max - min <= atol).

    Such groups have zero advantage, so they only dilute the batch (DAPO's dynamic sampling
    drops them). The default ``atol=0`` means exact equality, which is what rule-based rewards
    give; comparing max and min (not the std) avoids float noise in the mean.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)
    return (r.amax(dim=1) - r.amin(dim=1)) <= atol


def keep_mask(rewards: Tensor, group_size: int, truncated: Tensor | None = None, *,
              drop_zero_variance: bool = False, exclude_truncated: bool = False) -> Tensor:
    """``BoolTensor[N]``: the responses the update trains on.

    ``drop_zero_variance`` leaves out every response of a group whose rewards are all equal
    (:func:`zero_variance_groups`; DAPO's dynamic sampling); ``exclude_truncated`` leaves out
    responses cut at the length limit (``truncated``: ``BoolTensor[N]``; DAPO's overlong
    filtering: such a response has no final answer, so its reward is noise). An excluded response
    leaves the loss and every denominator (module docstring).
    """
    keep = torch.ones(rewards.numel(), dtype=torch.bool)
    if drop_zero_variance:
        keep &= ~zero_variance_groups(rewards, group_size).repeat_interleave(group_size)
    if exclude_truncated:
        if truncated is None or truncated.shape != keep.shape:
            raise ValueError(f"exclude_truncated needs truncated of shape {tuple(keep.shape)}")
        keep &= ~truncated.bool()
    return keep


# --------------------------------------------------------------------------- per-token terms
def clipped_pg(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
               clip_low: float = 0.2, clip_high: float = 0.28) -> tuple[Tensor, Tensor]:
    """PPO/GRPO clipped surrogate per token, and the ratio.

    ``rho = exp(logprobs - old_logprobs)``;
    ``loss = -min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A)``.
    Decoupled bounds are DAPO's clip-higher (0.2 / 0.28); 0.2 / 0.2 is the original PPO/GRPO.
    Returns ``(loss [B, T], rho [B, T])``.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    a = advantages.unsqueeze(-1)                          # [B, 1]
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -torch.minimum(ratio * a, clipped * a), ratio


def tis_weight(old_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance weight ``min(exp(old - behaviour), cap)``, detached.

    Corrects for the engine (vLLM) sampling from a slightly different distribution than the
    trainer's ``old`` policy (different kernels, precision). Detached: it reweights samples,
    it is not something to optimise.
    """
    return torch.clamp(torch.exp(old_logprobs - behaviour_logprobs), max=cap).detach()


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi (Schulman's k1/k2/k3).

    k1: ``logp - ref`` (unbiased, can be negative); k2: ``0.5 * (logp - ref)^2``;
    k3: ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, >= 0; GRPO/DeepSeekMath, TRL).
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    if estimator == "k3":
        d = ref_logprobs - logprobs
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


# --------------------------------------------------------------------------- aggregation
def loss_denominator(response_lengths: Sequence[int], keep: Sequence[bool], aggregation: str,
                     max_response_len: int | None = None) -> float:
    """The whole step's loss denominator, from every response's token count and keep flag.

    "token-mean": kept response tokens; "seq-mean-token-mean": kept responses;
    "seq-mean-token-sum-norm": kept responses x ``max_response_len``. Excluded responses count
    nowhere (module docstring). Equals the sum of :func:`local_denominator` over every
    micro-batch and rank when their masks zero the excluded responses.
    """
    _check_aggregation(aggregation, max_response_len)
    kept = [n for n, k in zip(response_lengths, keep, strict=True) if k]
    if aggregation == "token-mean":
        return float(sum(kept))
    if aggregation == "seq-mean-token-mean":
        return float(len(kept))
    return float(len(kept) * max_response_len)


def local_denominator(mask: Tensor, aggregation: str, max_response_len: int | None = None) -> float:
    """This batch's share of the loss denominator; summed over micro-batches and ranks it is
    :func:`loss_denominator`.

    "token-mean": number of masked-in tokens; "seq-mean-token-mean": number of responses with at
    least one masked-in token (a fully masked row is an excluded response: it does not count);
    "seq-mean-token-sum-norm": that number x ``max_response_len``.
    """
    _check_aggregation(aggregation, max_response_len)
    if aggregation == "token-mean":
        return float(mask.sum())
    rows = float((mask.sum(-1) > 0).sum())
    return rows if aggregation == "seq-mean-token-mean" else rows * max_response_len


def aggregate(per_token: Tensor, mask: Tensor, aggregation: str = "token-mean",
              denominator: float | None = None, max_response_len: int | None = None) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar: ``numerator / denominator``.

    - "token-mean" (DAPO, TRL "bnpo"/"dapo"): ``sum(l*m) / sum(m)``;
    - "seq-mean-token-mean" (GRPO as in DeepSeekMath, TRL "grpo"):
      ``sum_i [sum_t(l*m)_i / sum_t(m)_i] / B`` over the ``B`` responses with any masked-in
      token (a fully masked row is an excluded response: it adds 0 and does not count);
    - "seq-mean-token-sum-norm" (Dr. GRPO): ``sum(l*m) / (B * max_response_len)``, a constant
      normaliser per response, so no length bias.

    ``denominator`` (if given) replaces the local one (:func:`local_denominator`): pass the sum of
    :func:`local_denominator` over every micro-batch and trainer rank of the step; then the sum of
    the returned losses over micro-batches and ranks equals the full-batch loss exactly, and so
    do the accumulated gradients. (If gradients are averaged over ranks, as FSDP does by default,
    multiply the loss by the number of ranks.) A zero denominator means an empty numerator: the
    loss is 0, not nan.
    """
    _check_aggregation(aggregation, max_response_len)
    m = mask.to(per_token.dtype)
    if aggregation == "seq-mean-token-mean":
        numerator = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum()
    else:
        numerator = (per_token * m).sum()
    if denominator is None:
        denominator = local_denominator(mask, aggregation, max_response_len)
    elif denominator < 0:
        raise ValueError(f"loss denominator must be >= 0, got {denominator}")
    return numerator / (denominator if denominator > 0 else 1.0)


def _check_aggregation(aggregation: str, max_response_len: int | None) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    if aggregation == "seq-mean-token-sum-norm" and (max_response_len is None or max_response_len <= 0):
        raise ValueError("aggregation 'seq-mean-token-sum-norm' needs max_response_len > 0 "
                         f"(the generation limit), got {max_response_len}")


# --------------------------------------------------------------------------- the loss
def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.28, aggregation: str = "token-mean",
                kl_coef: float = 0.0, ref_logprobs: Tensor | None = None, kl_estimator: str = "k3",
                max_response_len: int | None = None, tis_cap: float | None = None,
                behaviour_logprobs: Tensor | None = None,
                loss_denominator: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """GRPO / Dr. GRPO / DAPO policy loss and its metrics.

    Per token: ``l = clipped_pg(...) * w + kl_coef * kl_penalty(logprobs, ref_logprobs)``, where
    ``w = tis_weight(old_logprobs, behaviour_logprobs, tis_cap)`` if ``tis_cap`` is set, else 1.
    TIS multiplies only the policy-gradient term (as TRL and verl do): it corrects which
    distribution the samples came from for the advantage-weighted term; the KL term is a
    regulariser. Then ``loss = aggregate(l, mask, aggregation, loss_denominator, max_response_len)``.

    ``loss_denominator`` (None: this call's own) replaces the denominator with the whole step's
    (:func:`loss_denominator`): the kept tokens ("token-mean"), the kept responses
    ("seq-mean-token-mean"), or kept responses x ``max_response_len``
    ("seq-mean-token-sum-norm"); :func:`local_denominator` gives each micro-batch's share. With it, summing the losses of the
    micro-batches (and ranks) reproduces the full-batch loss and gradient exactly.

    ``ref_logprobs`` is required when ``kl_coef > 0``; when given with ``kl_coef == 0`` the KL
    is only measured. ``behaviour_logprobs`` without ``tis_cap`` is ignored.

    Metrics (floats, over this call's masked tokens, no grad): ``clip_frac_low`` (A < 0 and
    rho < 1 - clip_low: the low clip is active), ``clip_frac_high`` (A > 0 and rho > 1 +
    clip_high), ``approx_kl`` (KL(pi_old || pi) by k3 on tokens sampled from pi_old:
    ``rho - 1 - log rho``), ``ratio_mean``, ``tis_weight_mean`` (1.0 when TIS is off), ``kl``
    (mean ``kl_penalty`` to the reference, 0.0 without one), ``tokens`` (mask sum).
    """
    _check_shapes(logprobs, old_logprobs, advantages, mask, ref_logprobs, behaviour_logprobs)
    _check_aggregation(aggregation, max_response_len)
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; expected one of {KL_ESTIMATORS}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's logprobs)")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if tis_cap is not None:
        if behaviour_logprobs is None:
            raise ValueError("tis_cap needs behaviour_logprobs (the engine's logprobs)")
        if tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {tis_cap}")

    per_token, ratio = clipped_pg(logprobs, old_logprobs, advantages, clip_low, clip_high)
    weight = None
    if tis_cap is not None:
        weight = tis_weight(old_logprobs, behaviour_logprobs, tis_cap)
        per_token = per_token * weight
    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator)
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    loss = aggregate(per_token, mask, aggregation, loss_denominator, max_response_len)

    with torch.no_grad():
        m = mask.to(logprobs.dtype)
        n = m.sum()

        def mean(x: Tensor) -> float:
            return float((x * m).sum() / n) if n > 0 else 0.0

        a = advantages.unsqueeze(-1)
        metrics = {
            "clip_frac_low": mean(((a < 0) & (ratio < 1.0 - clip_low)).to(m.dtype)),
            "clip_frac_high": mean(((a > 0) & (ratio > 1.0 + clip_high)).to(m.dtype)),
            "approx_kl": mean(kl_penalty(old_logprobs, logprobs, "k3")),
            "ratio_mean": mean(ratio),
            "tis_weight_mean": mean(weight) if weight is not None else 1.0,
            "kl": mean(kl) if kl is not None else 0.0,
            "tokens": float(n),
        }
    return loss, metrics


def _check_shapes(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                  ref_logprobs: Tensor | None, behaviour_logprobs: Tensor | None) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    named = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs,
             "behaviour_logprobs": behaviour_logprobs}
    for name, x in named.items():
        if x is not None and x.shape != shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(x.shape)}")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(shape[:1])}, got {tuple(advantages.shape)}")
