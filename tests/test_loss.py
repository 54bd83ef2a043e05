"""loss.py against hand-computed numbers, an independent loop implementation, gradcheck, and the
gradient-accumulation identity (micro-batched == full batch), for every objective (PPO's clipped
surrogate, GSPO, CISPO) and advantage estimator (GRPO, RLOO), with the KL and its clamp, TIS, the
dual clip and the entropy bonus; the dual clip, the entropy bonus, the KL in the reward and its
adaptive coefficient against verl's own formulas too.

Elsewhere: update.train_step with these options, tests/test_update.py; two mini-batches x two
epochs learning with the clip binding, the 3-rank run of tests/test_e2e.py
(test_two_mini_batches_two_epochs_clip_binds_and_learns); exact resume with all of it switched on,
tests/test_checkpoint.py (test_exact_resume_after_a_kill_equals_the_uninterrupted_run)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import loss as L
from loss import (aggregate, group_advantages, keep_mask, kl_penalty, local_denominator,
                  loss_denominator, policy_loss, zero_variance_groups)
from tests.util import ADV, MASK, OLD, loss_inputs

LN2 = math.log(2.0)
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
F64 = torch.float64


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


def test_rloo_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 3.0, 1.0, 2.0, 6.0], dtype=F64)
    a = group_advantages(r, 4, estimator="rloo")
    # group 1: 1 - mean(0,0,0) = 1; 0 - mean(1,0,0) = -1/3
    # group 2: all equal -> 0; group 3: 3 - 3 = 0, 1 - 11/3, 2 - 10/3, 6 - 2
    expect = [1, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0, 0, 1 - 11 / 3, 2 - 10 / 3, 4]
    torch.testing.assert_close(a, torch.tensor(expect, dtype=F64), rtol=0, atol=1e-15)
    # = G / (G - 1) * (r - mean): the unscaled GRPO advantage stretched by G / (G - 1)
    torch.testing.assert_close(a, group_advantages(r, 4, scale_by_std=False) * 4 / 3)
    assert torch.equal(a, group_advantages(r, 4, scale_by_std=False, estimator="rloo"))
    # G = 2: each response against the other one
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 0.25], dtype=F64), 2, estimator="rloo"),
                               torch.tensor([0.75, -0.75], dtype=F64))


def test_rloo_refuses_std_scaling_and_unknown_estimators():
    r = torch.zeros(4)
    with pytest.raises(ValueError, match="no std scaling"):
        group_advantages(r, 2, scale_by_std=True, estimator="rloo")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(r, 2, estimator="ppo")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(r, 1, estimator="rloo")
    # grpo keeps its default (std scaling on) whether scale_by_std is None or True
    g = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=F64)
    assert torch.equal(group_advantages(g, 2), group_advantages(g, 2, scale_by_std=True))


# --------------------------------------------------------------------------- hand-computed loss
# The fixture (tests/util.py: RHO, OLD, ADV, MASK, loss_inputs): ratios rho = exp(logp - old),
# chosen so every clip case appears (clip_low 0.2, clip_high 0.28):
#   row 0, A = +2: rho 1.5 (> 1.28: clipped high, loss -1.28*2 = -2.56), 1.1 (-2.2),
#                  0.5 (A > 0, low side not clipped: min(1.0, 1.6) -> -1.0)
#   row 1, A = -1: rho 0.5 (< 0.8: clipped low, min(-0.5, -0.8) -> +0.8),
#                  1.5 (A < 0, high side not clipped: min(-1.5, -1.28) -> +1.5), 10 (masked out)
PG_TOK = [[-2.56, -2.2, -1.0], [0.8, 1.5, 10.0]]
# d loss / d logp per token = -A * rho (unclipped) or 0 (clipped), / denominator
PG_GRAD_NUM = [[0.0, -2.2, -1.0], [0.0, 1.5, 0.0]]


def test_policy_loss_token_mean_hand():
    logp, old, adv, mask = loss_inputs()
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
    logp, old, adv, mask = loss_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-mean")
    # row 0: (-2.56 - 2.2 - 1.0) / 3 = -1.92; row 1: (0.8 + 1.5) / 2 = 1.15; mean = -0.385
    assert loss.item() == pytest.approx(-0.385, abs=1e-12)
    loss.backward()
    g = torch.tensor(PG_GRAD_NUM, dtype=torch.float64) / torch.tensor([[3.0], [2.0]], dtype=torch.float64) / 2
    torch.testing.assert_close(logp.grad, g)


def test_policy_loss_dr_grpo_hand():
    logp, old, adv, mask = loss_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-sum-norm", max_response_len=4)
    # -3.46 / (B=2 * 4)
    assert loss.item() == pytest.approx(-0.4325, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(PG_GRAD_NUM, dtype=torch.float64) / 8)


def test_symmetric_clip_hand():
    logp, old, adv, mask = loss_inputs()
    loss, met = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # only rho=1.5 with A=+2 changes: clipped at 1.2 -> -2.4 instead of -2.56
    assert loss.item() == pytest.approx((-2.4 - 2.2 - 1.0 + 0.8 + 1.5) / 5, abs=1e-12)
    assert met["clip_frac_high"] == pytest.approx(0.2)


def test_tis_hand_and_detached():
    logp, old, adv, mask = loss_inputs()
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


# --------------------------------------------------------------------------- GSPO
S0 = 0.825 ** (1 / 3)           # row 0: exp(mean(ln 1.5, ln 1.1, ln 0.5)) = (1.5 * 1.1 * 0.5)^(1/3)
S1 = math.sqrt(0.75)            # row 1: (0.5 * 1.5)^(1/2); the masked rho = 10 does not enter


def test_gspo_hand_values_gradients_and_clip_fractions():
    logp, old, adv, mask = loss_inputs()
    loss, met = policy_loss(logp, old, adv, mask, objective="gspo")
    # no clip binds (S0 = 0.938 with A > 0, S1 = 0.866 with A < 0 above 0.8):
    # every token of row i carries -S_i A_i: (3 * -2 S0 + 2 * S1) / 5 tokens
    assert loss.item() == pytest.approx((-6 * S0 + 2 * S1) / 5, abs=1e-14)
    loss.backward()
    # d/dlogp_it: row 0: 3 tokens x (-2 S0) x (1/3) / 5; row 1: 2 x S1 x (1/2) / 5; masked: 0
    g = torch.tensor([[-2 * S0 / 5] * 3, [S1 / 5, S1 / 5, 0.0]], dtype=F64)
    torch.testing.assert_close(logp.grad, g, rtol=0, atol=1e-15)
    assert met["clip_frac_low"] == 0 and met["clip_frac_high"] == 0
    assert met["ratio_mean"] == pytest.approx((3 * S0 + 2 * S1) / 5)   # S_i on each token

    # clip_low 0.05 -> the low bound 0.95 binds for row 1 (A < 0, S1 < 0.95): 0.95 per token,
    # no gradient; row 0 (A > 0) is not clipped from below. Counted per TOKEN: 2 of 5.
    logp, old, adv, mask = loss_inputs()
    loss, met = policy_loss(logp, old, adv, mask, objective="gspo", clip_low=0.05, clip_high=0.05,
                            aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx((-2 * S0 + 0.95) / 2, abs=1e-14)
    loss.backward()
    g = torch.tensor([[-2 * S0 / 3 / 2] * 3, [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(logp.grad, g, rtol=0, atol=1e-15)
    assert met["clip_frac_low"] == pytest.approx(2 / 5) and met["clip_frac_high"] == 0

    # high side: flip the advantages (row 0 A < 0 is free, row 1 A > 0 with S1 < 1: free too);
    # scale row 1's ratios up so S1' = sqrt(1.5 * 1.5) = 1.5 > 1.28 -> clipped high, 2 tokens
    logp, old, adv, mask = loss_inputs()
    lp2 = logp.detach().clone()
    lp2[1, 0] = old[1, 0] + math.log(1.5)
    lp2.requires_grad_(True)
    loss, met = policy_loss(lp2, old, -adv, mask, objective="gspo")
    assert loss.item() == pytest.approx((3 * 2 * S0 - 2 * 1.28) / 5, abs=1e-14)
    assert met["clip_frac_high"] == pytest.approx(2 / 5) and met["clip_frac_low"] == 0


def test_gspo_old_gets_the_opposite_gradient_and_padding_never_enters():
    logp, old, adv, mask = loss_inputs()
    old = old.clone().requires_grad_(True)
    policy_loss(logp, old, adv, mask, objective="gspo")[0].backward()
    torch.testing.assert_close(old.grad, -logp.grad)
    # a padded position holding garbage (even inf) changes nothing: the ratio uses masked tokens
    logp2, old2, adv2, mask2 = loss_inputs()
    bad = logp2.detach().clone()
    bad[1, 2] = float("inf")
    a, _ = policy_loss(logp2, old2, adv2, mask2, objective="gspo")
    b, _ = policy_loss(bad, old2, adv2, mask2, objective="gspo")
    assert a.item() == b.item()


# --------------------------------------------------------------------------- CISPO
LOGP = [[-1 + math.log(1.5), -2 + math.log(1.1), -0.5 + math.log(0.5)],
        [-1 + math.log(0.5), -1 + math.log(1.5)]]


def test_cispo_hand_values_gradients_and_clip_fractions():
    logp, old, adv, mask = loss_inputs()
    loss, met = policy_loss(logp, old, adv, mask, objective="cispo")
    # weights sg(clip(rho, 0.8, 1.28)): row 0 [1.28, 1.1, 0.8], row 1 [0.8, 1.28]
    w = [[1.28, 1.1, 0.8], [0.8, 1.28]]
    total = sum(-w[i][t] * ADV[i] * LOGP[i][t] for i in range(2) for t in range(len(w[i])))
    assert loss.item() == pytest.approx(total / 5, abs=1e-14)
    loss.backward()
    # the gradient is -w * A per token (a clipped token keeps a bounded gradient)
    g = torch.tensor([[-1.28 * 2 / 5, -1.1 * 2 / 5, -0.8 * 2 / 5], [0.8 / 5, 1.28 / 5, 0.0]], dtype=F64)
    torch.testing.assert_close(logp.grad, g, rtol=0, atol=1e-15)
    # clipped whatever the sign of A: low rho 0.5 (twice), high rho 1.5 (twice); rho 10 masked
    assert met["clip_frac_low"] == pytest.approx(2 / 5) and met["clip_frac_high"] == pytest.approx(2 / 5)
    assert met["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 0.5 + 1.5) / 5)

    # clip_low >= 1: no lower bound (rho 0.5 keeps weight 0.5); TRL's epsilon_high 5.0 = 4.0 here
    logp, old, adv, mask = loss_inputs()
    loss, met = policy_loss(logp, old, adv, mask, objective="cispo", clip_low=1.0, clip_high=4.0)
    w = [[1.5, 1.1, 0.5], [0.5, 1.5]]
    total = sum(-w[i][t] * ADV[i] * LOGP[i][t] for i in range(2) for t in range(len(w[i])))
    assert loss.item() == pytest.approx(total / 5, abs=1e-14)
    assert met["clip_frac_low"] == 0 and met["clip_frac_high"] == 0


def test_cispo_weight_is_detached_and_ratio_one_gives_ppo_gradient():
    logp, old, adv, mask = loss_inputs()
    old = old.clone().requires_grad_(True)
    policy_loss(logp, old, adv, mask, objective="cispo")[0].backward()
    assert old.grad is None                # old enters only through sg(w): not in the graph
    # one update per batch (old = logp.detach(), rho = 1): PPO's and CISPO's gradients agree
    grads = []
    for obj in ("ppo", "cispo"):
        lp = torch.tensor(OLD, dtype=F64).requires_grad_(True)
        policy_loss(lp, lp.detach(), torch.tensor(ADV, dtype=F64), torch.tensor(MASK, dtype=F64),
                    objective=obj)[0].backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-15)


# --------------------------------------------------------------------------- KL
# ref - logp per token: [[0, ln2, -ln2], [ln2, 0, 5 (masked)]]
D = [[0.0, LN2, -LN2], [LN2, 0.0, 5.0]]


def _ref(logp):
    return logp.detach() + torch.tensor(D, dtype=torch.float64)


def test_kl_estimators_hand():
    logp, _, _, mask = loss_inputs()
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
    logp, old, adv, mask = loss_inputs()
    loss, met = policy_loss(logp, old, adv, mask, kl_coef=0.1, ref_logprobs=_ref(logp))
    assert loss.item() == pytest.approx((-3.46 + 0.1 * (1.5 - LN2)) / 5, abs=1e-12)
    assert met["kl"] == pytest.approx((1.5 - LN2) / 5)
    loss.backward()
    # d k3 / d logp = 1 - exp(d): [[0, -1, 0.5], [-1, 0, masked]]
    dk = torch.tensor([[0.0, -1.0, 0.5], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, (torch.tensor(PG_GRAD_NUM, dtype=torch.float64) + 0.1 * dk) / 5)

    logp, old, adv, mask = loss_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, kl_coef=0.1, ref_logprobs=_ref(logp), kl_estimator="k1",
                          aggregation="seq-mean-token-mean")
    # row 0: (-5.76 + 0.1 * (0 - ln2 + ln2)) / 3; row 1: (2.3 + 0.1 * -ln2) / 2
    assert loss.item() == pytest.approx((-5.76 / 3 + (2.3 - 0.1 * LN2) / 2) / 2, abs=1e-12)
    # kl_coef == 0 with a reference: measured, not added
    logp, old, adv, mask = loss_inputs()
    loss, met = policy_loss(logp, old, adv, mask, ref_logprobs=_ref(logp))
    assert loss.item() == pytest.approx(-0.692, abs=1e-12) and met["kl"] == pytest.approx((1.5 - LN2) / 5)


def test_tis_does_not_weight_kl():
    logp, old, adv, mask = loss_inputs()
    beh = old - torch.tensor([[1.0, 3.0, 0.5], [1.0, 1.0, 7.0]], dtype=torch.float64).log()
    loss, _ = policy_loss(logp, old, adv, mask, tis_cap=2.0, behaviour_logprobs=beh,
                          kl_coef=0.1, ref_logprobs=_ref(logp))
    # TIS-weighted PG sum -5.16 (above) plus the unweighted k3 sum 1.5 - ln2
    assert loss.item() == pytest.approx((-5.16 + 0.1 * (1.5 - LN2)) / 5, abs=1e-12)


def test_kl_clamp_hand_value_and_gradient():
    logp, _, _, mask = loss_inputs()
    ref = _ref(logp)
    # k3 = e^d - d - 1: [0, 1 - ln2 (0.307), ln2 - 0.5 (0.193), 1 - ln2, 0]; clamp 0.25 caps the
    # two 0.307 values, whose gradient (1 - e^d = -1) becomes 0; 0.193 keeps 1 - 1/2 = 0.5
    kl = kl_penalty(logp, ref, "k3", clamp=0.25)
    m = mask.bool()
    torch.testing.assert_close(kl[m], torch.tensor([0.0, 0.25, LN2 - 0.5, 0.25, 0.0], dtype=F64))
    kl[m].sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]], dtype=F64))
    # k1 = logp - ref can be negative: clamped to [-c, c]
    k1 = kl_penalty(logp, ref, "k1", clamp=0.5)
    torch.testing.assert_close(k1[m], torch.tensor([0.0, -0.5, 0.5, -0.5, 0.0], dtype=F64))
    # 0 = off: exactly the unclamped formula
    assert torch.equal(kl_penalty(logp, ref, "k3", clamp=0.0), kl_penalty(logp, ref, "k3"))
    with pytest.raises(ValueError, match="clamp"):
        kl_penalty(logp, ref, "k3", clamp=-1.0)


def test_kl_clamp_bounds_the_k3_gradient_at_a_12_nat_gap():
    # d = ref - logp = 12 nats: the k3 gradient per token is 1 - e^12 = -162,754 unclamped;
    # verl's clamp (10) caps the value at 10 and zeroes the gradient; d = 2 is untouched.
    for d, clamp, value, grad in [(12.0, 0.0, math.exp(12) - 13, 1 - math.exp(12)),
                                  (12.0, 10.0, 10.0, 0.0),
                                  (2.0, 10.0, math.exp(2) - 3, 1 - math.exp(2)),
                                  (-12.0, 10.0, 10.0, 0.0)]:            # k3 = 11 + e^-12 > 10
        lp = torch.zeros(1, 1, dtype=F64, requires_grad=True)
        kl = kl_penalty(lp, torch.full((1, 1), d, dtype=F64), "k3", clamp=clamp)
        kl.sum().backward()
        assert kl.item() == pytest.approx(value, rel=1e-12) and lp.grad.item() == pytest.approx(grad, rel=1e-12)
    # fp32 with a 100-nat gap: exp would overflow to inf (and a clamped inf has a nan gradient);
    # the log-ratio is limited to [-20, 20] first, as verl does, so it stays finite
    lp = torch.zeros(1, 1, requires_grad=True)
    kl = kl_penalty(lp, torch.full((1, 1), 100.0), "k3", clamp=10.0)
    kl.sum().backward()
    assert kl.item() == 10.0 and lp.grad.item() == 0.0


def test_kl_clamp_in_the_loss():
    logp, old, adv, mask = loss_inputs()
    loss, met = policy_loss(logp, old, adv, mask, kl_coef=0.1, ref_logprobs=_ref(logp), kl_clamp=0.25)
    k = 0.25 + (LN2 - 0.5) + 0.25
    assert loss.item() == pytest.approx((-3.46 + 0.1 * k) / 5, abs=1e-12)
    assert met["kl"] == pytest.approx(k / 5)
    with pytest.raises(ValueError, match="kl_clamp"):
        policy_loss(logp, old, adv, mask, kl_clamp=-1.0)
    with pytest.raises(ValueError, match="unknown objective"):
        policy_loss(logp, old, adv, mask, objective="grpo")


# --------------------------------------------------------------------------- denominators, masks
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
    logp, old, adv, mask = loss_inputs()
    # an explicit denominator replaces the local one
    loss, _ = policy_loss(logp, old, adv, mask, loss_denominator=10.0)
    assert loss.item() == pytest.approx(-3.46 / 10, abs=1e-12)
    loss, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-mean", loss_denominator=4.0)
    assert loss.item() == pytest.approx((-1.92 + 1.15) / 4, abs=1e-12)


def test_empty_mask_is_zero_not_nan():
    logp, old, adv, mask = loss_inputs()
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
    logp, old, adv, mask = loss_inputs()
    mask3 = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    pad = lambda x: torch.cat([x, x[:1]])  # noqa: E731
    with_excluded, _ = policy_loss(pad(logp), pad(old), pad(adv), mask3, aggregation=aggregation,
                                   max_response_len=4)
    without, _ = policy_loss(logp, old, adv, mask, aggregation=aggregation, max_response_len=4)
    assert with_excluded.item() == pytest.approx(without.item(), abs=1e-12)
    if aggregation == "seq-mean-token-mean":
        assert without.item() == pytest.approx((-1.92 + 1.15) / 2, abs=1e-12)


def test_bool_and_float_masks_agree():
    logp, old, adv, mask = loss_inputs()
    a, ma = policy_loss(logp, old, adv, mask)
    b, mb = policy_loss(logp, old, adv, mask.bool())
    assert a.item() == b.item() and ma == mb


# --------------------------------------------------------------------------- independent reference
def _loop_loss(lp, old, adv, mask, *, clip_low, clip_high, aggregation, kl_coef, ref,
               max_response_len, tis_cap, beh, objective="ppo", est="k3", kl_clamp=0.0):
    """The issue's formulas written token by token with Python control flow (no shared code):
    each objective, the k1 or k3 KL (clamped to [-kl_clamp, kl_clamp] if set), TIS; masked tokens
    and excluded rows count nowhere."""
    b, t = lp.shape
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    rows = []
    for i in range(b):
        a = adv[i].item()
        toks = [j for j in range(t) if float(mask[i, j]) > 0]
        if objective == "gspo" and toks:
            s = torch.exp(sum(lp[i, j] - old[i, j] for j in toks) / len(toks))
            sv = s.item()
            seq = -(s * a if sv * a <= min(max(sv, lo), hi) * a else min(max(sv, lo), hi) * a)
        row = []
        for j in range(t):
            if float(mask[i, j]) == 0:
                row.append(torch.zeros((), dtype=lp.dtype))
                continue
            rho = torch.exp(lp[i, j] - old[i, j])
            r = rho.item()
            if objective == "ppo":
                c = min(max(r, lo), hi)                                  # a constant when clipped
                term = -(rho * a if r * a <= c * a else torch.tensor(c * a, dtype=lp.dtype))
            elif objective == "gspo":
                term = seq if isinstance(seq, torch.Tensor) else torch.tensor(seq, dtype=lp.dtype)
            else:   # cispo
                term = -min(max(r, lo), hi) * a * lp[i, j]
            if tis_cap is not None:
                term = term * min(math.exp(float(old[i, j]) - float(beh[i, j])), tis_cap)
            if kl_coef > 0:
                if est == "k1":
                    k = lp[i, j] - ref[i, j]
                else:
                    d = ref[i, j] - lp[i, j]
                    k = torch.exp(d) - d - 1
                if kl_clamp and not -kl_clamp <= k.item() <= kl_clamp:
                    k = torch.tensor(math.copysign(kl_clamp, k.item()), dtype=lp.dtype)
                term = term + kl_coef * k
            row.append(term)
        rows.append(row)
    kept = [i for i in range(b) if float(mask[i].sum()) > 0]   # excluded rows count nowhere
    if aggregation == "token-mean":
        return sum(sum(r) for r in rows) / float(mask.sum())
    if aggregation == "seq-mean-token-mean":
        return sum(sum(rows[i]) / float(mask[i].sum()) for i in kept) / len(kept)
    return sum(sum(r) for r in rows) / (len(kept) * max_response_len)


def _random(b=5, t=6, seed=0, spread=0.4, ref_spread=0.3):
    """Seeded float64 (logp, old, adv, mask, ref, beh): ratios exp(logp - old) of log-spread
    `spread` (around both clip edges), every row with a token, the reference `ref_spread` from
    logp, behaviour weights both below and above a cap."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    logp = old + spread * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64)
    mask = (torch.rand(b, t, generator=g) < 0.7).to(F64)
    mask[:, 0] = 1.0                                                # every row has a token
    ref = logp + ref_spread * torch.randn(b, t, generator=g, dtype=F64)
    beh = old + 0.5 * torch.randn(b, t, generator=g, dtype=F64)     # weights both below and above cap
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


