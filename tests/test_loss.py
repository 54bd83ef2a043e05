"""loss.py against hand-computed numbers, an independent loop implementation, gradcheck, and the
gradient-accumulation identity (micro-batched == full batch)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from loss import (aggregate, group_advantages, keep_mask, kl_penalty, local_denominator,
                  loss_denominator, policy_loss, zero_variance_groups)

LN2 = math.log(2.0)
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# --------------------------------------------------------------------------- advantages
def test_group_advantages_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    # group 1: mean 0.25; unbiased std = sqrt((0.75^2 + 3 * 0.25^2) / 3) = sqrt(0.25) = 0.5
    # group 2: all equal -> r - mean = 0 -> A = 0 (std 0, eps keeps it finite)
    a = group_advantages(r, 4)
    s = 0.5 + 1e-6
    expect = torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(a, expect, rtol=0, atol=1e-15)
    # Dr. GRPO: no std scaling
    a = group_advantages(r, 4, scale_by_std=False)
    torch.testing.assert_close(a, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], dtype=torch.float64))
    # eps is the one passed in
    a = group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2, eps=0.5)
    # mean 0.5, unbiased std = sqrt(2 * 0.25 / 1) = sqrt(0.5)
    torch.testing.assert_close(a, torch.tensor([0.5, -0.5], dtype=torch.float64) / (math.sqrt(0.5) + 0.5))


def test_group_advantages_invariants():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(6 * 5, generator=g, dtype=torch.float64)
    a = group_advantages(r, 5, eps=0.0).view(6, 5)
    torch.testing.assert_close(a.mean(1), torch.zeros(6, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(a.std(1), torch.ones(6, dtype=torch.float64))
    # groups are consecutive: shuffling inside a group permutes its advantages the same way
    perm = torch.tensor([4, 2, 0, 1, 3])
    r2 = r.view(6, 5)[:, perm].reshape(-1)
    torch.testing.assert_close(group_advantages(r2, 5, eps=0.0).view(6, 5), a[:, perm])


@pytest.mark.parametrize("rewards, g, msg", [
    (torch.zeros(7), 2, "do not split"),
    (torch.zeros(4), 1, "group_size must be >= 2"),
    (torch.zeros(2, 2), 2, "1-D"),
])
def test_group_advantages_errors(rewards, g, msg):
    with pytest.raises(ValueError, match=msg):
        group_advantages(rewards, g)


def test_zero_variance_and_keep_mask():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.3, 0.3, 0.3])
    torch.testing.assert_close(zero_variance_groups(r, 3), torch.tensor([True, False, True]))
    torch.testing.assert_close(keep_mask(r, 3, drop_zero_variance=True),
                               torch.tensor([False] * 3 + [True] * 3 + [False] * 3))
    assert bool(keep_mask(r, 3).all())                       # nothing dropped unless asked
    r = torch.tensor([1.0, 1.0 + 1e-9, 0.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(zero_variance_groups(r, 2), torch.tensor([False, False]))
    torch.testing.assert_close(zero_variance_groups(r, 2, atol=1e-8), torch.tensor([True, False]))
    with pytest.raises(ValueError):
        zero_variance_groups(torch.zeros(5), 2)


def test_keep_mask_truncated():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    trunc = torch.tensor([False, True, False, False])
    torch.testing.assert_close(keep_mask(r, 2, trunc, exclude_truncated=True),
                               torch.tensor([True, False, True, True]))
    # both rules: group 2 (all 1.0) dropped, response 1 truncated
    torch.testing.assert_close(keep_mask(r, 2, trunc, drop_zero_variance=True, exclude_truncated=True),
                               torch.tensor([True, False, False, False]))
    with pytest.raises(ValueError, match="truncated"):
        keep_mask(r, 2, exclude_truncated=True)


# --------------------------------------------------------------------------- hand-computed loss
# Ratios rho = exp(logp - old), chosen so every clip case appears (clip_low 0.2, clip_high 0.28):
#   row 0, A = +2: rho 1.5 (> 1.28: clipped high, loss -1.28*2 = -2.56), 1.1 (-2.2),
#                  0.5 (A > 0, low side not clipped: min(1.0, 1.6) -> -1.0)
#   row 1, A = -1: rho 0.5 (< 0.8: clipped low, min(-0.5, -0.8) -> +0.8),
#                  1.5 (A < 0, high side not clipped: min(-1.5, -1.28) -> +1.5), 10 (masked out)
RHO = [[1.5, 1.1, 0.5], [0.5, 1.5, 10.0]]
OLD = [[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]]
ADV = [2.0, -1.0]
MASK = [[1, 1, 1], [1, 1, 0]]
PG_TOK = [[-2.56, -2.2, -1.0], [0.8, 1.5, 10.0]]
# d loss / d logp per token = -A * rho (unclipped) or 0 (clipped), / denominator
PG_GRAD_NUM = [[0.0, -2.2, -1.0], [0.0, 1.5, 0.0]]


def _inputs(**kw):
    d = torch.float64
    old = torch.tensor(OLD, dtype=d)
    logp = (old + torch.tensor(RHO, dtype=d).log()).requires_grad_(True)
    return logp, old, torch.tensor(ADV, dtype=d), torch.tensor(MASK, dtype=d)


def test_policy_loss_token_mean_hand():
    logp, old, adv, mask = _inputs()
    loss, met = policy_loss(logp, old, adv, mask)
    # (-2.56 - 2.2 - 1.0 + 0.8 + 1.5) / 5 tokens = -3.46 / 5
    assert loss.item() == pytest.approx(-0.692, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(PG_GRAD_NUM, dtype=torch.float64) / 5)
    assert met["clip_frac_low"] == pytest.approx(0.2) and met["clip_frac_high"] == pytest.approx(0.2)
    assert met["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 0.5 + 1.5) / 5)  # rho=10 masked out
    # approx_kl: KL(old || new) by k3 on samples from old = mean(rho - 1 - ln rho)
    rhos = [1.5, 1.1, 0.5, 0.5, 1.5]
    assert met["approx_kl"] == pytest.approx(sum(x - 1 - math.log(x) for x in rhos) / 5)
    assert met["tis_weight_mean"] == 1.0 and met["kl"] == 0.0 and met["tokens"] == 5.0


def test_policy_loss_seq_mean_token_mean_hand():
    logp, old, adv, mask = _inputs()
    loss, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-mean")
    # row 0: (-2.56 - 2.2 - 1.0) / 3 = -1.92; row 1: (0.8 + 1.5) / 2 = 1.15; mean = -0.385
    assert loss.item() == pytest.approx(-0.385, abs=1e-12)
    loss.backward()
    g = torch.tensor(PG_GRAD_NUM, dtype=torch.float64) / torch.tensor([[3.0], [2.0]], dtype=torch.float64) / 2
    torch.testing.assert_close(logp.grad, g)


def test_policy_loss_dr_grpo_hand():
    logp, old, adv, mask = _inputs()
    loss, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-sum-norm", max_response_len=4)
    # -3.46 / (B=2 * 4)
    assert loss.item() == pytest.approx(-0.4325, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(PG_GRAD_NUM, dtype=torch.float64) / 8)


def test_symmetric_clip_hand():
    logp, old, adv, mask = _inputs()
    loss, met = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # only rho=1.5 with A=+2 changes: clipped at 1.2 -> -2.4 instead of -2.56
    assert loss.item() == pytest.approx((-2.4 - 2.2 - 1.0 + 0.8 + 1.5) / 5, abs=1e-12)
    assert met["clip_frac_high"] == pytest.approx(0.2)


def test_tis_hand_and_detached():
    logp, old, adv, mask = _inputs()
    old.requires_grad_(True)
    # raw weights exp(old - behaviour) = [[1, 3, 0.5], [1, 1, 7]], cap 2 -> [[1, 2, 0.5], [1, 1, 2]]
    beh = old.detach() - torch.tensor([[1.0, 3.0, 0.5], [1.0, 1.0, 7.0]], dtype=torch.float64).log()
    loss, met = policy_loss(logp, old, adv, mask, tis_cap=2.0, behaviour_logprobs=beh)
    # (-2.56*1 - 2.2*2 - 1.0*0.5 + 0.8*1 + 1.5*1) / 5 = -5.16 / 5
    assert loss.item() == pytest.approx(-1.032, abs=1e-12)
    assert met["tis_weight_mean"] == pytest.approx((1 + 2 + 0.5 + 1 + 1) / 5)
    loss.backward()
    w = torch.tensor([[1.0, 2.0, 0.5], [1.0, 1.0, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, torch.tensor(PG_GRAD_NUM, dtype=torch.float64) * w / 5)
    # the weight is detached: old enters only through rho = exp(logp - old), so d/d old = -d/d logp
    torch.testing.assert_close(old.grad, -logp.grad)


# ref - logp per token: [[0, ln2, -ln2], [ln2, 0, 5 (masked)]]
D = [[0.0, LN2, -LN2], [LN2, 0.0, 5.0]]


def _ref(logp):
    return logp.detach() + torch.tensor(D, dtype=torch.float64)


def test_kl_estimators_hand():
    logp, _, _, mask = _inputs()
    ref = _ref(logp)
    m = mask.bool()
    # k3 = exp(d) - d - 1 with d = ref - logp: [0, 1 - ln2, ln2 - 0.5, 1 - ln2, 0]
    assert kl_penalty(logp, ref, "k3")[m].sum().item() == pytest.approx(1.5 - LN2)
    # k1 = logp - ref = -d
    assert kl_penalty(logp, ref, "k1")[m].sum().item() == pytest.approx(-LN2)
    # k2 = d^2 / 2
    assert kl_penalty(logp, ref, "k2")[m].sum().item() == pytest.approx(1.5 * LN2 ** 2)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "k4")


def test_kl_in_loss_hand():
    logp, old, adv, mask = _inputs()
    loss, met = policy_loss(logp, old, adv, mask, kl_coef=0.1, ref_logprobs=_ref(logp))
    assert loss.item() == pytest.approx((-3.46 + 0.1 * (1.5 - LN2)) / 5, abs=1e-12)
    assert met["kl"] == pytest.approx((1.5 - LN2) / 5)
    loss.backward()
    # d k3 / d logp = 1 - exp(d): [[0, -1, 0.5], [-1, 0, masked]]
    dk = torch.tensor([[0.0, -1.0, 0.5], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, (torch.tensor(PG_GRAD_NUM, dtype=torch.float64) + 0.1 * dk) / 5)

    logp, old, adv, mask = _inputs()
    loss, _ = policy_loss(logp, old, adv, mask, kl_coef=0.1, ref_logprobs=_ref(logp), kl_estimator="k1",
                          aggregation="seq-mean-token-mean")
    # row 0: (-5.76 + 0.1 * (0 - ln2 + ln2)) / 3; row 1: (2.3 + 0.1 * -ln2) / 2
    assert loss.item() == pytest.approx((-5.76 / 3 + (2.3 - 0.1 * LN2) / 2) / 2, abs=1e-12)
    # kl_coef == 0 with a reference: measured, not added
    logp, old, adv, mask = _inputs()
    loss, met = policy_loss(logp, old, adv, mask, ref_logprobs=_ref(logp))
    assert loss.item() == pytest.approx(-0.692, abs=1e-12) and met["kl"] == pytest.approx((1.5 - LN2) / 5)


def test_tis_does_not_weight_kl():
    logp, old, adv, mask = _inputs()
    beh = old - torch.tensor([[1.0, 3.0, 0.5], [1.0, 1.0, 7.0]], dtype=torch.float64).log()
    loss, _ = policy_loss(logp, old, adv, mask, tis_cap=2.0, behaviour_logprobs=beh,
                          kl_coef=0.1, ref_logprobs=_ref(logp))
    # TIS-weighted PG sum -5.16 (above) plus the unweighted k3 sum 1.5 - ln2
    assert loss.item() == pytest.approx((-5.16 + 0.1 * (1.5 - LN2)) / 5, abs=1e-12)


def test_denominators_hand():
    mask = torch.tensor(MASK)
    assert local_denominator(mask, "token-mean") == 5.0
    assert local_denominator(mask, "seq-mean-token-mean") == 2.0
    assert local_denominator(mask, "seq-mean-token-sum-norm", 4) == 8.0
    # the step's denominator from lengths and keep flags; excluded responses count nowhere
    lengths, keep = [3, 2, 7, 1], [True, True, False, True]
    assert loss_denominator(lengths, keep, "token-mean") == 6.0
    assert loss_denominator(lengths, keep, "seq-mean-token-mean") == 3.0
    assert loss_denominator(lengths, keep, "seq-mean-token-sum-norm", 8) == 24.0
    # ... and it is the sum of the micro-batches' local shares once excluded rows are masked
    m = torch.zeros(4, 8)
    for i, (n, k) in enumerate(zip(lengths, keep)):
        m[i, :n] = float(k)
    for agg in AGGS:
        assert loss_denominator(lengths, keep, agg, 8) == \
            local_denominator(m[:1], agg, 8) + local_denominator(m[1:], agg, 8)
    logp, old, adv, mask = _inputs()
    # an explicit denominator replaces the local one
    loss, _ = policy_loss(logp, old, adv, mask, loss_denominator=10.0)
    assert loss.item() == pytest.approx(-3.46 / 10, abs=1e-12)
    loss, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-mean", loss_denominator=4.0)
    assert loss.item() == pytest.approx((-1.92 + 1.15) / 4, abs=1e-12)


def test_empty_mask_is_zero_not_nan():
    logp, old, adv, mask = _inputs()
    for agg in AGGS:
        logp.grad = None
        loss, met = policy_loss(logp, old, adv, torch.zeros_like(mask), aggregation=agg, max_response_len=4,
                                kl_coef=0.1, ref_logprobs=_ref(logp))
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))
        assert met["tokens"] == 0.0 and all(math.isfinite(v) for v in met.values())
        # a global denominator of 0 (every response of the step excluded) is also 0, not nan
        assert aggregate(logp, torch.zeros_like(mask), agg, 0.0, 4).item() == 0.0


@pytest.mark.parametrize("aggregation", AGGS)
def test_excluded_response_is_as_if_never_sampled(aggregation):
    # The one convention: a fully masked (excluded) response adds 0 and counts in no
    # denominator, under every aggregation (unlike TRL, which keeps it in B).
    logp, old, adv, mask = _inputs()
    mask3 = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    pad = lambda x: torch.cat([x, x[:1]])  # noqa: E731
    with_excluded, _ = policy_loss(pad(logp), pad(old), pad(adv), mask3, aggregation=aggregation,
                                   max_response_len=4)
    without, _ = policy_loss(logp, old, adv, mask, aggregation=aggregation, max_response_len=4)
    assert with_excluded.item() == pytest.approx(without.item(), abs=1e-12)
    if aggregation == "seq-mean-token-mean":
        assert without.item() == pytest.approx((-1.92 + 1.15) / 2, abs=1e-12)


def test_bool_and_float_masks_agree():
    logp, old, adv, mask = _inputs()
    a, ma = policy_loss(logp, old, adv, mask)
    b, mb = policy_loss(logp, old, adv, mask.bool())
    assert a.item() == b.item() and ma == mb


# --------------------------------------------------------------------------- independent reference
def _loop_loss(lp, old, adv, mask, *, clip_low, clip_high, aggregation, kl_coef, ref, est,
               max_response_len, tis_cap, beh):
    """The issue's formulas written token by token with Python control flow (no shared code)."""
    b, t = lp.shape
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    rows = []
    for i in range(b):
        row = []
        for j in range(t):
            rho = torch.exp(lp[i, j] - old[i, j])
            r, a = rho.item(), adv[i].item()
            c = rho if lo <= r <= hi else torch.tensor(lo if r < lo else hi, dtype=lp.dtype)  # constant
            l = -(rho * a if r * a <= c.item() * a else c * a)
            if tis_cap is not None:
                l = l * min(math.exp(float(old[i, j]) - float(beh[i, j])), tis_cap)
            if kl_coef > 0:
                if est == "k1":
                    l = l + kl_coef * (lp[i, j] - ref[i, j])
                else:
                    d = ref[i, j] - lp[i, j]
                    l = l + kl_coef * (torch.exp(d) - d - 1)
            row.append(l * float(mask[i, j]))
        rows.append(row)
    kept = [i for i in range(b) if float(mask[i].sum()) > 0]   # excluded rows count nowhere
    if aggregation == "token-mean":
        return sum(sum(r) for r in rows) / float(mask.sum())
    if aggregation == "seq-mean-token-mean":
        return sum(sum(rows[i]) / float(mask[i].sum()) for i in kept) / len(kept)
    return sum(sum(r) for r in rows) / (len(kept) * max_response_len)


