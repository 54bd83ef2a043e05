"""GRPO advantages and policy losses: pure functions on tensors (docs/loss.md: the family, the
presets and how each knob maps to TRL, verl and EasyR1).

Owns the maths of one update: group-relative advantages (GRPO, RLOO), which responses are
trained on (:func:`keep_mask`), each objective's policy term (PPO's clipped surrogate, GSPO,
CISPO; more by ``registry.objective``, here or in a ``loss.plugins`` module), the correction
for the engine/trainer mismatch (correction.py), the KL to a reference policy, and
aggregation with an explicit global denominator (:func:`loss_denominator`). No model, no
optimizer, no torch.distributed.

``old_logprobs`` are the proximal policy's: with one update per rollout batch the current
logprobs detached (ratio 1 in value); with several (``train.mini_batches`` / ``ppo_epochs``)
logprobs computed once before the first update. ``loss.correction`` corrects engine ->
proximal (``behaviour_logprobs`` are the engine's), AReaL's decoupled objective.

Shapes: ``B`` responses of up to ``T`` tokens; ``logprobs``, ``old_logprobs``, ``mask`` are
``[B, T]``; ``advantages`` is ``[B]`` (one per response, broadcast over its tokens) or ``[B, T]``
(one per token: on-policy distillation, :func:`distill_advantages`); an objective takes either.

Excluded responses (one convention, every aggregation and objective): a response left out of the
update (DAPO's zero-variance groups, ``exclude_truncated``, a filter) leaves the loss and every
denominator exactly as if it had not been sampled. Left out on purpose: value functions and the
``[-20, 20]`` log-ratio clamps verl and EasyR1 put on the policy ratio (the formulas here are
exactly those in the docstrings); the KL clamp is opt-in (``kl_clamp``).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, NamedTuple, Sequence

import torch
from torch import Tensor

import config as C
import correction as CR
from config import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS
from registry import OBJECTIVES, Key, objective


# --------------------------------------------------------------------------- advantages
def group_advantages(rewards: Tensor, group_size: int, scale_by_std: bool | None = None,
                     eps: float = 1e-6, estimator: str = "grpo") -> Tensor:
    """Group-relative advantages, one per response.

    - ``estimator="grpo"``: ``A = (r - mean_g) / (std_g + eps)``, or ``r - mean_g`` with
      ``scale_by_std=False`` (Dr. GRPO). ``scale_by_std=None`` means True.
    - ``estimator="rloo"`` (REINFORCE leave-one-out, Ahmadian et al. 2024):
      ``A_i = r_i - (sum_g - r_i) / (G - 1)``, the reward minus the mean of the OTHER G - 1
      rewards of its group, which equals ``G / (G - 1) * (r_i - mean_g)``. Never std-scaled:
      ``scale_by_std=None`` or False; ``scale_by_std=True`` raises (a contradiction, not a
      request to ignore). As verl and EasyR1 compute it.

    ``rewards`` is ``[N]`` in consecutive groups of ``group_size`` (the G samples of one prompt).
    ``std_g`` is torch's default, unbiased (N-1) std. A zero-variance group gives A = 0 under
    both estimators (up to the rounding of its sum). ``group_size`` must be >= 2: the unbiased std of one sample is nan, and a
    group of one has no baseline to compare with (verl silently uses mean 0, std 1 there, i.e.
    A = r; a run with G = 1 is a configuration mistake, so this raises instead).
    """
    if estimator not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ADVANTAGES}")
    if estimator == "rloo" and scale_by_std:
        raise ValueError("the rloo estimator has no std scaling; pass scale_by_std=False or None")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group of one has no baseline), got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)                      # [N/G, G]
    if estimator == "rloo":
        others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)   # mean of the other G-1
        return (r - others).reshape(-1)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std is None or scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)                                # [N]


def batch_normalize(advantages: Tensor, lengths: Tensor, eps: float = 1e-5) -> Tensor:
    """``loss.advantage_norm = "batch"``: the step's advantages ``[N]`` normalised again over
    every response token, each response's advantage counted ``lengths[i]`` times (its tokens):
    ``(A - mean) / (std + eps)`` with the token-weighted mean and the unbiased token-weighted std
    (``N_tokens - 1``), in float64. As AReaL's ``Normalization`` with ``mean_level = std_level =
    "batch"`` (areal/utils/data.py, ``NormConfig`` eps 1e-5, ``std_unbiased`` True, at 524d1d90f)
    applied to the advantages broadcast over the loss mask. AReaL all-reduces the two sums over
    its trainer ranks; here every trainer rank holds the whole step's advantages and lengths, so
    the same sums are local. No tokens: returned as they are; one token: std 1, as AReaL."""
    if advantages.shape != lengths.shape or advantages.dim() != 1:
        raise ValueError(f"advantages {tuple(advantages.shape)} and lengths {tuple(lengths.shape)} "
                         "must both be [N]")
    a, w = advantages.double(), lengths.double()
    n = w.sum()
    if n == 0:
        return advantages
    mean = (a * w).sum() / n
    std = (((a - mean) ** 2 * w).sum() / (n - 1)).sqrt() if n > 1 else torch.ones((), dtype=a.dtype)
    return ((a - mean) / (std + eps)).to(advantages.dtype)


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


def distill_advantages(advantages: Tensor, student_logprobs: Tensor, teacher_logprobs: Tensor,
                       coef: float) -> Tensor:
    """On-policy distillation's per-token advantages ``[B, T]``: ``A_i - coef * (log
    pi_student(y_it) - log pi_teacher(y_it))``, the reverse KL to the teacher estimated on the
    sampled token subtracted from the response's advantage ``A_i`` ``[B]``, as slime's
    ``apply_opd_kl_to_advantages`` (slime/backends/megatron_utils/loss.py, after Thinking
    Machines' tinker-cookbook ``distillation/train_on_policy.py``); `student_logprobs`: the
    proximal policy's (no gradient), so the objective's ratio and clip act on it as on any
    advantage. With every reward 0 (reward-free distillation) only the teacher's signal is left."""
    return advantages.unsqueeze(-1) - coef * (student_logprobs - teacher_logprobs).detach()


# --------------------------------------------------------------------------- per-token terms
def clipped_pg(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
               clip_low: float = 0.2, clip_high: float = 0.28,
               clip_dual: float = 0.0) -> tuple[Tensor, Tensor]:
    """PPO/GRPO clipped surrogate per token, and the ratio.

    ``rho = exp(logprobs - old_logprobs)``;
    ``loss = -min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A)``.
    Decoupled bounds are DAPO's clip-higher (0.2 / 0.28); 0.2 / 0.2 is the original PPO/GRPO.

    Dual clip (Ye et al. 2020, arXiv 1912.09729; ``clip_dual = c > 1``, 0 = off): where ``A < 0``
    the loss is further capped, ``loss = min(loss, -A * c)``, so a token whose ratio grew far
    beyond the trust region under a negative advantage stops pushing (its gradient is 0 there).
    As verl's ``compute_policy_loss_vanilla`` (``clip_ratio_c``) computes it:
    ``where(A < 0, min(-A * c, max(-A rho, -A clip(rho))), max(-A rho, -A clip(rho)))``.
    Returns ``(loss [B, T], rho [B, T])``.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    a = per_token(advantages)                             # [B, 1] or [B, T]
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * a, clipped * a)
    if clip_dual:
        loss = torch.where(a < 0, torch.minimum(loss, -a * clip_dual), loss)
    return loss, ratio


# --------------------------------------------------------------------------- objectives
class Term(NamedTuple):
    """What an objective returns: the per-token loss ``[B, T]`` (before TIS, KL and entropy), the
    ratio it clips ``[B, T]`` (train/ratio_mean), and per-token metrics ``{name: [B, T]}`` whose
    mean over the kept tokens is logged as ``train/<name>`` (the built-ins: the clip flags, the
    share of tokens where a bound changes the gradient)."""
    loss: Tensor
    ratio: Tensor
    metrics: dict = {}


CLIP = {"clip_low": Key(0.2, ">= 0"),     # rho >= 1 - clip_low
        "clip_high": Key(0.28, ">= 0")}   # rho <= 1 + clip_high (DAPO's clip-higher)


def _dual_rule(p) -> str | None:
    c = p.clip_dual
    return (None if c == 0 or c > 1 else
            f"clip_dual must be > 1 (the dual-clip cap, verl's clip_ratio_c; 0 = off), got {c}")


def _clip_bounds(p) -> tuple[float, float]:
    if p.clip_low < 0 or p.clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {p.clip_low}, {p.clip_high}")
    return p.clip_low, p.clip_high


def per_token(advantages: Tensor) -> Tensor:
    """Advantages against [B, T] tokens: [B] as [B, 1] (one per response, broadcast over its
    tokens), [B, T] as they are (one per token)."""
    return advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)


def _signed_clips(ratio: Tensor, advantages: Tensor, clip_low: float,
                  clip_high: float) -> dict[str, Tensor]:
    a = per_token(advantages)
    return {"clip_frac_low": (a < 0) & (ratio < 1.0 - clip_low),
            "clip_frac_high": (a > 0) & (ratio > 1.0 + clip_high)}


@objective("ppo", keys={**CLIP, "clip_dual": Key(0.0, ">= 0")}, check=_dual_rule)
def ppo_term(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
             p) -> Term:
    """Objective "ppo": :func:`clipped_pg`, the token-level clipped surrogate (PPO, GRPO, DAPO),
    with dual clip when ``lc.clip_dual > 1``. Keys: ``clip_low``, ``clip_high``, ``clip_dual``.

    Clip flags: low where ``A < 0`` and ``rho < 1 - clip_low``, high where ``A > 0`` and
    ``rho > 1 + clip_high``: exactly where the min picks the clipped, gradient-free branch; dual
    where ``A < 0`` and the cap ``-A * c`` is below the clipped loss (verl's
    ``pg_clipfrac_lower``). ``mask`` is unused (the term is per token).
    """
    clip_low, clip_high = _clip_bounds(p)
    c = p.clip_dual
    if c < 0 or _dual_rule(p):
        raise ValueError(_dual_rule(p) or f"clip_dual must be >= 0, got {c}")
    loss, ratio = clipped_pg(logprobs, old_logprobs, advantages, clip_low, clip_high, c)
    flags = _signed_clips(ratio, advantages, clip_low, clip_high)
    if c:  # dual clip's cap is active (reported only when it is on)
        a = per_token(advantages)
        clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        flags["clip_frac_dual"] = (a < 0) & (-torch.minimum(ratio * a, clipped * a) > -a * c)
    return Term(loss, ratio, flags)


@objective("gspo", keys=CLIP)
def gspo_term(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
              p) -> Term:
    """Objective "gspo" (Zheng et al. 2025, Group Sequence Policy Optimization). Keys:
    ``clip_low``, ``clip_high``.

    Sequence-level ratio, with gradient: ``S_i = exp(sum_t m_it (logp_it - old_it) / sum_t m_it)``
    (the geometric mean of the token ratios of response i); every token t of response i gets
    ``l_it = -min(S_i A_i, clip(S_i, 1 - clip_low, 1 + clip_high) A_i)``, then the configured
    aggregation (GSPO proper: "seq-mean-token-mean", clips around 3e-4 / 4e-4). A response with
    no masked-in token has ``S = 1`` and leaves the loss through its zero mask.

    Clip flags: as PPO's but on ``S_i`` (sign of ``A_i``), broadcast to every token of the
    response: ``train/clip_frac_*`` is the share of response TOKENS under a clipped sequence.
    (TRL, verl, EasyR1: docs/loss.md.)

    Per-token advantages ``A_it`` (``[B, T]``): GSPO-token (the paper's section 4.3), ``s_it =
    sg(S_i) * pi(y_it) / sg(pi(y_it))``, equal to ``S_i`` in value, each token's gradient its own:
    ``l_it = -min(s_it A_it, clip(s_it) A_it)`` (with one advantage per response: GSPO's gradient).
    """
    clip_low, clip_high = _clip_bounds(p)
    m = mask.to(logprobs.dtype)
    diff = torch.where(m > 0, logprobs - old_logprobs, torch.zeros_like(logprobs))
    seq_ratio = torch.exp(diff.sum(-1) / m.sum(-1).clamp(min=1.0))        # [B]
    if advantages.dim() == 2:
        tok = seq_ratio.detach().unsqueeze(-1) * torch.exp(logprobs - logprobs.detach())  # [B, T]
        clipped = torch.clamp(tok, 1.0 - clip_low, 1.0 + clip_high)
        loss = -torch.minimum(tok * advantages, clipped * advantages)
        return Term(loss, tok, _signed_clips(tok, advantages, clip_low, clip_high))
    clipped = torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_seq = -torch.minimum(seq_ratio * advantages, clipped * advantages)  # [B]
    ratio = seq_ratio.unsqueeze(-1).expand_as(logprobs)                   # [B, T]
    loss = per_seq.unsqueeze(-1).expand_as(logprobs)
    return Term(loss, ratio, _signed_clips(ratio, advantages, clip_low, clip_high))


@objective("cispo", keys=CLIP)
def cispo_term(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
               p) -> Term:
    """Objective "cispo" (MiniMax-M1, Clipped IS-weight Policy Optimization). Keys:
    ``clip_low``, ``clip_high``.

    ``l_it = -sg(clip(rho_it, 1 - clip_low, 1 + clip_high)) * A_i * logp_it``: REINFORCE on every
    token, weighted by the clipped and detached importance ratio, so a clipped token still gets a
    (bounded) gradient instead of none. ``clip_low >= 1`` means no lower bound (rho > 0). With
    ``rho = 1`` the gradient equals PPO's (``-A``), the value does not (it is ``-A * logp``).

    Clip flags: where the weight is clipped, whatever the sign of A (the weight scales the
    gradient of both signs): low ``rho < 1 - clip_low``, high ``rho > 1 + clip_high``. TRL's
    recommended cap 5.0 is ``clip_high = 4.0`` here, with ``clip_low >= 1`` (docs/loss.md).
    """
    clip_low, clip_high = _clip_bounds(p)
    ratio = torch.exp(logprobs - old_logprobs)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    loss = -weight * per_token(advantages) * logprobs
    return Term(loss, ratio, {"clip_frac_low": ratio < 1.0 - clip_low,
                              "clip_frac_high": ratio > 1.0 + clip_high})


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3",
               clamp: float = 0.0) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi (Schulman's k1/k2/k3).

    k1: ``logp - ref`` (unbiased, can be negative); k2: ``0.5 * (logp - ref)^2``;
    k3: ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, >= 0; GRPO/DeepSeekMath, TRL, verl's
    and EasyR1's "low_var_kl").

    Why a clamp: with ``d = ref - logp`` the k3 gradient per token is ``d k3 / d logp = 1 - e^d``,
    unbounded where the reference is far more likely than the policy (-19 at d = 3 nats,
    -162,754 at d = 12): one such token can dominate a step. ``clamp = c > 0`` does what verl's
    and EasyR1's low_var_kl do (``kl = clamp(d, -20, 20)``, ``kld = clamp(exp(kl) - kl - 1,
    -10, 10)``, there with c = 10 fixed and only for k3), here for any estimator:

    - value: the estimate is clamped to ``[-c, c]`` (k3 and k2 are >= 0, so ``min(kl, c)``);
      for k3 the log-ratio is first limited to ``[-20, 20]`` so that ``exp`` cannot overflow to
      inf (inf clamped has gradient 0 * inf = nan);
    - gradient: unchanged where the estimate is inside ``[-c, c]``; ZERO where it is outside
      (clamp's gradient): such tokens stop being pulled towards the reference at all. For k3 with
      c = 10 the edges are d = 2.611 (gradient 1 - e^2.611 = -12.6 just inside) and d = -11.0, so
      every KL gradient is bounded by 12.6 per token.
    ``clamp = 0`` (the default) is off: exactly the unclamped formulas.
    """
    if clamp < 0:
        raise ValueError(f"kl clamp must be >= 0 (0 = off), got {clamp}")
    if estimator == "k1":
        kl = logprobs - ref_logprobs
    elif estimator == "k2":
        kl = 0.5 * (logprobs - ref_logprobs) ** 2
    elif estimator == "k3":
        d = ref_logprobs - logprobs
        if clamp > 0:
            d = d.clamp(-20.0, 20.0)
        kl = torch.exp(d) - d - 1.0
    else:
        raise ValueError(f"unknown kl_estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    return kl.clamp(-clamp, clamp) if clamp > 0 else kl


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k1",
                clamp: float = 0.0) -> tuple[Tensor, Tensor]:
    """Per response: ``(sum_t m_t kl_t, sum_t m_t)`` with ``kl = kl_penalty(logprobs,
    ref_logprobs, estimator, clamp)``, no gradient. ``[B]`` each.

    The KL in the reward (``loss.kl_in_reward``, verl's ``apply_kl_penalty``): verl subtracts
    ``beta * kl_t`` from every token-level reward, with ``logprobs`` the proximal ("old")
    policy's and its default estimator "kl" (k1 here); GRPO's and RLOO's outcome advantages
    then sum the token-level rewards of a response (``compute_grpo_outcome_advantage``:
    ``scores = token_level_rewards.sum(-1)``), so response i is ranked by
    ``r_i - beta * sum_t kl_it``: the first return value times the coefficient. The controller's
    measurement (:func:`adaptive_kl_coef`) is verl's ``current_kl``: the mean over responses
    of ``sum / count`` (0 for an empty response).
    """
    with torch.no_grad():
        m = mask.to(logprobs.dtype)
        kl = kl_penalty(logprobs, ref_logprobs, estimator, clamp)
        return (kl * m).sum(-1), m.sum(-1)


def adaptive_kl_coef(value: float, current_kl: float, target: float, horizon: int,
                     n_steps: int) -> float:
    """The adaptive KL controller (Ziegler et al. 2019, arXiv 1909.08593) as verl's and
    OpenRLHF's ``AdaptiveKLController.update``: ``e = clip(current_kl / target - 1, -0.2, 0.2)``,
    ``value * (1 + e * n_steps / horizon)``. Both peers pass ``n_steps`` = the responses of the
    rollout batch (verl ``batch_size``, OpenRLHF ``rollout_batch_size * n_samples_per_prompt``)
    and call it once per rollout step, after the coefficient was used. Here the multiplier is
    clipped to [0.5, 1.5]: the peers' (EasyR1's too) is unclipped and turns negative once
    ``n_steps > 5 * horizon`` (a KL in the loss then stops the run on a negative coefficient;
    in the reward the penalty becomes a bonus); the clip leaves it equal to theirs whenever
    ``n_steps <= 2.5 * horizon`` and keeps the coefficient positive, so it can grow again."""
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
    error = min(0.2, max(-0.2, current_kl / target - 1.0))
    return value * min(1.5, max(0.5, 1.0 + error * n_steps / horizon))


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
def resolve(lc: Any = None, **knobs: Any) -> tuple[Any, Any]:
    """(the ``[loss]`` section with ``knobs`` replacing its own keys, the objective's keys with
    ``knobs`` replacing them). ``lc`` None: ``config.LossConfig()``'s defaults. A knob that is a
    key of neither is a TypeError naming it (a misspelt key never passes silently)."""
    lc = C.LossConfig() if lc is None else lc
    part = OBJECTIVES.get(lc.objective if "objective" not in knobs else knobs["objective"])
    if part is None:
        raise ValueError(f"unknown objective {knobs.get('objective', lc.objective)!r}; "
                         f"expected one of {tuple(OBJECTIVES)}")
    own = ({f.name for f in dataclasses.fields(lc)} - {"params"}) | {"max_response_len"}
    unknown = sorted(k for k in knobs if k not in own and k not in part.keys)
    if unknown:
        raise TypeError(f"unknown [loss] key(s) {unknown}: not keys of {type(lc).__name__} "
                        f"nor of objective {part.name!r}")
    general = SimpleNamespace(**{k: knobs.get(k, getattr(lc, k, None)) for k in own})
    return general, part.params(lc, {k: v for k, v in knobs.items() if k in part.keys})


def _check_knobs(k: Any, ref_logprobs: Tensor | None, behaviour_logprobs: Tensor | None,
                 entropy: Tensor | None) -> None:
    if k.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {k.kl_estimator!r}; "
                         f"expected one of {KL_ESTIMATORS}")
    for key in ("kl_coef", "kl_clamp", "entropy_coef", "tis_cap"):
        if (getattr(k, key) or 0.0) < 0:
            raise ValueError(f"{key} must be >= 0, got {getattr(k, key)}")
    if k.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's logprobs)")
    if k.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy (each token's entropy, with its gradient)")
    if CR.mode_of(k)[0] != "none" and behaviour_logprobs is None:
        raise ValueError(f"correction {CR.mode_of(k)[0]!r} needs behaviour_logprobs (the engine's logprobs)")


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                lc: Any = None, *, ref_logprobs: Tensor | None = None,
                behaviour_logprobs: Tensor | None = None, entropy: Tensor | None = None,
                loss_denominator: float | None = None, **knobs: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO / Dr. GRPO / DAPO / GSPO / CISPO policy loss and its metrics.

    Knobs: ``lc`` is the ``[loss]`` section (``config.LossConfig``; None: its defaults); keyword
    ``knobs`` replace its keys or the objective's for this call (the trainer passes the step's
    KL coefficient as ``kl_coef``; tests write ``clip_low=0.1``); :func:`resolve`. The objective
    (``registry.OBJECTIVES``) receives its own keys. One knob is not a key:
    ``max_response_len``, the generation limit ("seq-mean-token-sum-norm"'s constant).

    Per token: ``l = term.loss * w + kl_coef * kl_penalty(logprobs, ref_logprobs, kl_estimator,
    kl_clamp) - entropy_coef * entropy``, where ``term`` is the objective's (:func:`ppo_term`,
    :func:`gspo_term`, :func:`cispo_term`, or a registered one) and ``w`` the weight of
    ``loss.correction`` (correction.py; ``tis_cap > 0`` alone: "token_clamp"), else 1. It multiplies only the
    policy-gradient term (as TRL and verl do): it corrects which distribution the samples came
    from for the advantage-weighted term; the KL and entropy terms are regularisers. Then
    ``loss = aggregate(l, mask, aggregation, loss_denominator, max_response_len)``: as verl's
    ``pg_loss - entropy_coeff * agg_loss(entropy) + kl_loss_coef * agg_loss(kl)`` with one
    aggregation and denominator for all three terms (aggregate is linear).

    ``entropy`` (``[B, T]``, each token's entropy WITH its gradient) is required when
    ``entropy_coef > 0``. ``loss_denominator`` (None: this call's own) replaces the denominator
    with the whole update's (:func:`loss_denominator` over the update's episodes on every rank):
    the kept tokens ("token-mean"), the kept responses ("seq-mean-token-mean"), or kept responses x
    ``max_response_len`` ("seq-mean-token-sum-norm"); :func:`local_denominator` gives each
    micro-batch's share. With it, summing the losses of the micro-batches (and ranks) reproduces
    the full-batch loss and gradient exactly, for every objective (GSPO's sequence ratio lives
    inside one response, so it never spans micro-batches).

    ``ref_logprobs`` is required when ``kl_coef > 0``; when given with ``kl_coef == 0`` the KL
    is only measured. ``behaviour_logprobs`` without a correction is ignored.

    Metrics (0-d tensors on the loss's device, over this call's masked tokens, no grad: nothing
    is read to the host here, the trainer reads a step's metrics once, update.py): the term's own (the built-ins:
    ``clip_frac_low``, ``clip_frac_high``, and ``clip_frac_dual`` when dual clip is on: the share
    of tokens where that bound is active, see each term), ``approx_kl`` (KL(pi_old || pi) by k3 on tokens sampled from
    pi_old: ``rho - 1 - log rho``, per token for every objective), ``ratio_mean`` (the ratio the
    objective clips: per token, or GSPO's ``S_i`` on each of its tokens), ``tis_weight_mean``
    (the correction's mean weight; 1.0 without one), ``correction_masked_frac`` (the share of
    tokens a masking correction gave weight 0), ``kl`` (mean ``kl_penalty`` to the reference as in the loss, clamp
    included; 0.0 without one), ``tokens`` (mask sum).
    """
    k, own = resolve(lc, **knobs)
    _check_shapes(logprobs, old_logprobs, advantages, mask, ref_logprobs, behaviour_logprobs,
                  entropy)
    _check_aggregation(k.aggregation, k.max_response_len)
    _check_knobs(k, ref_logprobs, behaviour_logprobs, entropy)
    mode, low, high = CR.mode_of(k)

    term = Term(*OBJECTIVES[k.objective].fn(logprobs, old_logprobs, advantages, mask, own))
    per_token = term.loss
    weight = None
    if mode != "none":
        weight = CR.weight(mode, low, high, old_logprobs, behaviour_logprobs, mask)
        per_token = per_token * weight
    kl = None if ref_logprobs is None else kl_penalty(logprobs, ref_logprobs, k.kl_estimator, k.kl_clamp)
    if k.kl_coef > 0:  # with ref_logprobs (_check_knobs)
        per_token = per_token + k.kl_coef * kl
    if k.entropy_coef > 0:
        per_token = per_token - k.entropy_coef * entropy
    loss = aggregate(per_token, mask, k.aggregation, loss_denominator, k.max_response_len)

    with torch.no_grad():  # 0-d tensors where the loss is: no host sync (read once per step)
        m = mask.to(logprobs.dtype)
        n = m.sum()

        def mean(x: Tensor) -> Tensor:
            return torch.where(n > 0, (x * m).sum() / n, 0.0)

        def const(v: float) -> Tensor:
            return torch.tensor(v, dtype=m.dtype, device=m.device)

        metrics = {name: mean(x.to(m.dtype)) for name, x in term.metrics.items()}
        metrics |= {
            "approx_kl": mean(kl_penalty(old_logprobs, logprobs, "k3")),
            "ratio_mean": mean(term.ratio),
            "tis_weight_mean": mean(weight) if weight is not None else const(1.0),
            "correction_masked_frac": (mean((weight == 0).to(m.dtype))
                                       if weight is not None and CR.CORRECTIONS[mode].masks else const(0.0)),
            "kl": mean(kl) if kl is not None else const(0.0),
            "tokens": n,
        }
    return loss, metrics


def log_name(metric: str) -> str:
    """The metrics.jsonl key of a :func:`policy_loss` metric: ``kl`` as it is, the others (every
    term's own included) ``train/<name>``."""
    return metric if metric == "kl" else f"train/{metric}"


def _check_shapes(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                  ref_logprobs: Tensor | None, behaviour_logprobs: Tensor | None,
                  entropy: Tensor | None = None) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    named = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs,
             "behaviour_logprobs": behaviour_logprobs, "entropy": entropy}
    for name, x in named.items():
        if x is not None and x.shape != shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(x.shape)}")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages must be [B]={tuple(shape[:1])} or [B, T]={tuple(shape)}, got "
                         f"{tuple(advantages.shape)}")