OBJS = ("gspo", "cispo", "ppo")
OBJ_COMBOS = list(itertools.product(OBJS, AGGS, [False, True], [None, 1.2]))


@pytest.mark.parametrize("objective, aggregation, kl, tis_cap", OBJ_COMBOS)
def test_each_objective_matches_loop_reference(objective, aggregation, kl, tis_cap):
    # GSPO's sequence ratios sit closer to 1, so clip it tighter to hit both bounds
    clip_low, clip_high = (0.05, 0.06) if objective == "gspo" else (0.2, 0.28)
    logp, old, adv, mask, ref, beh = _random(b=8, seed=1, ref_spread=0.8)
    kw = dict(clip_low=clip_low, clip_high=clip_high, aggregation=aggregation,
              kl_coef=0.05 if kl else 0.0, max_response_len=9, tis_cap=tis_cap)
    a = logp.clone().requires_grad_(True)
    loss, met = policy_loss(a, old, adv, mask, ref_logprobs=ref if kl else None, objective=objective,
                            behaviour_logprobs=beh if tis_cap else None, kl_clamp=0.3 if kl else 0.0,
                            **kw)
    loss.backward()
    b = logp.clone().requires_grad_(True)
    expect = _loop_loss(b, old, adv, mask, objective=objective, ref=ref, beh=beh,
                        kl_clamp=0.3 if kl else 0.0, **kw)
    expect.backward()
    assert loss.item() == pytest.approx(expect.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)
    # both clip bounds really bind somewhere (or this checks less than it claims)
    assert met["clip_frac_low"] > 0 and met["clip_frac_high"] > 0, met
    if kl:   # and the KL clamp too
        d = ref - logp
        assert bool((((d.exp() - d - 1) > 0.3) & (mask > 0)).any())


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


