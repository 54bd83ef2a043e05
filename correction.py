"""The correction between the trainers' proximal logprobs and the engines' (behaviour) logprobs.

Samples come from the engine's policy (another kernel, another precision, and with
`rollout.max_staleness = k` up to k weight versions old), the loss's ratio is taken against the
trainers' proximal policy (the decoupled objective: docs/async.md). Each mode turns the
per-token importance weight ``w = exp(proximal - behaviour)`` into the weight that multiplies the
policy-gradient term (detached: it reweights samples, it is not optimised). A masked token or
response gets weight 0 and leaves the loss's numerator only: the denominator stays the update's
(as AReaL, TRL, SkyRL and slime do; verl also shrinks the denominator). Each mode follows its
peer's code (tests/test_correction.py checks each against a transcription of it):

==============  ==========================================================  ============  =====
mode            weight                                                      peer          bounds
==============  ==========================================================  ============  =====
token_clamp     w clamped to [low, high] (verl: high only; slime: both)     verl TIS      0, 2
token_mask      w where low <= w <= high, else 0 (low 0: AReaL 524d1d90f's) AReaL         0, 5
sequence_mask   W = exp(sum of the response's log w) on each of its tokens  TRL           high 3
                where low <= W <= high (strict outside), else 0
geometric_mask  1 where low <= exp(mean of the response's log w) <= high,   SkyRL         0.99,
                else 0 (mask only: no weight)                                             1.01
icepop          w where low <= w <= high, else 0                            slime         0.5, 2
==============  ==========================================================  ============  =====

Every mode reads both bounds; `loss.correction_low` / `correction_high` unset take the peer's (so
`icepop` can be given a floor of 0). :func:`check` holds the keys' rules at load (train.load_config,
before any process group): a known mode, no `loss.tis_cap` beside a mode (tis_cap alone is
"token_clamp"), no bound without a mode, low below high.

Where read: AReaL areal/utils/functional/functional.py ``ppo_actor_loss_fn`` at
61d1bbb3d5c8891a76f5c461a5e1fde1dbf0270a (behav_imp_weight_cap; 5.0 in its example configs); TRL
trl/trainer/grpo_trainer.py and grpo_config.py at f2cd57710ae345ea6428ae95363267fcf38a3dc8
(vllm_importance_sampling_mode "sequence_mask", clip_max 3.0, no clip_min); SkyRL
skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py ``compute_sequence_mask`` at
a9564572eb8e91076be43c1bd5e4615e3de17265 (geo_mask_low 0.99, geo_mask_high 1.01; the mean of the
log ratios clamped to +-20); slime slime/backends/megatron_utils/loss.py ``icepop_function`` at
624b824a898ab0ec1fcb4d373004c7f3852bf515 (its IcePop test's 0.5 and 2.0); verl
verl/trainer/ppo/rollout_corr_helper.py at b178a3cd56f58b2d502255daba591e92833930a7
(rollout_is_threshold 2.0); slime's TIS ``torch.clamp(tis, min=args.tis_clip_low,
max=args.tis_clip)`` at 624b824 (slime/backends/megatron_utils/loss.py:897; defaults 0 and 2.0,
slime/utils/arguments.py:1067-1075), the lower clamp `token_clamp` takes as correction_low.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from errors import ConfigError


class Mode(NamedTuple):
    low: float        # the peer's lower bound (0: none)
    high: float       # the peer's upper bound
    masks: bool       # a weight of 0 means "masked" (counted in correction_masked_frac)


CORRECTIONS = {
    "none": Mode(0.0, 0.0, False),
    "token_clamp": Mode(0.0, 2.0, False),
    "token_mask": Mode(0.0, 5.0, True),
    "sequence_mask": Mode(0.0, 3.0, True),
    "geometric_mask": Mode(0.99, 1.01, True),
    "icepop": Mode(0.5, 2.0, True),
}


def mode_of(lc) -> tuple[str, float, float]:
    """(mode, low, high) from the `[loss]` keys: loss.tis_cap > 0 alone is "token_clamp" with that
    cap; an unset bound (None) is the mode's peer bound."""
    mode = lc.correction
    if mode not in CORRECTIONS:
        raise ValueError(f"unknown correction {mode!r}; expected one of {tuple(CORRECTIONS)}")
    high = lc.correction_high
    if mode == "none" and (lc.tis_cap or 0) > 0:
        mode, high = "token_clamp", lc.tis_cap
    elif mode != "none" and (lc.tis_cap or 0) > 0:
        raise ValueError(f"loss.tis_cap and loss.correction={mode!r} both set: use "
                         f"loss.correction_high for the bound")
    peer = CORRECTIONS[mode]
    low = peer.low if lc.correction_low is None else lc.correction_low
    high = peer.high if high is None else high
    if mode != "none" and not low < high:
        raise ValueError(f"loss.correction={mode!r}: correction_low {low} must be below "
                         f"correction_high {high}")
    return mode, low, high