def _random(b=5, t=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = torch.float64
    old = -torch.rand(b, t, generator=g, dtype=d) * 3
    logp = old + 0.4 * torch.randn(b, t, generator=g, dtype=d)     # ratios around both clip edges
    adv = torch.randn(b, generator=g, dtype=d)
    mask = (torch.rand(b, t, generator=g) < 0.7).to(d)
    mask[:, 0] = 1.0                                                # every row has a token
    ref = logp + 0.3 * torch.randn(b, t, generator=g, dtype=d)
    beh = old + 0.5 * torch.randn(b, t, generator=g, dtype=d)       # weights both below and above cap
    return logp, old, adv, mask, ref, beh


COMBOS = list(itertools.product(AGGS, [None, "k1", "k3"], [None, 1.2]))


@pytest.mark.parametrize("aggregation, est, tis_cap", COMBOS)
def test_matches_loop_reference(aggregation, est, tis_cap):
    logp, old, adv, mask, ref, beh = _random(seed=1)
    kw = dict(clip_low=0.2, clip_high=0.28, aggregation=aggregation, kl_coef=0.05 if est else 0.0,
              max_response_len=9, tis_cap=tis_cap)
    a = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(a, old, adv, mask, ref_logprobs=ref if est else None, kl_estimator=est or "k3",
                          behaviour_logprobs=beh if tis_cap else None, **kw)
    loss.backward()
    b = logp.clone().requires_grad_(True)
    expect = _loop_loss(b, old, adv, mask, ref=ref, est=est, beh=beh, **kw)
    expect.backward()
    assert loss.item() == pytest.approx(expect.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)
    # some tokens must actually be clipped on each side, or this test checks less than it claims
    ratio = (logp - old).exp()
    assert bool(((ratio > 1.28) & (adv[:, None] > 0) & (mask > 0)).any())
    assert bool(((ratio < 0.8) & (adv[:, None] < 0) & (mask > 0)).any())


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("aggregation, est, tis_cap", COMBOS)
def test_gradcheck(aggregation, est, tis_cap):
    logp, old, adv, mask, ref, beh = _random(b=3, t=4, seed=2)

    def f(lp):
        return policy_loss(lp, old, adv, mask, aggregation=aggregation, max_response_len=5,
                           kl_coef=0.1 if est else 0.0, ref_logprobs=ref if est else None,
                           kl_estimator=est or "k3", tis_cap=tis_cap,
                           behaviour_logprobs=beh if tis_cap else None)[0]

    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(True),))