# Not CISPO: its gradient is by design not the derivative of its value (the weight depends on
# logp but is detached); its gradient is checked by hand and against the loop reference.
@pytest.mark.parametrize("objective, aggregation", list(itertools.product(("ppo", "gspo"), AGGS)))
def test_gradcheck_each_objective(objective, aggregation):
    logp, old, adv, mask, ref, beh = _random(b=3, t=4, seed=2, ref_spread=0.8)

    def f(lp):
        return policy_loss(lp, old, adv, mask, aggregation=aggregation, max_response_len=5,
                           kl_coef=0.1, ref_logprobs=ref, tis_cap=1.3, behaviour_logprobs=beh,
                           objective=objective)[0]

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


@pytest.mark.parametrize("objective, aggregation, kl, tis_cap", OBJ_COMBOS)
def test_micro_batches_equal_full_batch_each_objective(objective, aggregation, kl, tis_cap):
    logp, old, adv, mask, ref, beh = _random(b=7, t=6, seed=4, ref_spread=0.8)
    mask[3] = 0.0                                # an excluded response
    kw = dict(aggregation=aggregation, max_response_len=8, kl_coef=0.1 if kl else 0.0,
              tis_cap=tis_cap, objective=objective, kl_clamp=0.5 if kl else 0.0)

    def run(lp, s, denom=None):
        return policy_loss(lp[s], old[s], adv[s], mask[s], ref_logprobs=ref[s] if kl else None,
                           behaviour_logprobs=beh[s] if tis_cap else None, loss_denominator=denom,
                           **kw)[0]

    full_lp = logp.clone().requires_grad_(True)
    full = run(full_lp, slice(None))
    full.backward()
    splits = [slice(0, 1), slice(1, 4), slice(4, 5), slice(5, 7)]
    denom = sum(local_denominator(mask[s], aggregation, 8) for s in splits)
    micro_lp = logp.clone().requires_grad_(True)
    total = 0.0
    for s in splits:
        loss = run(micro_lp, s, denom)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, full.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("objective, aggregation", list(itertools.product(OBJS, AGGS)))
