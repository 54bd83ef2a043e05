"""trainer.train_step with the options of issue 23, in one process (a world of one trainer, the
tiny model, FSDP2): a new objective through the trainer's unchanged call, the entropy bonus, the
KL in the reward, the adaptive coefficient, the moving reference (and its checkpoint), the
diagnostics of a step with an excluded micro-batch, and the learning rate the updates used."""
from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import checkpoint as ckpt
import config as C
import data
import families as F
import inputs as I
import loss as L
import registry
import model as M
import rollout as R
import synthetic
import trainer as T
import update as U
from tests.util import free_port
from train import load_config

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    from torch.distributed.device_mesh import DeviceMesh
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        path = str(F.build_tiny(tmp_path_factory.mktemp("m") / "tiny"))
        procs = I.load_processors(path, 56 * 56, 112 * 112)
        engine = R.HFEngine(path, torch.float32, procs, CPU)
        problems = synthetic.make_synthetic(4, seed=3)
        prompts = [(I.prompt_ids(procs, data.user_text(p), 1), p.images) for p in problems]
        out = engine.generate(prompts, R.Sampling(n=4, max_new_tokens=10), seed=1)
        eps = [R.Episode(p.index, g, prompts[g][0], c.ids, c.logprobs, float(len(c.ids) % 3), {}, 0,
                         c.truncated) for g, (p, cs) in enumerate(zip(problems, out)) for c in cs]
        world = SimpleNamespace(trainers=[0], trainer_index=0, train_group=dist.group.WORLD)
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        yield SimpleNamespace(path=path, procs=procs, eps=eps, images={p.index: p.images for p in problems},
                              world=world, mesh=mesh, tmp=tmp_path_factory.mktemp("ck"))
    finally:
        dist.destroy_process_group()


def cfg_of(over: list[str], lc=None) -> C.Config:
    cfg = load_config(None, ["--rollout.max_new_tokens=10", *over])
    if lc is not None:
        cfg.loss = lc
    return cfg


def trainer(s, cfg: C.Config, ref_noise: float | None = None) -> T.Trainer:
    T.quiet_view_warning()  # as trainer.build does (pytest resets warning filters per test)
    policy = M.apply_fsdp(M.load_model(s.path), s.mesh)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: T.lr_factor(k, cfg.train, cfg.run.steps))
    ref = None
    if ref_noise is not None:  # a reference that differs from the policy, so the KL is not 0
        ref = M.load_model(s.path)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(ref_noise * torch.randn(p.shape, generator=g))
        ref = M.apply_fsdp(ref.eval(), s.mesh)
        ref.requires_grad_(False)
    return T.Trainer(policy, ref, opt, sched, None, CPU)


def step(s, tr, cfg, eps=None, k: int = 0):
    return U.train_step(tr, eps or s.eps, s.images, world=s.world, procs=s.procs, tc=cfg.train,
                        lc=cfg.loss, rc=cfg.rollout, step=k)


def full(module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}


# ----------------------------------------------------------------------------- item 1
def test_a_new_objective_with_its_own_key_runs_through_the_unchanged_trainer(s, monkeypatch):
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
        got[scale], _ = step(s, trainer(s, cfg), cfg)
    assert got[1.0]["loss"] != 0
    assert got[3.0]["loss"] == pytest.approx(3 * got[1.0]["loss"], rel=1e-5)
    assert got[3.0]["grad_norm"] == pytest.approx(3 * got[1.0]["grad_norm"], rel=1e-4)
    assert got[1.0]["train/clipped_never"] == 0.0 and "train/clip_frac_low" not in got[1.0]


