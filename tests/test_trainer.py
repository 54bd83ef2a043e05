"""trainer.py's own pieces as update.train_step uses them, in one process (a world of one
trainer, the tiny model, FSDP2: conftest's tiny_step): the reference that moves (mix_reference,
TRL's sync_ref_model) and its checkpoint, and the learning-rate schedule (lr_factor) the updates
step by. The rest of train_step: tests/test_update.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

import checkpoint as ckpt
from tests.util import full_params, make_trainer, run_step, step_config


def test_the_reference_moves_as_trl_sync_ref_model_and_is_checkpointed(tiny_step):
    cfg = step_config(["--loss.kl_coef=0.05", "--train.ref_update_every=2",
                       "--train.ref_mix_alpha=0.25"])
    tr = make_trainer(tiny_step, cfg, ref_noise=0.05)
    ref0 = full_params(tr.ref)
    run_step(tiny_step, tr, cfg, k=0)                     # (0 + 1) % 2: the reference stays
    assert all(torch.equal(ref0[n], v) for n, v in full_params(tr.ref).items())
    run_step(tiny_step, tr, cfg, k=1)                     # after its updates: the mix
    policy, moved = full_params(tr.policy), full_params(tr.ref)
    for n, r in moved.items():                            # TRL: ref.mul_(1 - a).add_(policy, alpha=a)
        torch.testing.assert_close(r, ref0[n] * 0.75 + policy[n] * 0.25, rtol=0, atol=1e-7)
    assert any(not torch.equal(moved[n], ref0[n]) for n in moved)
    assert all(hasattr(p, "to_local") for p in tr.ref.parameters())   # sharded, as registered

    # the moved reference is in the checkpoint; a fresh trainer's initial one is replaced by it
    meta = {"step": 2, "version": 2, "skipped_in_row": 0, "skipped_total": 0.0, "config": {}}
    kw = dict(meta=meta, rng={}, export=ckpt.Export(tiny_step.procs, tiny_step.path, torch.float32),
              train_group=dist.group.WORLD, is_root=True, keep_last=5)
    state = (tr.policy, tr.opt, tr.sched)
    folder = tiny_step.tmp / "checkpoints"
    ckpt.save(folder / "step_000002", state, ref=tr.ref, **kw)
    ckpt.save(folder / "step_000003", state, **{**kw, "meta": {**meta, "step": 3}})
    for name, want in (("step_000002", moved), ("step_000003", ref0)):   # without: as built
        fresh = make_trainer(tiny_step, cfg, ref_noise=0.05)
        ckpt.load(folder / name, (fresh.policy, fresh.opt, fresh.sched),
                  dist.group.WORLD, True, 0, ref=fresh.ref)
        assert all(torch.equal(want[n], v) for n, v in full_params(fresh.ref).items()), name
        assert all(torch.equal(policy[n], v) for n, v in full_params(fresh.policy).items())


def test_logged_learning_rate_is_the_one_the_updates_used(tiny_step):
    cfg = step_config(["--train.warmup_steps=2", "--train.lr=0.01", "--train.mini_batches=2"])
    tr = make_trainer(tiny_step, cfg)
    used = []
    tr.opt.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    for k in range(3):
        out, _ = run_step(tiny_step, tr, cfg, k=k)
        assert used[-2:] == [out["train/lr"]] * 2, (k, used, out["train/lr"])
    assert used == [0.005, 0.005, 0.01, 0.01, 0.01, 0.01]            # warm-up (k + 1) / 2, then 1