def test_excluded_response_is_as_if_never_sampled_each_objective(objective, aggregation):
    logp, old, adv, mask, _, _ = _random(b=4, t=5, seed=5)
    with_excluded, m1 = policy_loss(logp, old, adv, torch.cat([mask[:3], torch.zeros_like(mask[3:])]),
                                    aggregation=aggregation, max_response_len=6, objective=objective)
    without, m2 = policy_loss(logp[:3], old[:3], adv[:3], mask[:3], aggregation=aggregation,
                              max_response_len=6, objective=objective)
    assert with_excluded.item() == pytest.approx(without.item(), abs=1e-14)
    assert m1 == pytest.approx(m2)


# --------------------------------------------------------------------------- issue 23: [loss] knobs
# verl's formulas, transcribed from verl/trainer/ppo/core_algos.py (verl-project/verl at commit
# 1dda039b9c63, read for this test): compute_policy_loss_vanilla (its tensor part, with the
# dual clip `clip_ratio_c`), agg_loss, AdaptiveKLController.update, and
# verl/trainer/ppo/ray_trainer.py apply_kl_penalty + compute_grpo_outcome_advantage.
def _verl_vanilla(old_log_prob, log_prob, advantages, clip_low, clip_high, clip_ratio_c):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    advantages = advantages.unsqueeze(-1)           # verl's advantages are [B, T] already
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    lower = torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float()
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1), lower