def test_zero_gradient_where_clipped():
    logp, old, adv, mask, _, _ = _random(b=6, t=8, seed=3)
    lp = logp.clone().requires_grad_(True)
    policy_loss(lp, old, adv, mask)[0].backward()
    rho = (logp - old).exp()
    a = adv[:, None].expand_as(rho)
    clipped = ((a > 0) & (rho > 1.28)) | ((a < 0) & (rho < 0.8))
    assert clipped.any() and (~clipped & (mask > 0)).any()
    assert torch.all(lp.grad[clipped] == 0)
    # elsewhere: d/dlogp of -rho*A / N = -A * rho / N
    free = ~clipped & (mask > 0)
    torch.testing.assert_close(lp.grad[free], (-a * rho / mask.sum())[free])
    assert torch.all(lp.grad[mask == 0] == 0)


# --------------------------------------------------------------------------- accumulation identity
@pytest.mark.parametrize("aggregation, est, tis_cap", COMBOS)
def test_micro_batches_equal_full_batch(aggregation, est, tis_cap):
    logp, old, adv, mask, ref, beh = _random(b=7, t=6, seed=4)
    mask[3] = 0.0                                # an excluded (truncated) response
    kw = dict(aggregation=aggregation, max_response_len=8, kl_coef=0.1 if est else 0.0,
              kl_estimator=est or "k3", tis_cap=tis_cap)

    def run(lp, s, denom=None):
        return policy_loss(lp[s], old[s], adv[s], mask[s], ref_logprobs=ref[s] if est else None,
                           behaviour_logprobs=beh[s] if tis_cap else None, loss_denominator=denom, **kw)[0]

    full_lp = logp.clone().requires_grad_(True)
    full = run(full_lp, slice(None))
    full.backward()

    # unequal micro-batches (think: 2 ranks x 2 micro-batches), each with the global denominator
    splits = [slice(0, 1), slice(1, 4), slice(4, 5), slice(5, 7)]
    denom = sum(local_denominator(mask[s], aggregation, 8) for s in splits)
    assert denom == local_denominator(mask, aggregation, 8)
    micro_lp = logp.clone().requires_grad_(True)
    total = 0.0
    for s in splits:
        loss = run(micro_lp, s, denom)
        loss.backward()                          # gradients accumulate in micro_lp.grad
        total = total + loss.detach()
    torch.testing.assert_close(total, full.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, rtol=0, atol=1e-12)

    # and the bug this guards against: local denominators give a different loss
    naive = sum(run(logp, s).item() for s in splits) / len(splits)
    assert abs(naive - full.item()) > 1e-6


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kw, msg", [
    (dict(aggregation="sum"), "unknown aggregation"),
    (dict(kl_estimator="k4"), "unknown kl_estimator"),
    (dict(kl_coef=0.1), "needs ref_logprobs"),
    (dict(kl_coef=-0.1), "kl_coef must be"),
    (dict(aggregation="seq-mean-token-sum-norm"), "max_response_len"),
    (dict(tis_cap=2.0), "needs behaviour_logprobs"),
    (dict(loss_denominator=-1.0), "denominator"),
    (dict(clip_low=-0.1), "clip_low"),
])
def test_argument_errors(kw, msg):
    logp, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match=msg):
        policy_loss(logp, old, adv, mask, **kw)


def test_shape_errors():
    logp, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, adv[:, None].expand(2, 3), mask)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(logp, old, adv, mask[:, :2])
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, old, adv, mask, kl_coef=0.1, ref_logprobs=old[:1])
    with pytest.raises(ValueError, match="tis_cap must be"):
        policy_loss(logp, old, adv, mask, tis_cap=-1.0, behaviour_logprobs=old)  # 0 = off
