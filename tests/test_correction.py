"""loss.correction: each mode against a transcription of its peer's code (correction.py cites the
file and commit read), the bounds' defaults and rules, and what a masked token does to the loss
(it leaves the numerator, the denominator stays)."""
from __future__ import annotations

import math

import pytest
import torch

import config as C
import correction as CR
import loss as L

B, T = 6, 7


def tensors(seed: int = 0, spread: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    behav = prox + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return prox, behav, mask


# ------------------------------------------------------------- the peers' code, transcribed
def areal_token_mask(prox, behav, mask, cap):
    """AReaL ppo_actor_loss_fn (61d1bbb): behav_imp_weight = exp(prox - behav), behav_mask =
    (w <= cap) & loss_mask, weight = where(behav_mask, w, 0)."""
    w = torch.exp(prox - behav)
    keep = (w <= cap).logical_and(mask.bool())
    return torch.where(keep, w, torch.zeros_like(w))


def trl_sequence_mask(prox, behav, mask, clip_min, clip_max):
    """TRL grpo_trainer (f2cd577): per-sequence log ratio summed over the completion mask,
    is_ratio = exp(sum); masked to 0 outside [clip_min, clip_max]; broadcast to the tokens."""
    log_ratio = ((prox - behav) * mask).sum(-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    lo = -math.inf if clip_min is None else clip_min
    ratio = ratio.masked_fill((ratio < lo) | (ratio > clip_max), 0.0)
    return ratio.expand(-1, prox.shape[1])


def skyrl_geometric_mask(prox, behav, mask, low, high):
    """SkyRL compute_sequence_mask (a956457): mean log ratio over the mask, clamped to +-20,
    exp; the sequence is masked where it is above high or below low."""
    log_ratio = (prox - behav) * mask
    mean = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
    geo = torch.exp(torch.clamp(mean, -20.0, 20.0))
    keep = ~((geo > high) | (geo < low))
    return keep.to(prox.dtype).unsqueeze(-1).expand(-1, prox.shape[1])


def slime_icepop(prox, behav, mask, low, high):
    """slime icepop_function (624b824): ratio = exp(old - rollout); weight = ratio where
    low <= ratio <= high, else 0."""
    ratio = torch.exp(prox - behav)
    return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))


def verl_tis(prox, behav, mask, threshold):
    """verl compute_rollout_correction_weights (b178a3c), token level: exp(clamp(log ratio,
    +-20)) x mask, clamped to the threshold from above."""
    return (torch.exp(torch.clamp(prox - behav, -20, 20)) * mask).clamp(max=threshold)


PEERS = {
    "token_clamp": lambda p, b, m, lo, hi: verl_tis(p, b, m, hi),
    "token_mask": lambda p, b, m, lo, hi: areal_token_mask(p, b, m, hi),
    "sequence_mask": lambda p, b, m, lo, hi: trl_sequence_mask(p, b, m, lo or None, hi),
    "geometric_mask": skyrl_geometric_mask,
    "icepop": slime_icepop,
}
SPREAD = {"token_clamp": 0.6, "token_mask": 1.2, "sequence_mask": 0.7, "geometric_mask": 0.05,
          "icepop": 0.6}


@pytest.mark.parametrize("mode", sorted(PEERS))
def test_each_mode_equals_its_peer(mode):
    peer = CR.CORRECTIONS[mode]
    for seed in range(4):
        prox, behav, mask = tensors(seed, SPREAD[mode])
        ours = CR.weight(mode, peer.low, peer.high, prox, behav, mask)
        ref = PEERS[mode](prox, behav, mask, peer.low, peer.high)
        on = mask.bool()
        assert torch.allclose(ours[on], ref[on], atol=1e-6, rtol=0), (mode, seed)
        if peer.masks:  # the tensors are spread so that each mode both keeps and masks
            share = float((ours[on] == 0).double().mean())
            assert 0 < share < 1, (mode, seed, share)


def test_peer_default_bounds():
    expect = {"token_clamp": (0.0, 2.0), "token_mask": (0.0, 5.0), "sequence_mask": (0.0, 3.0),
              "geometric_mask": (0.99, 1.01), "icepop": (0.5, 2.0)}
    for mode, (lo, hi) in expect.items():
        assert CR.mode_of(C.LossConfig(correction=mode))[1:] == (lo, hi), mode
    assert CR.mode_of(C.LossConfig(correction="icepop", correction_low=0.2, correction_high=4.0)) == (
        "icepop", 0.2, 4.0)