def _verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    def masked_sum(x, m):
        return (x * m).sum()
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        return masked_sum(seq_losses, seq_mask) / seq_mask.sum() / loss_scale_factor
    seq_mask = torch.sum(loss_mask, dim=-1)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).float()
    return masked_sum(seq_losses, seq_mask) / seq_mask.sum()


def _ratios(rho, a):
    old = torch.tensor([[-1.0, -2.0, -0.5]] * len(rho), dtype=F64)
    logp = (old + torch.tensor(rho, dtype=F64).log()).requires_grad_(True)
    return logp, old, torch.tensor(a, dtype=F64), torch.ones(len(rho), 3, dtype=F64)


def test_dual_clip_hand_values_gradient_and_fraction():
    # A = -2: the loss 2 * max(rho, clip(rho)) is capped at 2 * c = 6 (rho 5 -> 10 -> 6, no
    # gradient); rho 2 -> 4 (gradient 2 rho = 4); rho 0.5 -> 2 * 0.8 = 1.6 (clipped, none).
    # A = +1: untouched by the dual clip: -1.28 (clipped), -1 and -0.9 (gradients -1, -0.9).
    logp, old, adv, mask = _ratios([[5.0, 2.0, 0.5], [5.0, 1.0, 0.9]], [-2.0, 1.0])
    loss, met = policy_loss(logp, old, adv, mask, clip_dual=3.0)
    assert loss.item() == pytest.approx((6 + 4 + 1.6 - 1.28 - 1 - 0.9) / 6, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0, 4, 0], [0, -1, -0.9]], dtype=F64) / 6)
    assert met["clip_frac_dual"] == pytest.approx(1 / 6)            # the rho = 5, A < 0 token
    # rho 0.5 under A < 0 is clipped low, rho 5 under A > 0 high: the dual cap is its own flag
    assert met["clip_frac_low"] == pytest.approx(1 / 6) and met["clip_frac_high"] == pytest.approx(1 / 6)
    # off (0): the plain clipped surrogate, 10 instead of 6
    off, met0 = policy_loss(logp.detach(), old, adv, mask)
    assert off.item() == pytest.approx((10 + 4 + 1.6 - 1.28 - 1 - 0.9) / 6, abs=1e-12)
    assert "clip_frac_dual" not in met0                               # off: no such metric
    for bad in (1.0, 0.5, -3.0):
        with pytest.raises(ValueError, match="clip_dual must be > 1"):
            policy_loss(logp, old, adv, mask, clip_dual=bad)


