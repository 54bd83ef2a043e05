"""loss.advantage_norm = "batch" against AReaL's own normalisation, transcribed below from
inclusionAI/AReaL 524d1d90f (the commit of PR #746, the Geometry3K recipe), on the same tensors:
zero-variance groups included, on one trainer rank and on two (gloo, AReaL's all-reduce)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
G = 4


# ------------------------------------------------------------- AReaL 524d1d90f, transcribed
def areal_mean(x, mask, all_reduce):
    """areal/utils/data.py:1267-1321 Normalization._compute_mean (leave_one_out False)."""
    import torch.distributed as dist
    x = x.to(torch.float64)
    dim = tuple(range(len(x.shape)))
    if mask is None:
        factor = torch.tensor(float(x.numel()), dtype=torch.float64)
        x_sum = x.sum(dim=dim, keepdim=True)
    else:
        mask = mask.to(torch.float64)
        factor = mask.sum(dim, keepdim=True)
        x_sum = (x * mask).sum(dim=dim, keepdim=True)
    if dist.is_initialized() and all_reduce:
        dist.all_reduce(factor)
        dist.all_reduce(x_sum)
    if factor.item() == 0:
        return torch.zeros_like(x_sum)
    return x_sum / factor


def areal_std(x, mask, mean, all_reduce):
    """areal/utils/data.py:1324-1363 Normalization._compute_std (unbiased: NormConfig's
    std_unbiased default True, areal/api/cli_args.py NormConfig)."""
    import torch.distributed as dist
    x, mean = x.to(torch.float64), mean.to(torch.float64)
    dim = tuple(range(len(x.shape)))
    if mask is None:
        factor = torch.tensor(float(x.numel()), dtype=torch.float64)
        x_sum_sq = ((x - mean) ** 2).sum(dim=dim, keepdim=True)
    else:
        mask = mask.to(torch.float64)
        factor = mask.sum(dim, keepdim=True)
        x_sum_sq = ((x * mask - mean * mask) ** 2).sum(dim=dim, keepdim=True)
    if dist.is_initialized() and all_reduce:
        dist.all_reduce(factor)
        dist.all_reduce(x_sum_sq)
    if factor.item() <= 1:
        return torch.ones_like(x_sum_sq)
    return (x_sum_sq / (factor - 1)).sqrt()


def areal_normalize(x, mask, level, group_size=1, eps=1e-5):
    """areal/utils/data.py:1164-1264 Normalization.__call__ with mean_level = std_level = level
    (eps: NormConfig's default 1e-5, which the recipe's yaml leaves)."""
    if mask is not None and mask.sum().item() == 0:
        return x.float()
    if level == "batch":
        mean = areal_mean(x, mask, True).expand_as(x)
    else:
        mean = torch.zeros_like(x, dtype=torch.float64)
        for i in range(x.size(0) // group_size):
            s = slice(i * group_size, (i + 1) * group_size)
            mean[s] = areal_mean(x[s], None if mask is None else mask[s], False).expand_as(x[s])
    centered = x - mean
    if mask is not None:
        centered = centered * mask
    if level == "batch":
        std = areal_std(x, mask, mean, True).expand_as(x)
    else:
        std = torch.zeros_like(x, dtype=torch.float64)
        for i in range(x.size(0) // group_size):
            s = slice(i * group_size, (i + 1) * group_size)
            std[s] = areal_std(x[s], None if mask is None else mask[s], mean[s], False).expand_as(x[s])
    return (centered / (std + eps)).float()


def areal_advantages(rewards, loss_mask):
    """areal/engine/ppo/actor.py:168-241 compute_advantages for the recipe's keys
    (examples/vlm_npu/geometry3k_grpo.yaml:58-72: reward_bias -0.5, reward_scaling 10,
    reward_norm group/group, kl_ctl 0, adv_norm batch/batch; discount = gae_lambda = 1 and
    values 0 by default): every response token's advantage is its sequence's normalised reward,
    then the batch normalisation over the loss mask. [bs] rewards, [bs, T] mask -> [bs, T]."""
    score = torch.clip((rewards + -0.5) * 10.0, max=20.0, min=-20.0)   # reward_clip default 20
    score = areal_normalize(score, None, "group", group_size=G)
    adv = score.unsqueeze(1).expand_as(loss_mask) * loss_mask          # GAE, gamma = lambda = 1
    return areal_normalize(adv, loss_mask, "batch")


# ------------------------------------------------------------- the step's tensors
def step_tensors(seed: int, n_groups: int = 6, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 3, (n_groups, G), generator=g).double() / 2            # 0, .5, 1
    r[0] = 1.0   # zero-variance groups: all right, all wrong
    r[3] = 0.0
    r = r.reshape(-1)
    lengths = torch.randint(1, T + 1, (r.numel(),), generator=g)
    lengths[5] = T
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).double()
    return r, lengths, mask


def ours(rewards, lengths):
    """update.advantages on a step of these rewards and response lengths."""
    import config as C
    import update as U
    eps = [SimpleNamespace(response_ids=[0] * int(n), loss_mask=None) for n in lengths]
    s = SimpleNamespace(rewards=rewards, episodes=eps, rc=C.RolloutConfig(group_size=G),
                        lc=C.LossConfig(advantage_norm="batch"))
    U.advantages(s)
    return s.adv


def test_batch_norm_equals_areal_on_one_rank():
    for seed in range(5):
        r, lengths, mask = step_tensors(seed)
        adv = ours(r, lengths)                                                   # [N]
        ref = areal_advantages(r, mask)                                          # [N, T]
        got = adv.unsqueeze(1) * mask.float()
        assert torch.allclose(got, ref, atol=2e-6, rtol=0), (seed, (got - ref).abs().max())
        # a zero-variance group (all right or all wrong alike: group advantage 0) trains with
        # the same constant, non-zero advantage, -mean / std of the batch
        flat = torch.cat([adv[:G], adv[3 * G:4 * G]])
        assert flat.unique().numel() == 1 and float(flat[0]) != 0.0


def test_group_default_stops_at_the_group_step():
    import config as C
    import loss as L
    import update as U
    r, lengths, _ = step_tensors(0)
    eps = [SimpleNamespace(response_ids=[0] * int(n), loss_mask=None) for n in lengths]
    s = SimpleNamespace(rewards=r, episodes=eps, rc=C.RolloutConfig(group_size=G), lc=C.LossConfig())
    U.advantages(s)
    assert torch.equal(s.adv, L.group_advantages(r, G).float())
    assert bool((s.adv[:G] == 0).all())


def test_batch_normalize_edges():
    import loss as L
    a = torch.tensor([1.0, 2.0])
    assert torch.equal(L.batch_normalize(a, torch.tensor([0, 0])), a)           # no tokens
    assert torch.allclose(L.batch_normalize(a, torch.tensor([1, 0])), torch.tensor([0.0, 1.0]), atol=1e-4)
    with pytest.raises(ValueError, match="must both be"):
        L.batch_normalize(a, torch.tensor([1, 2, 3]))


_RANK = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import test_advantage_norm as t
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
rank = dist.get_rank()
for seed in range(3):
    r, lengths, mask = t.step_tensors(seed)
    adv = t.ours(r, lengths)          # every trainer rank: the whole step
    half = slice(rank * len(r) // 2, (rank + 1) * len(r) // 2)   # AReaL: each dp rank its share
    ref = t.areal_advantages(r[half], mask[half])
    got = adv[half].unsqueeze(1) * mask[half].float()
    assert torch.allclose(got, ref, atol=2e-6, rtol=0), (rank, seed, (got - ref).abs().max())
    local = t.areal_normalize(t.areal_normalize(((r[half] - .5) * 10), None, "group", 4).unsqueeze(1)
                              * mask[half], mask[half], "group", 1)   # not all-reduced: differs
    assert not torch.allclose(local, ref, atol=1e-3)
print("rank", rank, "ok", flush=True)
dist.barrier()  # neither rank tears gloo down while the other still talks to it (SIGABRT at exit)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_batch_norm_equals_areal_on_two_ranks():
    """AReaL all-reduces the batch sums over its dp ranks, each holding half the step; every
    trainer rank here holds the whole step: the same numbers on each rank's half."""
    from world import free_port
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(ROOT)], env={**env, "RANK": str(k)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for k, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {k} ok" in out, out[-3000:]