def check(lc) -> None:
    """The `[loss]` correction keys at load: one ConfigError naming the key."""
    mode, cap = lc.correction, lc.tis_cap or 0
    if mode not in CORRECTIONS:
        raise ConfigError(f"loss.correction: unknown {mode!r} (known: {', '.join(CORRECTIONS)})")
    if mode != "none" and cap > 0:
        raise ConfigError(f"loss.tis_cap = {cap} with loss.correction = {mode!r}: tis_cap is the older "
                          f"spelling of correction \"token_clamp\"; remove it (--loss.tis_cap=0) and "
                          f"give the bound as loss.correction_high")
    for side in ("low", "high"):
        if mode == "none" and getattr(lc, f"correction_{side}") is not None:
            raise ConfigError(f"loss.correction_{side}: a bound of loss.correction, which is \"none\""
                              + (" (loss.tis_cap alone: set loss.correction = \"token_clamp\" and "
                                 "loss.correction_high instead)" if cap > 0 else " (set loss.correction)"))
    try:
        mode_of(lc)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def ahead_note(lc, max_staleness: int) -> str | None:
    """The start-up summary's warning for SkyRL's geometric mask with engines running ahead
    (`rollout.max_staleness >= 1`): its +-1% window on the geometric mean of w masks almost every
    token once the behaviour policy is a version or more behind (docs/async.md); None otherwise."""
    if lc.correction != "geometric_mask" or max_staleness < 1:
        return None
    low, high = mode_of(lc)[1:]
    return (f"warning: loss.correction = \"geometric_mask\" (window [{low}, {high}]) with "
            f"rollout.max_staleness = {max_staleness}: responses sampled a version or more behind "
            f"fall outside the window and are masked almost entirely; consider \"token_mask\" or "
            f"\"icepop\" (docs/async.md)")


def weight(mode: str, low: float, high: float, proximal: Tensor, behaviour: Tensor,
           mask: Tensor) -> Tensor:
    """The detached per-token weight ``[B, T]`` of `mode` (rows: responses; `mask`: their kept
    tokens, over which the sequence modes sum or average)."""
    with torch.no_grad():
        m = mask.to(proximal.dtype)
        log_w = (proximal - behaviour) * m
        if mode == "token_clamp":
            return torch.exp(log_w).clamp(min=low, max=high)
        if mode in ("token_mask", "icepop"):  # the same rule; the peers' lower bounds differ
            w = torch.exp(log_w)
            return torch.where((w >= low) & (w <= high), w, torch.zeros_like(w))
        if mode == "sequence_mask":
            seq = torch.exp(log_w.sum(-1, keepdim=True))
            seq = torch.where((seq < low) | (seq > high), torch.zeros_like(seq), seq)
            return seq.expand_as(log_w).clone()
        if mode == "geometric_mask":
            mean = (log_w.sum(-1) / m.sum(-1).clamp(min=1)).clamp(-20, 20)
            keep = ((torch.exp(mean) >= low) & (torch.exp(mean) <= high)).to(proximal.dtype)
            return keep.unsqueeze(-1).expand_as(log_w).clone()
    raise ValueError(f"unknown correction {mode!r}; expected one of {tuple(CORRECTIONS)}")