@pytest.mark.parametrize("aggregation", AGGS)
def test_dual_clip_and_entropy_bonus_match_verl(aggregation):
    """verl: policy_loss = agg(where(A < 0, min(-A c, max(-A r, -A clip r)), ...)) - entropy_coeff
    * agg(entropy) + kl_loss_coef * agg(kl), one aggregation for the three; gradients too."""
    logp, old, adv, mask, ref, _ = _random(b=6, t=5, seed=7, spread=1.2, ref_spread=0.8)
    adv = adv * 3
    ent = (torch.rand(6, 5, generator=torch.Generator().manual_seed(8), dtype=F64) * 2)
    a, e1 = logp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    loss, met = policy_loss(a, old, adv, mask, clip_dual=2.5, entropy_coef=0.03, entropy=e1,
                            kl_coef=0.1, ref_logprobs=ref, kl_estimator="k3", kl_clamp=10.0,
                            aggregation=aggregation, max_response_len=5)
    loss.backward()
    b, e2 = logp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    pg, lower = _verl_vanilla(old, b, adv, 0.2, 0.28, 2.5)
    kl = torch.clamp(torch.exp(torch.clamp(ref - b, -20, 20)) - torch.clamp(ref - b, -20, 20) - 1,
                     -10, 10)                                         # verl's low_var_kl
    expect = (_verl_agg_loss(pg, mask, aggregation, 5) - 0.03 * _verl_agg_loss(e2, mask, aggregation, 5)
              + 0.1 * _verl_agg_loss(kl, mask, aggregation, 5))
    expect.backward()
    assert loss.item() == pytest.approx(expect.item(), rel=1e-7)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(e1.grad, e2.grad, rtol=1e-6, atol=1e-9)
    assert met["clip_frac_dual"] == pytest.approx(float((lower * mask).sum() / mask.sum()))
    assert met["clip_frac_dual"] > 0                                 # the cap really binds


