"""update.py in one process (a world of one trainer, the tiny model, FSDP2: conftest's tiny_step):
train_step with several updates per rollout batch (mini-batches x PPO epochs) and its proximal
pass, the mini-batch order, and the options of issue 23: a new objective through the trainer's
unchanged call, the entropy bonus, the KL in the reward with the adaptive coefficient, and the
diagnostics of a step with an excluded micro-batch. The trainer's own pieces under train_step (the
moving reference, the learning rate): tests/test_trainer.py."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import families as F
import inputs as I
import loss as L
import microbatches as MB
import model as M
import sharding
import registry
import trainer as T
import update as U
from tests.util import layout_of, make_trainer, run_step, step_config
from train import load_config

CPU = torch.device("cpu")


# --------------------------------------------------------------------------- mini-batch order
def test_update_order_is_seeded_by_seed_step_epoch_only():
    a = [U.update_order(8, 0, 5, e) for e in range(4)]
    assert all(sorted(o) == list(range(8)) for o in a)
    assert a == [U.update_order(8, 0, 5, e) for e in range(4)]        # every rank, a resumed run
    assert len({tuple(o) for o in a}) > 1                             # reshuffled per epoch
    assert len({tuple(U.update_order(8, 0, s, 0)) for s in range(5)}) > 1     # and per step
    assert len({tuple(U.update_order(8, s, 5, 0)) for s in range(5)}) > 1     # and per run seed
    assert U.update_order(1, 3, 7, 2) == [0]


# --------------------------------------------------------------------------- several updates
def test_train_step_several_updates_in_one_process(tiny_step):
    """A world of one trainer: the proximal pass equals the training forward bit for bit (so the
    first update's ratio is exactly 1), M = E = 1 keeps ratio 1 and no clipping, and M = 2,
    E = 2 makes four optimizer steps whose later ratios move and get clipped."""
    path, procs, eps, images = tiny_step.path, tiny_step.procs, tiny_step.eps, tiny_step.images
    tokens = procs.tokens

    def run(over):
        cfg = load_config(None, ["--loss.kl_coef=0", "--rollout.max_new_tokens=10", *over])
        policy = M.load_model(path)
        sharding.apply_fsdp(policy, tiny_step.mesh)
        opt = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        tr = T.Trainer(policy, None, opt, sched, None, CPU, layout_of(cfg.train, procs))
        return tr, cfg, U.train_step(tr, eps, images, world=tiny_step.world, procs=procs,
                                     tc=cfg.train, lc=cfg.loss, rc=cfg.rollout, step=0)[0]

    tr, cfg, one = run([])
    assert one["train/updates"] == 1 and one["train/ratio_mean"] == 1.0
    assert one["train/clip_frac_low"] == 0 == one["train/clip_frac_high"]

    # no-grad proximal pass == the training forward, bit for bit
    idx = list(range(8))
    plan = MB.agree_plans([idx], eps, images, procs, cfg.train, tr.layout, tiny_step.world.train_group)[0]
    prox = U.proximal_logprobs(tr, eps, idx, plan, images, procs=procs, temperature=1.0)
    for (old, _, _, _), mb in zip(prox, plan):
        batch = I.collate([eps[idx[j]] for j in mb], [images[eps[idx[j]].index] for j in mb],
                          procs, CPU, tr.layout)
        lp, _ = M.sequence_logprobs(tr.policy, batch, tokens, 1.0)
        assert torch.equal(lp.detach(), old)

    _, _, four = run(["--train.mini_batches=2", "--train.ppo_epochs=2", "--train.lr=0.05",
                      "--train.micro_batch_size=3"])
    assert four["train/updates"] == 4 and four["train/skipped"] == 0
    assert four["train/approx_kl"] > 0 and four["train/ratio_mean"] != 1.0
    assert four["train/clip_frac_low"] + four["train/clip_frac_high"] > 0, four
    assert four["train/micro_batches"] == 4 * 3          # 8 episodes per mini-batch, 3 a pass


# --------------------------------------------------------------------------- issue 23, item 1
def test_a_new_objective_with_its_own_key_runs_through_the_unchanged_trainer(tiny_step,
                                                                               monkeypatch):
    monkeypatch.setattr(registry, "OBJECTIVES", dict(registry.OBJECTIVES))
    monkeypatch.setattr(L, "OBJECTIVES", registry.OBJECTIVES)

    @registry.objective("scaled_reinforce", keys={"pg_scale": registry.Key(1.0, "> 0")})
    def scaled_reinforce(logprobs, old_logprobs, advantages, mask, p):   # the one function
        ratio = torch.exp(logprobs - old_logprobs)
        return L.Term(-p.pg_scale * ratio * advantages.unsqueeze(-1), ratio,
                      {"clipped_never": torch.zeros_like(ratio)})

    got = {}
    for scale in (1.0, 3.0):
        cfg = load_config(None, ["--rollout.max_new_tokens=10", "--loss.objective=scaled_reinforce",
                                 f"--loss.pg_scale={scale}"])
        got[scale], _ = run_step(tiny_step, make_trainer(tiny_step, cfg), cfg)
    assert got[1.0]["loss"] != 0
    assert got[3.0]["loss"] == pytest.approx(3 * got[1.0]["loss"], rel=1e-5)
    assert got[3.0]["grad_norm"] == pytest.approx(3 * got[1.0]["grad_norm"], rel=1e-4)
    assert got[1.0]["train/clipped_never"] == 0.0 and "train/clip_frac_low" not in got[1.0]


def test_entropy_bonus_enters_the_loss_with_its_gradient(tiny_step):
    eps, tokens = tiny_step.eps[:4], tiny_step.procs.tokens
    batch = I.collate(eps, [tiny_step.images[e.index] for e in eps], tiny_step.procs, CPU)
    tr = make_trainer(tiny_step, step_config([]))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        T.quiet_view_warning()                    # item 6: FSDP2's view warning, silenced
        assert not M.sequence_logprobs(tr.policy, batch, tokens, 1.0)[1].requires_grad
    assert not [w for w in seen if "returned a view tensor" in str(w.message)]
    assert M.sequence_logprobs(tr.policy, batch, tokens, 1.0, entropy_grad=True)[1].requires_grad
    base_cfg, bonus_cfg = step_config([]), step_config(["--loss.entropy_coef=0.1"])
    base, _ = run_step(tiny_step, make_trainer(tiny_step, base_cfg), base_cfg)
    bonus, _ = run_step(tiny_step, make_trainer(tiny_step, bonus_cfg), bonus_cfg)
    # token-mean over every response token (nothing excluded): loss - 0.1 * mean entropy
    assert bonus["entropy"] == pytest.approx(base["entropy"], rel=1e-6) and base["entropy"] > 0
    assert bonus["loss"] == pytest.approx(base["loss"] - 0.1 * base["entropy"], rel=1e-5, abs=1e-6)
    assert bonus["grad_norm"] != pytest.approx(base["grad_norm"], rel=1e-4)   # it has a gradient


# --------------------------------------------------------------------------- item 2
def _reference_kl_by_hand(s, tr):
    """Every episode's summed k1 KL (policy - reference) from one plain batch of all of them."""
    batch = I.collate(s.eps, [s.images[e.index] for e in s.eps], s.procs, CPU)
    with torch.no_grad():
        lp, _ = M.sequence_logprobs(tr.policy, batch, s.procs.tokens, 1.0)
        ref, _ = M.sequence_logprobs(tr.ref, batch, s.procs.tokens, 1.0)
    return ((lp - ref) * batch.response_mask).sum(-1).double(), batch.response_mask.sum(-1)


def test_kl_in_reward_and_the_adaptive_coefficient(tiny_step):
    cfg = step_config(["--loss.kl_coef=0.05", "--loss.kl_in_reward=true", "--loss.kl_estimator=k1",
                       "--loss.kl_target=0.001", "--loss.kl_horizon=100"])
    tr = make_trainer(tiny_step, cfg, ref_noise=0.05)
    kl_sum, count = _reference_kl_by_hand(tiny_step, tr)
    assert kl_sum.abs().max() > 1e-3
    out, adv = run_step(tiny_step, tr, cfg)
    rewards = torch.tensor([e.reward for e in tiny_step.eps], dtype=torch.float64)
    want = L.group_advantages(rewards - 0.05 * kl_sum, 4)             # verl: r - beta * sum_t kl_t
    torch.testing.assert_close(torch.tensor(adv, dtype=torch.float64), want, rtol=1e-4, atol=1e-4)
    assert out["train/reward_kl"] == pytest.approx(float((0.05 * kl_sum).mean()), rel=1e-4)
    current = float((kl_sum / count).mean())
    assert out["train/kl_seq_mean"] == pytest.approx(current, rel=1e-4)
    # the coefficient used, then moved by the controller (KL above the target: error 0.2)
    assert out["train/kl_coef"] == 0.05
    assert tr.kl_coef == pytest.approx(L.adaptive_kl_coef(0.05, current, 0.001, 100, 16), rel=1e-9)
    assert tr.kl_coef == pytest.approx(0.05 * (1 + 0.2 * 16 / 100))
    out2, _ = run_step(tiny_step, tr, cfg, k=1)
    assert out2["train/kl_coef"] == pytest.approx(0.05 * 1.032)
    # KL in the reward means no KL term in the loss: the same loss as with no KL at all when
    # the advantages are equal (here: a zero coefficient in the reward)
    plain = step_config(["--loss.kl_coef=0.05", "--loss.kl_estimator=k1"])
    in_loss, _ = run_step(tiny_step, make_trainer(tiny_step, plain, ref_noise=0.05), plain)
    assert in_loss["kl"] == pytest.approx(out["kl"], rel=1e-4)        # the same KL, measured
    assert "train/reward_kl" not in in_loss and in_loss["train/kl_coef"] == 0.05


def test_a_horizon_small_enough_to_turn_the_peers_multiplier_negative_keeps_the_coefficient_positive(tiny_step):
    """Issue 35 item 3, through the update path: 16 responses per step over a horizon of 1 with
    the KL far below its target: verl's and OpenRLHF's multiplier 1 - 0.2 x 16 / 1 = -2.2 would
    make the coefficient negative (a KL in the loss then stops the run); clipped, it halves each
    step and the updates go on with it."""
    cfg = step_config(["--loss.kl_coef=0.05", "--loss.kl_target=10", "--loss.kl_horizon=1"])
    assert 1 - 0.2 * len(tiny_step.eps) / cfg.loss.kl_horizon < 0                  # the peers'
    tr = make_trainer(tiny_step, cfg, ref_noise=0.05)
    for k in range(3):
        out, _ = run_step(tiny_step, tr, cfg, k=k)
        assert out["train/kl_seq_mean"] < cfg.loss.kl_target
        assert out["train/kl_coef"] == pytest.approx(0.05 * 0.5 ** k) and out["train/kl_coef"] >= 0
        assert out["kl"] > 0                           # the KL term ran in the loss, coefficient and all
    assert tr.kl_coef == pytest.approx(0.05 * 0.5 ** 3) and tr.kl_coef >= 0


# --------------------------------------------------------------------------- item 4
def test_diagnostics_with_an_excluded_micro_batch_weigh_kept_tokens(tiny_step):
    # group 0's rewards all equal: DAPO's dynamic sampling drops it, and with micro-batches of
    # one group each, that micro-batch is excluded whole. On-policy, every kept ratio is 1.
    eps = [dataclasses.replace(e, reward=1.0 if e.group == 0 else float(i % 2))
           for i, e in enumerate(tiny_step.eps)]
    cfg = step_config(["--loss.drop_zero_variance=true", "--train.micro_batch_size=4"])
    out, adv = run_step(tiny_step, make_trainer(tiny_step, cfg), cfg, eps)
    assert out["train/dropped_groups"] == 1 and out["train/micro_batches"] == 4
    assert out["train/ratio_mean"] == 1.0 and out["train/tis_weight_mean"] == 1.0
    assert out["train/clip_frac_low"] == 0 == out["train/clip_frac_high"]
    assert adv[:4] == [0.0] * 4


def test_logged_entropy_is_the_mean_over_the_kept_tokens(tiny_step):
    """Responses left out of the update (here: cut at max_new_tokens, loss.exclude_truncated)
    leave the logged entropy too, as they leave the bonus and every other diagnostic."""
    eps = tiny_step.eps
    assert 0 < sum(e.truncated for e in eps) < len(eps)
    cfg = step_config(["--loss.exclude_truncated=true"])
    tr = make_trainer(tiny_step, cfg)
    batch = I.collate(eps, [tiny_step.images[e.index] for e in eps], tiny_step.procs, CPU)
    with torch.no_grad():
        _, ent = M.sequence_logprobs(tr.policy, batch, tiny_step.procs.tokens, 1.0)
    kept = batch.response_mask.bool() & torch.tensor([not e.truncated for e in eps]).unsqueeze(1)
    every = float(ent[batch.response_mask.bool()].mean())
    out, _ = run_step(tiny_step, tr, cfg)
    assert out["entropy"] == pytest.approx(float(ent[kept].mean()), rel=1e-5)
    assert out["entropy"] != pytest.approx(every, rel=1e-5)


def test_stale_tokens_leave_lpdiff_unmeasured_and_oversized_sequences_are_counted(tiny_step):
    """Every token sampled with older weights: `logprob_diff/max` absent (nothing measured, not
    0.0) and `logprob_diff/tokens` the int 0; sequences longer than train.micro_batch_tokens
    counted in `train/oversized_sequences` (each still trained, alone)."""
    s = tiny_step
    lengths = sorted(I.sequence_tokens(s.procs, [e], s.images[e.index]) for e in s.eps)
    budget = lengths[len(lengths) // 2]
    cfg = step_config([f"--train.micro_batch_tokens={budget}", "--loss.kl_coef=0"])
    tr = make_trainer(s, cfg)
    m, _ = run_step(s, tr, cfg)
    assert m["logprob_diff/tokens"] > 0 and "logprob_diff/max" in m
    rows: dict = {}  # train.share_prompt (the default): a sequence is a prompt's row
    for e in s.eps:
        rows.setdefault(e.group, []).append(e)
    shared = [I.sequence_tokens(s.procs, g, s.images[g[0].index]) for g in rows.values()]
    assert m["train/oversized_sequences"] == sum(n > budget for n in shared) > 0
    tr.version = 1  # the episodes' tokens are version 0: every one stale
    m, _ = run_step(s, tr, cfg, k=1)
    assert "logprob_diff/max" not in m
    assert m["logprob_diff/tokens"] == 0 and isinstance(m["logprob_diff/tokens"], int)
    cfg = step_config([f"--train.micro_batch_tokens={budget}", "--loss.kl_coef=0",
                       "--train.share_prompt=false"])                 # one row per episode
    m, _ = run_step(s, make_trainer(s, cfg), cfg)
    per_episode = sum(n > budget for n in lengths)
    assert m["train/oversized_sequences"] == per_episode != sum(n > budget for n in shared)


# --------------------------------------------------------------------------- host syncs (issue 51)
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")  # .item() / float() / bool(); nonzero


def _own_syncs(prof) -> list[str]:
    """The host syncs (SYNC_OPS) outside model.HOST_SCOPE whose nearest Python frame is in one of
    the project's modules (not transformers' or torch's), as 'file(line): function'."""
    from pathlib import Path
    own = {p.name for p in Path(U.__file__).parent.glob("*.py")}
    out = []
    for e in prof.events():
        if e.name not in SYNC_OPS:
            continue
        p, frame, host = e.cpu_parent, None, False
        while p is not None:
            host |= p.name == M.HOST_SCOPE
            if frame is None and ".py(" in p.name and not p.name.startswith("<"):
                frame = p.name
            p = p.cpu_parent
        file = (frame or "").split("(")[0]
        if not host and file and Path(file).name in own and "site-packages" not in file:
            out.append(frame)
    return out


@pytest.mark.parametrize("over", [["--train.packing=true"], ["--train.share_prompt=false"]])
def test_a_micro_batch_makes_no_host_sync_in_the_trainers_code(tiny_step, over):
    """Issue 51: forward + backward of an update's micro-batches makes no host sync in the
    trainer's own code (policy_loss's metrics and update's sums stay on the device; the packed
    positions and the logprobs' places come from the record as collated, on the host), and the
    step's metrics are read to the host once, after the last micro-batch (update.READ_SCOPE).
    Packed rows ("segments") and one row per episode. (The whole forward, transformers'
    included: the test after this one.)"""
    from torch.profiler import ProfilerActivity, profile
    s = tiny_step
    total = sum(I.sequence_tokens(s.procs, [e], s.images[e.index]) for e in s.eps)
    cfg = step_config(over + [f"--train.micro_batch_tokens={total // 8}", "--loss.kl_coef=0"])
    tr = make_trainer(s, cfg)
    tr.policy.set_attn_implementation(M.attention_for(tr.layout.packed))
    step, u = _planned(s, tr, cfg)
    assert len(u.plan) >= 2 and (tr.layout.packed is not None) == ("--train.packing=true" in over)
    u = U.Update(u.idx, u.plan[:2], u.denom)  # two micro-batches: the profiler's stacks are slow
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        sums = U.accumulate_gradients(step, u)
    assert _own_syncs(prof) == []
    assert sum(e.name == U.READ_SCOPE for e in prof.events()) == 1
    assert sums["micro_batches"] == len(u.plan) and sums["kept_tokens"] == sums["resp_tokens"] > 0


@pytest.mark.parametrize("checkpointing", ["full", "off"])
def test_a_one_image_micro_batch_makes_one_host_sync_in_its_whole_forward_and_backward(tiny_step, checkpointing):
    """Issue 51's acceptance (at most 2 host syncs per micro-batch with one image), for the
    whole forward + backward, transformers' included, as trainer.build runs the policy (one
    attention call per vision block, FSDP2, checkpointing on and off), packed rows: no host
    sync outside model.HOST_SCOPE (the image features placed by the trainer, families.
    places_images; the vision tower's grid tensors and the positions from the host) and the
    step's one read of its metrics (update.READ_SCOPE): 1, as bench/step.py counts them."""
    from torch.profiler import ProfilerActivity, profile

    s = tiny_step
    total = sum(I.sequence_tokens(s.procs, [e], s.images[e.index]) for e in s.eps)
    cfg = step_config(["--train.packing=true", "--loss.kl_coef=0", f"--train.micro_batch_tokens={total // 8}"])
    model = T.fewer_launches(M.load_model(s.path))
    if not F.places_images(model):  # e.g. transformers 5.5.4 (the NPU stack): its own image path
        pytest.skip("this transformers' vision tower computes its grid tensors itself: the trainer "
                    "keeps the model's own forward and its host syncs (families.places_images)")
    policy = sharding.apply_fsdp(model.train(), s.mesh, checkpointing=checkpointing)
    tr = make_trainer(s, cfg)
    tr.policy = policy  # as trainer.build wraps it (make_trainer's: plain FSDP2)
    tr.policy.set_attn_implementation(M.attention_for(tr.layout.packed))
    step, u = _planned(s, tr, cfg)
    one = next(mb for mb in u.plan if len({s.eps[u.idx[j]].group for j in mb}) == 1)  # one image
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        U.accumulate_gradients(step, U.Update(u.idx, [one], u.denom))
    syncs = [e for e in prof.events() if e.name in SYNC_OPS
             and not any(p.name == M.HOST_SCOPE for p in _parents(e))]
    reads = sum(e.name == U.READ_SCOPE for e in prof.events())
    assert [e.name for e in syncs] == [] and reads == 1
    assert len(syncs) + reads <= 2                                    # issue 51's acceptance


def _planned(s, tr, cfg):
    """The step's record up to its updates (plan, denominators, advantages) and its first update."""
    step = U.Step(tr, s.world, s.procs, cfg.train, cfg.loss, cfg.rollout, 0, 0, s.eps, s.images)
    U.plan(step)
    U.denominators(step)
    U.advantages(step)
    return step, step.updates[0]


def _parents(event):
    p = event.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent
