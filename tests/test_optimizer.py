"""The optimizer's kernels (device.adamw_options): fused AdamW where the device has the kernel
(CUDA, NPU), foreach on the CPU; what fused changes on the CPU, measured; fused on FSDP2's
sharded parameters."""
from __future__ import annotations

import torch

import device as D

SHAPES = [(300, 64), (64,), (128, 64), (7,)]


def _steps(params, steps: int = 5, **kernels) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01, **kernels)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        opt.step()
    return [p.detach().clone() for p in params]


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
            for i, s in enumerate(SHAPES)]


def test_the_choice_per_device():
    assert D.adamw_options("cuda") == {"fused": True} and D.adamw_options("npu") == {"fused": True}
    assert D.adamw_options("cpu") == {"foreach": True}


def test_on_the_cpu_foreach_is_bitwise_the_per_tensor_loop_and_fused_within_an_ulp():
    """Why the CPU keeps foreach: it is bitwise the plain loop (CPU runs repeat earlier ones
    exactly); fused (which torch also has on the CPU) differs by about one ulp per step:
    measured 1.5e-8 absolute, 1.9e-7 relative after 5 steps (docs/benchmarks.md)."""
    foreach, loop = _steps(_params(), foreach=True), _steps(_params(), foreach=False)
    fused = _steps(_params(), fused=True)
    assert all(torch.equal(a, b) for a, b in zip(foreach, loop))
    assert any(not torch.equal(a, b) for a, b in zip(foreach, fused))
    rel = max(float(((a - b).abs() / b.abs().clamp(min=1e-12)).max()) for a, b in zip(fused, foreach))
    assert rel < 1e-6


def test_fused_steps_fsdp2_sharded_parameters(gloo_world):
    """FSDP2's parameters are DTensors: fused AdamW steps them to what it gives plain tensors."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(2)))
    plain = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    fully_shard(model, mesh=DeviceMesh.from_group(gloo_world, "cpu"))
    sharded = list(model.parameters())
    assert all(hasattr(p, "full_tensor") for p in sharded)
    opt = torch.optim.AdamW(sharded, lr=1e-3, **D.adamw_options("cuda"))
    ref = torch.optim.AdamW(plain, lr=1e-3, fused=True)
    for step in range(3):
        for i, (p, q) in enumerate(zip(sharded, plain)):
            g = torch.randn(q.shape, generator=torch.Generator().manual_seed(10 * step + i))
            q.grad = g
            p.grad = torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
        ref.step()
    for p, q in zip(sharded, plain):
        assert torch.equal(p.full_tensor(), q.detach())