def test_entropy_bonus_enters_the_loss_with_its_gradient(s):
    batch = I.collate(s.eps[:4], [s.images[e.index] for e in s.eps[:4]], s.procs, CPU)
    tr = trainer(s, cfg_of([]))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        T.quiet_view_warning()                    # item 6: FSDP2's view warning, silenced
        assert not M.sequence_logprobs(tr.policy, batch, s.procs.tokens, 1.0)[1].requires_grad
    assert not [w for w in seen if "returned a view tensor" in str(w.message)]
    assert M.sequence_logprobs(tr.policy, batch, s.procs.tokens, 1.0, entropy_grad=True)[1].requires_grad
    base_cfg, bonus_cfg = cfg_of([]), cfg_of(["--loss.entropy_coef=0.1"])
    base, _ = step(s, trainer(s, base_cfg), base_cfg)
    bonus, _ = step(s, trainer(s, bonus_cfg), bonus_cfg)
    # token-mean over every response token (nothing excluded): loss - 0.1 * mean entropy
    assert bonus["entropy"] == pytest.approx(base["entropy"], rel=1e-6) and base["entropy"] > 0
    assert bonus["loss"] == pytest.approx(base["loss"] - 0.1 * base["entropy"], rel=1e-5, abs=1e-6)
    assert bonus["grad_norm"] != pytest.approx(base["grad_norm"], rel=1e-4)   # it has a gradient


# ----------------------------------------------------------------------------- item 2
def _reference_kl_by_hand(s, tr):
    """Every episode's summed k1 KL (policy - reference) from one plain batch of all of them."""
    batch = I.collate(s.eps, [s.images[e.index] for e in s.eps], s.procs, CPU, share_prompt=False)
    with torch.no_grad():
        lp, _ = M.sequence_logprobs(tr.policy, batch, s.procs.tokens, 1.0)
        ref, _ = M.sequence_logprobs(tr.ref, batch, s.procs.tokens, 1.0)
    return ((lp - ref) * batch["response_mask"]).sum(-1).double(), batch["response_mask"].sum(-1)


def test_kl_in_reward_and_the_adaptive_coefficient(s):
    cfg = cfg_of(["--loss.kl_coef=0.05", "--loss.kl_in_reward=true", "--loss.kl_estimator=k1",
                  "--loss.kl_target=0.001", "--loss.kl_horizon=100"])
    tr = trainer(s, cfg, ref_noise=0.05)
    kl_sum, count = _reference_kl_by_hand(s, tr)
    assert kl_sum.abs().max() > 1e-3
    out, adv = step(s, tr, cfg)
    rewards = torch.tensor([e.reward for e in s.eps], dtype=torch.float64)
    want = L.group_advantages(rewards - 0.05 * kl_sum, 4)             # verl: r - beta * sum_t kl_t
    torch.testing.assert_close(torch.tensor(adv, dtype=torch.float64), want, rtol=1e-4, atol=1e-4)
    assert out["train/reward_kl"] == pytest.approx(float((0.05 * kl_sum).mean()), rel=1e-4)
    current = float((kl_sum / count).mean())
    assert out["train/kl_seq_mean"] == pytest.approx(current, rel=1e-4)
    # the coefficient used, then moved by the controller (KL above the target: error 0.2)
    assert out["train/kl_coef"] == 0.05
    assert tr.kl_coef == pytest.approx(L.adaptive_kl_coef(0.05, current, 0.001, 100, 16), rel=1e-9)
    assert tr.kl_coef == pytest.approx(0.05 * (1 + 0.2 * 16 / 100))
    out2, _ = step(s, tr, cfg, k=1)
    assert out2["train/kl_coef"] == pytest.approx(0.05 * 1.032)
    # KL in the reward means no KL term in the loss: the same loss as with no KL at all when
    # the advantages are equal (here: a zero coefficient in the reward)
    plain = cfg_of(["--loss.kl_coef=0.05", "--loss.kl_estimator=k1"])
    in_loss, _ = step(s, trainer(s, plain, ref_noise=0.05), plain)
    assert in_loss["kl"] == pytest.approx(out["kl"], rel=1e-4)        # the same KL, measured
    assert "train/reward_kl" not in in_loss and in_loss["train/kl_coef"] == 0.05