def test_tis_cap_is_token_clamp_and_not_both():
    assert CR.mode_of(C.LossConfig(tis_cap=1.5)) == ("token_clamp", 0.0, 1.5)
    assert CR.mode_of(C.LossConfig()) == ("none", 0.0, 0.0)
    with pytest.raises(ValueError, match="both set"):
        CR.mode_of(C.LossConfig(tis_cap=2.0, correction="token_mask"))
    with pytest.raises(ValueError, match="below"):
        CR.mode_of(C.LossConfig(correction="icepop", correction_low=3.0))
    with pytest.raises(ValueError, match="unknown correction"):
        CR.mode_of(C.LossConfig(correction="tokenmask"))


def test_config_rules():
    from train import load_config
    from errors import ConfigError
    with pytest.raises(ConfigError, match="loss.correction"):
        load_config(None, ["--rollout.max_staleness=2"])
    with pytest.raises(ConfigError, match="rollout.stale"):
        load_config(None, ["--rollout.max_staleness=2", "--loss.correction=icepop",
                           "--rollout.stale=skip"])
    with pytest.raises(ConfigError, match="rollout.partial needs"):
        load_config(None, ["--rollout.partial=true"])
    cfg = load_config(None, ["--rollout.engine=vllm", "--rollout.max_staleness=4",  # vllm_ahead.py
                             "--loss.correction=token_mask", "--rollout.partial=true",
                             "--rollout.stale=drop"])
    assert (cfg.rollout.engine, cfg.rollout.max_staleness, cfg.rollout.stale) == ("vllm", 4, "drop")
    cfg = load_config(None, ["--rollout.max_staleness=4", "--loss.correction=geometric_mask",
                             "--rollout.partial=true", "--rollout.stale=drop"])
    assert (cfg.rollout.max_staleness, cfg.loss.correction) == (4, "geometric_mask")
    ahead = ["--rollout.max_staleness=2", "--loss.correction=token_mask"]
    with pytest.raises(ConfigError, match=r"rollout.batches_in_flight=2 needs rollout.partial"):
        load_config(None, [*ahead, "--rollout.engine=vllm", "--rollout.batches_in_flight=2"])
    with pytest.raises(ConfigError, match=r"batches_in_flight=4 needs rollout.partial and at most"):
        load_config(None, [*ahead, "--rollout.engine=vllm", "--rollout.partial=keep", "--rollout.batches_in_flight=4"])
    with pytest.raises(ConfigError, match=r"the hf engine generates one at a time"):
        load_config(None, [*ahead, "--rollout.partial=keep", "--rollout.batches_in_flight=3"])
    cfg = load_config(None, [*ahead, "--rollout.engine=vllm", "--rollout.partial=keep", "--rollout.batches_in_flight=3"])
    assert cfg.rollout.batches_in_flight == 3


@pytest.mark.parametrize("overrides, msg", [
    (["--loss.correction=tokenmask"], "loss.correction: unknown 'tokenmask'"),
    (["--loss.tis_cap=5", "--loss.correction=token_mask"], "loss.tis_cap = 5.0 with loss.correction"),
    (["--loss.correction_low=0.5"], "loss.correction_low: a bound of loss.correction, which is \"none\""),
    (["--loss.tis_cap=2", "--loss.correction_high=3"], "loss.correction_high: a bound of loss.correction"),
    (["--loss.correction=icepop", "--loss.correction_low=3"], "correction_low 3.0 must be below"),
    (["--loss.correction=token_clamp", "--loss.correction_high=0"], "loss.correction_high must be > 0"),
])
def test_correction_keys_are_one_config_error_at_load(overrides, msg):
    """Issue 47/48: checked in train.load_config (config + registry), before any process group
    exists (no torch.distributed here), one line naming the key."""
    import torch.distributed as dist
    from errors import ConfigError
    from train import load_config
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(".", r"\.")) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value) and not dist.is_initialized()