def test_entropy_bonus_hand_value_and_gradient():
    logp, old, adv, mask = loss_inputs()                   # 5 kept tokens, token-mean
    ent = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 9.0]], dtype=F64, requires_grad=True)
    base, _ = policy_loss(logp, old, adv, mask)
    loss, _ = policy_loss(logp, old, adv, mask, entropy_coef=0.1, entropy=ent)
    assert loss.item() == pytest.approx(base.item() - 0.1 * 7.0 / 5, abs=1e-14)   # 9.0 is masked
    loss.backward()
    torch.testing.assert_close(ent.grad, -0.1 / 5 * mask)
    with pytest.raises(ValueError, match="needs entropy"):
        policy_loss(logp, old, adv, mask, entropy_coef=0.1)
    with pytest.raises(TypeError, match="entropy_cof"):                # a misspelt knob
        policy_loss(logp, old, adv, mask, entropy_cof=0.1)


def test_adaptive_kl_coefficient_against_verl_and_by_hand():
    class AdaptiveKLController:                        # verl's, verbatim (OpenRLHF's is the same)
        def __init__(self, init_kl_coef, target_kl, horizon):
            self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

        def update(self, current_kl, n_steps):
            proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
            mult = 1 + proportional_error * n_steps / self.horizon
            self.value *= mult

    # by hand: KL twice the target -> error clipped to 0.2 -> x (1 + 0.2 * 16 / 100)
    assert L.adaptive_kl_coef(0.1, 0.1, 0.05, 100, 16) == pytest.approx(0.1 * 1.032, rel=1e-15)
    assert L.adaptive_kl_coef(0.1, 0.04, 0.05, 100, 16) == pytest.approx(0.1 * (1 - 0.2 * 0.16))
    verl, ours = AdaptiveKLController(0.05, 0.02, 1000), 0.05
    for kl in (0.0, 0.01, 0.02, 0.5, 0.021, 0.019, 3.0):
        verl.update(kl, 64)
        ours = L.adaptive_kl_coef(ours, kl, 0.02, 1000, 64)
        assert ours == pytest.approx(float(verl.value), rel=1e-14)
    with pytest.raises(ValueError, match="target > 0"):
        L.adaptive_kl_coef(0.1, 0.1, 0.0, 100, 16)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_kl_in_reward_matches_verl_apply_kl_penalty_then_grpo(scale_by_std):
    """verl: token_level_rewards = token_level_scores - beta * kld * mask (score on the last
    token), GRPO scores = token_level_rewards.sum(-1), grouped; current_kl = mean over responses
    of the masked token mean. Here: r - beta * sequence_kl(...)[0], then group_advantages."""
    g = torch.Generator().manual_seed(3)
    n, t, beta = 8, 6, 0.07
    old = -torch.rand(n, t, generator=g, dtype=F64) * 2
    ref = old + 0.5 * torch.randn(n, t, generator=g, dtype=F64)
    lengths = [6, 3, 5, 1, 6, 2, 4, 6]
    mask = torch.tensor([[1.0] * k + [0.0] * (t - k) for k in lengths], dtype=F64)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5], dtype=F64)
    # verl
    token_scores = torch.zeros(n, t, dtype=F64)
    token_scores[torch.arange(n), torch.tensor(lengths) - 1] = scores
    kld = (old - ref) * mask                                           # kl_penalty "kl" (k1)
    token_rewards = token_scores - beta * kld
    seq = token_rewards.sum(-1).view(-1, 4)
    verl_adv = seq - seq.mean(-1, keepdim=True)
    if scale_by_std:
        verl_adv = verl_adv / (seq.std(-1, keepdim=True) + 1e-6)
    current_kl = ((kld * mask).sum(-1) / (mask.sum(-1) + 1e-8)).mean()
    # here
    kl_sum, count = L.sequence_kl(old, ref, mask, "k1")
    adv = group_advantages(scores - beta * kl_sum, 4, scale_by_std=scale_by_std)
    torch.testing.assert_close(adv, verl_adv.reshape(-1), rtol=1e-12, atol=1e-12)
    assert float((kl_sum / count.clamp(min=1)).mean()) == pytest.approx(float(current_kl), rel=1e-7)


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
    logp, old, adv, mask = loss_inputs()
    with pytest.raises(ValueError, match=msg):
        policy_loss(logp, old, adv, mask, **kw)