def test_the_reference_moves_as_trl_sync_ref_model_and_is_checkpointed(s):
    cfg = cfg_of(["--loss.kl_coef=0.05", "--train.ref_update_every=2", "--train.ref_mix_alpha=0.25"])
    tr = trainer(s, cfg, ref_noise=0.05)
    ref0 = full(tr.ref)
    step(s, tr, cfg, k=0)                                 # (0 + 1) % 2: the reference stays
    assert all(torch.equal(ref0[n], v) for n, v in full(tr.ref).items())
    step(s, tr, cfg, k=1)                                 # after its updates: the mix
    policy, moved = full(tr.policy), full(tr.ref)
    for n, r in moved.items():                            # TRL: ref.mul_(1 - a).add_(policy, alpha=a)
        torch.testing.assert_close(r, ref0[n] * 0.75 + policy[n] * 0.25, rtol=0, atol=1e-7)
    assert any(not torch.equal(moved[n], ref0[n]) for n in moved)
    assert all(hasattr(p, "to_local") for p in tr.ref.parameters())   # sharded, as registered

    # the moved reference is in the checkpoint; a fresh trainer's initial one is replaced by it
    meta = {"step": 2, "version": 2, "skipped_in_row": 0, "skipped_total": 0.0, "config": {}}
    kw = dict(meta=meta, rng={}, export=ckpt.Export(s.procs, s.path, torch.float32),
              train_group=dist.group.WORLD, is_root=True, keep_last=5)
    state = (tr.policy, tr.opt, tr.sched)
    ckpt.save(s.tmp / "checkpoints" / "step_000002", state, ref=tr.ref, **kw)
    ckpt.save(s.tmp / "checkpoints" / "step_000003", state, **{**kw, "meta": {**meta, "step": 3}})
    for name, want in (("step_000002", moved), ("step_000003", ref0)):   # without: as built
        fresh = trainer(s, cfg, ref_noise=0.05)
        ckpt.load(s.tmp / "checkpoints" / name, (fresh.policy, fresh.opt, fresh.sched),
                  dist.group.WORLD, True, 0, ref=fresh.ref)
        assert all(torch.equal(want[n], v) for n, v in full(fresh.ref).items()), name
        assert all(torch.equal(policy[n], v) for n, v in full(fresh.policy).items())


# ----------------------------------------------------------------------------- item 4
def test_diagnostics_with_an_excluded_micro_batch_weigh_kept_tokens(s):
    # group 0's rewards all equal: DAPO's dynamic sampling drops it, and with micro-batches of
    # one group each, that micro-batch is excluded whole. On-policy, every kept ratio is 1.
    eps = [dataclasses.replace(e, reward=1.0 if e.group == 0 else float(i % 2))
           for i, e in enumerate(s.eps)]
    cfg = cfg_of(["--loss.drop_zero_variance=true", "--train.micro_batch_size=4"])
    out, adv = step(s, trainer(s, cfg), cfg, eps)
    assert out["train/dropped_groups"] == 1 and out["train/micro_batches"] == 4
    assert out["train/ratio_mean"] == 1.0 and out["train/tis_weight_mean"] == 1.0
    assert out["train/clip_frac_low"] == 0 == out["train/clip_frac_high"]
    assert adv[:4] == [0.0] * 4


def test_logged_learning_rate_is_the_one_the_updates_used(s):
    cfg = cfg_of(["--train.warmup_steps=2", "--train.lr=0.01", "--train.mini_batches=2"])
    tr = trainer(s, cfg)
    used = []
    tr.opt.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    for k in range(3):
        out, _ = step(s, tr, cfg, k=k)
        assert used[-2:] == [out["train/lr"]] * 2, (k, used, out["train/lr"])
    assert used == [0.005, 0.005, 0.01, 0.01, 0.01, 0.01]            # warm-up (k + 1) / 2, then 1