def test_correction_on_a_tis_cap_config_fails_at_load_not_at_the_first_update():
    """vl3b.toml sets loss.tis_cap = 5; a correction on top is refused at load (and accepted
    with tis_cap cleared), so it never fails after start-up."""
    from errors import ConfigError
    from train import load_config
    base = "configs/vl3b.toml"
    with pytest.raises(ConfigError, match="loss.tis_cap"):
        load_config(base, ["--loss.correction=token_mask", "--model.path=tiny"])
    cfg = load_config(base, ["--loss.correction=token_mask", "--loss.tis_cap=0", "--model.path=tiny"])
    assert CR.mode_of(cfg.loss) == ("token_mask", 0.0, 5.0)


def test_lower_bounds_are_honoured_and_icepop_takes_a_floor_of_zero():
    prox, behav, mask = tensors(2, 1.2)
    w = torch.exp(prox - behav)
    # token_clamp with a lower clamp: slime's TIS, torch.clamp(tis, min=tis_clip_low,
    # max=tis_clip) (slime/backends/megatron_utils/loss.py:897 at 624b824), here [0.5, 2]
    lc = C.LossConfig(correction="token_clamp", correction_low=0.5)
    assert CR.mode_of(lc) == ("token_clamp", 0.5, 2.0)
    assert torch.allclose(CR.weight(*CR.mode_of(lc), prox, behav, mask)[mask.bool()],
                          w.clamp(0.5, 2.0)[mask.bool()])
    # token_mask with a lower bound masks below it too
    lo = CR.weight("token_mask", 0.5, 5.0, prox, behav, mask)
    assert bool(((w < 0.5) & mask.bool()).any()) and bool((lo[(w < 0.5) & mask.bool()] == 0).all())
    # icepop: 0 is a floor (unset is the peer's 0.5)
    assert CR.mode_of(C.LossConfig(correction="icepop", correction_low=0.0)) == ("icepop", 0.0, 2.0)
    assert CR.mode_of(C.LossConfig(correction="icepop")) == ("icepop", 0.5, 2.0)
    floor0 = CR.weight("icepop", 0.0, 2.0, prox, behav, mask)
    on = mask.bool()
    assert torch.equal(floor0[on], torch.where(w <= 2.0, w, torch.zeros_like(w))[on])


@pytest.mark.parametrize("mode", sorted(PEERS))
def test_masked_tokens_leave_the_numerator_only(mode):
    """The loss with a correction equals the uncorrected per-token loss times the weight,
    summed over the kept tokens and divided by the SAME denominator (all kept tokens)."""
    prox, behav, mask = tensors(1, SPREAD[mode])
    g = torch.Generator().manual_seed(5)
    lp = (prox + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lc = C.LossConfig(correction=mode)
    loss, m = L.policy_loss(lp, prox, adv, mask, lc, behaviour_logprobs=behav)
    plain = C.LossConfig()
    per_token = L.OBJECTIVES["ppo"].fn(lp, prox, adv, mask, L.resolve(plain)[1])[0]
    peer = CR.CORRECTIONS[mode]
    w = PEERS[mode](prox, behav, mask, peer.low, peer.high)
    ref = (per_token * w * mask).sum() / mask.sum()
    assert torch.allclose(loss, ref, atol=1e-10), (mode, float(loss), float(ref))
    masked = float(((w == 0) & mask.bool()).sum() / mask.sum())
    assert m["correction_masked_frac"] == pytest.approx(masked if peer.masks else 0.0)
    assert m["tis_weight_mean"] == pytest.approx(float((w * mask).sum() / mask.sum()))


def test_geometric_mask_running_ahead_is_warned_at_start():
    """SkyRL's +-1% geometric window with engines running ahead: one warning line in the start-up
    notes (train.start); none for k = 0 or another mode."""
    cfg = C.load(None, ["--loss.correction=geometric_mask", "--rollout.max_staleness=1"])
    line = CR.ahead_note(cfg.loss, cfg.rollout.max_staleness)
    assert line.startswith("warning: loss.correction = \"geometric_mask\" (window [0.99, 1.01])")
    assert "rollout.max_staleness = 1" in line and "\n" not in line
    sync = C.load(None, ["--loss.correction=geometric_mask"])
    assert CR.ahead_note(sync.loss, sync.rollout.max_staleness) is None
    other = C.load(None, ["--loss.correction=token_mask", "--rollout.max_staleness=4"])
    assert CR.ahead_note(other.loss, other.rollout.max_staleness) is None
