"""Bucket plan, pack/unpack round trip, and the Sender/Receiver pair over a real gloo group."""
from __future__ import annotations

import torch

import sync as S


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(7, 5, generator=g)), ("b.bias", torch.randn(3, generator=g)),
            ("c", torch.randn(2, 3, 4, generator=g)), ("big", torch.randn(1000, generator=g)),
            ("s", torch.randn((), generator=g))]


def test_plan_respects_bucket_size_order_and_alignment():
    specs = [(n, tuple(t.shape), "float32") for n, t in _tensors()]
    plan = S.plan_buckets(specs, bucket_bytes=256)
    flat = [s for b in plan for s in b]
    assert [s.name for s in flat] == [n for n, _, _ in specs]       # order kept
    for b in plan:
        assert all(s.offset % S.ALIGN == 0 for s in b)
        assert S.bucket_size(b) <= 256 or len(b) == 1               # oversized tensor alone
    assert [s.name for s in plan[-2]] == ["big"]                    # 4000 bytes: own bucket
    assert all(isinstance(s.dtype, str) for s in flat)              # plain data, RPC-safe


def test_pack_unpack_round_trip_is_bitwise():
    named = _tensors()
    for dtype in ("float32", "bfloat16"):
        specs = [(n, tuple(t.shape), dtype) for n, t in named]
        for bucket in S.plan_buckets(specs, bucket_bytes=512):
            buf = torch.empty(S.bucket_size(bucket), dtype=torch.uint8)
            src = [dict(named)[s.name].to(S.DTYPES[dtype]) for s in bucket]
            S.pack(src, bucket, buf)
            for (name, got), want in zip(S.unpack(buf, bucket), src):
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(got.view(torch.uint8) if got.dim() else got, 
                                   want.view(torch.uint8) if want.dim() else want)


def test_sender_local_sink_and_checksums():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    dst = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = dict(dst.named_parameters())

    def sink(named):
        with torch.no_grad():
            for n, t in named:
                params[n].copy_(t)
    sender = S.Sender(model, "float32", bucket_mb=64 / 2**20)   # 64-byte buckets: several
    assert len(sender.plan) > 2
    sent = sender.send(1, sink=sink)
    assert sent >= sum(p.numel() * 4 for p in model.parameters())
    assert S.checksum(list(model.named_parameters())) == S.checksum(list(dst.named_parameters()))


def test_clean_name_strips_wrappers():
    assert S.clean_name("model._checkpoint_wrapped_module.layers.0._orig_mod.w") == "model.layers.0.w"


def test_large_tensors_travel_alone_and_unpacked():
    specs = [("small", (10,), "float32"), ("big", (2048,), "float32"), ("small2", (3,), "float32")]
    plan = S.plan_buckets(specs, bucket_bytes=64 * 1024, solo_bytes=4096)
    assert [[s.name for s in b] for b in plan] == [["small"], ["big"], ["small2"]]
    assert S.bucket_size(plan[1]) == 2048 * 4       # exactly the tensor: sent from its own memory