def test_shape_errors():
    logp, old, adv, mask = loss_inputs()
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, adv[:1], mask)
    with pytest.raises(ValueError, match="advantages"):  # [B, T] is one per token; [B, T'] is not
        policy_loss(logp, old, adv[:, None].expand(2, logp.shape[1] + 1), mask)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(logp, old, adv, mask[:, :2])
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, old, adv, mask, kl_coef=0.1, ref_logprobs=old[:1])
    with pytest.raises(ValueError, match="tis_cap must be"):
        policy_loss(logp, old, adv, mask, tis_cap=-1.0, behaviour_logprobs=old)  # 0 = off


def test_adaptive_kl_multiplier_is_clipped_so_the_coefficient_stays_positive():
    """Responses per step far above the horizon: the peers' multiplier 1 - 0.2 x 64 / 2 is
    negative; here it is clipped to [0.5, 1.5] (equal to theirs while n <= 2.5 x horizon)."""
    assert L.adaptive_kl_coef(0.1, 0.0, 0.05, 2, 64) == pytest.approx(0.05)   # halved, not < 0
    assert L.adaptive_kl_coef(0.1, 1.0, 0.05, 2, 64) == pytest.approx(0.15)
    assert L.adaptive_kl_coef(0.1, 0.0, 0.05, 100, 250) == pytest.approx(0.1 * (1 - 0.2 * 2.5))
    value = 0.1
    for _ in range(20):
        value = L.adaptive_kl_coef(value, 0.0, 0.05, 1, 512)
        assert value > 0


# ----------------------------------------------------------------------------- on-policy distillation
def _slime_apply_opd_kl_to_advantages(opd_kl_coef, teacher_log_probs, advantages, student_log_probs):
    """slime's rule on the same tensors, written from THUDM/slime
    slime/backends/megatron_utils/loss.py:663-701 (apply_opd_kl_to_advantages, commit 624b824a8):
    per sample, reverse_kl = student_log_probs[i] - teacher_log_probs[i];
    advantages[i] = adv - opd_kl_coef * reverse_kl (slime's per-sample advantages are the GRPO
    return broadcast over the response's tokens)."""
    out = []
    for i, adv in enumerate(advantages):
        reverse_kl = student_log_probs[i] - teacher_log_probs[i]
        out.append(adv - opd_kl_coef * reverse_kl)
    return out


def test_distill_advantages_are_slimes_on_the_same_tensors():
    g = torch.Generator().manual_seed(0)
    B, T, coef = 5, 7, 0.7
    adv = torch.randn(B, generator=g)
    student, teacher = -torch.rand(B, T, generator=g) * 3, -torch.rand(B, T, generator=g) * 3
    ours = L.distill_advantages(adv, student, teacher, coef)                  # [B, T]
    theirs = _slime_apply_opd_kl_to_advantages(coef, list(teacher), [a.expand(T) for a in adv], list(student))
    torch.testing.assert_close(ours, torch.stack(theirs), rtol=0, atol=1e-6)
    assert torch.equal(L.distill_advantages(adv, student, student, coef), adv[:, None].expand(B, T))


@pytest.mark.parametrize("objective", ["ppo", "gspo", "cispo"])
def test_per_token_advantages_equal_to_the_responses_give_its_loss_and_gradient(objective):
    """An objective fed [B, T] advantages that repeat each response's A over its tokens is the
    [B] objective exactly (value and gradient; GSPO's token form included), off-policy ratios too."""
    logp, old, adv, mask = loss_inputs()
    old = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for a in (adv, adv[:, None].expand_as(logp).clone()):
        x = logp.detach().clone().requires_grad_(True)
        loss, m = policy_loss(x, old, a, mask, objective=objective)
        loss.backward()
        grads.append((loss.detach(), x.grad, m))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-6)
    assert grads[0][1] is not None and grads[0][1].abs().sum() > 0
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=1e-6)
    assert grads[0][2] == pytest.approx(grads[1][2])


def test_policy_loss_metrics_stay_on_the_device_without_a_host_sync():
    """Issue 51: the metrics are 0-d tensors, computed without reading anything to the host (no
    `.item()` / `float()` / `nonzero`, counted with torch.profiler), also with every optional
    metric (correction weights, KL) and an all-masked call, whose means are 0.0 as before. The
    denominator given, as the trainer gives it (without one, :func:`local_denominator` counts the
    call's own on the host)."""
    from torch.profiler import ProfilerActivity, profile
    logp, old, adv, mask = loss_inputs()
    for m in (mask, torch.zeros_like(mask)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss, met = policy_loss(logp, old, adv, m, ref_logprobs=old + 0.1, behaviour_logprobs=old,
                                    correction="token_mask", kl_coef=0.1, loss_denominator=5.0)
        syncs = [e.name for e in prof.events() if e.name in ("aten::_local_scalar_dense", "aten::nonzero")]
        assert syncs == []
        assert all(torch.is_tensor(v) and v.dim() == 0 for v in met.values())
        assert {"approx_kl", "ratio_mean", "tis_weight_mean", "correction_masked_frac", "kl",
                "tokens", "clip_frac_low", "clip_frac_high"} <= set(met)
    assert float(met["tokens"]) == 0 and all(float(v) == 0.0 for v in met.values())
