"""microbatches.py: the plan (token budget, counts), and the accumulated gradient over any plan
== the full-batch gradient (update.accumulate_gradients)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import data
import families as F
import inputs as I
import loss as L
import microbatches as MB
import model as M
import sharding
import hf_engine as HF
import episode as E
import synthetic
import trainer as T
import update as U
from train import load_config
from tests.util import layout_of


def test_plan_budget_order_and_counts():
    lengths = [50, 10, 40, 10, 30, 20, 60, 10]
    plan = MB.plan_micro_batches(lengths, max_seqs=99, max_tokens=80)
    assert sorted(i for mb in plan for i in mb) == list(range(8))          # each index once
    for mb in plan:
        assert len(mb) * max(lengths[i] for i in mb) <= 80 or len(mb) == 1
    assert MB.plan_micro_batches(lengths, max_seqs=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    eq = MB.split_to(MB.plan_micro_batches(lengths, max_seqs=99, max_tokens=10_000), 3, 8)
    assert len(eq) == 3 and sorted(i for mb in eq for i in mb) == list(range(8))
    with pytest.raises(ValueError):
        MB.split_to(MB.plan_micro_batches([5, 5], max_seqs=1), 3, 2)


def test_padding_is_reduced_by_length_grouping():
    lengths = [10, 200, 12, 190, 11, 210, 9, 205]
    def pad(plan):
        return sum(len(mb) * max(lengths[i] for i in mb) for mb in plan) - sum(lengths)
    assert pad(MB.plan_micro_batches(lengths, 99, max_tokens=420)) < \
        pad(MB.plan_micro_batches(lengths, 2)) / 4


def test_accumulated_gradient_equals_full_batch(tmp_path, gloo_world):
    path = str(F.build_tiny(tmp_path / "tiny"))
    procs = I.load_processors(path, 56 * 56, 112 * 112)
    engine = HF.HFEngine(path, torch.float32, procs, torch.device("cpu"))
    problems = synthetic.make_synthetic(4, seed=3)
    prompts = [(I.prompt_ids(procs, data.user_text(p) * (1 + i % 2), 1), p.images)
               for i, p in enumerate(problems)]
    out = engine.generate(prompts, E.Sampling(n=4, max_new_tokens=12), seed=1)
    eps = [E.Episode(p.index, g, prompts[g][0], c.ids, c.logprobs, float(sum(c.ids) % 5), {}, 0,
                     c.truncated) for g, (p, cs) in enumerate(zip(problems, out)) for c in cs]
    images = {p.index: p.images for p in problems}
    policy = M.load_model(path)
    sharding.apply_fsdp(policy, DeviceMesh.from_group(gloo_world, "cpu"))
    tr = T.Trainer(policy, None, None, None, None, torch.device("cpu"), M.RowLayout())
    adv = L.group_advantages(torch.tensor([e.reward for e in eps]), 4)
    keep = torch.ones(len(eps), dtype=torch.bool)
    denom = sum(len(e.response_ids) for e in eps)

    world = SimpleNamespace(trainers=[0], trainer_index=0, train_group=gloo_world)

    def grads(over: list[str]):
        cfg = load_config(None, over + ["--loss.kl_coef=0", "--rollout.max_new_tokens=12"])
        policy.zero_grad(set_to_none=True)
        idx = list(range(len(eps)))
        tr.layout = layout_of(cfg.train, procs)
        step = U.Step(tr, world, procs, cfg.train, cfg.loss, cfg.rollout, 0, 0, eps, images,
                      keep=keep, adv=adv, kl_coef=0.0)
        plan = MB.agree_plans([idx], eps, images, procs, cfg.train, tr.layout, gloo_world)[0]
        stats = U.accumulate_gradients(step, U.Update(idx, plan, denom))
        return [p.grad.full_tensor().clone() for p in policy.parameters()], stats

    flat = "--train.share_prompt=false"
    full, s_full = grads(["--train.micro_batch_size=16", flat])
    budget, s_budget = grads(["--train.micro_batch_tokens=600", flat])
    small, _ = grads(["--train.micro_batch_size=3", flat])
    assert s_full["micro_batches"] == 1 and s_budget["micro_batches"] > 2
    assert s_budget["slots"] < s_full["slots"]                 # less padding
    # packed rows (one per prompt, its 4 responses after it): the same gradient, and in
    # every layout: whole groups, groups split by small micro-batches, a token budget
    packed, s_packed = grads(["--train.micro_batch_size=16"])
    p_small, _ = grads(["--train.micro_batch_size=3"])
    p_budget, s_pbudget = grads(["--train.micro_batch_tokens=900"])
    assert s_packed["micro_batches"] == 1 and s_pbudget["micro_batches"] >= 2
    assert s_packed["slots"] < s_full["slots"] / 2             # the prompts encoded once per group
    assert s_packed["episode_tokens"] == s_full["episode_tokens"] == s_full["tokens"]
    for a, *others in zip(full, budget, small, packed, p_small, p_budget):
        for b in others:
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert any(a.abs().sum() > 0 for a in full)
