"""Bucket plan, pack/unpack round trip, and the Sender/Receiver pair over a real gloo group."""
from __future__ import annotations

import torch

import lora
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



# ------------------------------------------------------------------ over a real gloo group
def _model():
    torch.manual_seed(0)
    model = torch.nn.Module()
    for i in range(5):
        model.register_parameter(f"small{i}a", torch.nn.Parameter(torch.randn(200)))
        model.register_parameter(f"small{i}b", torch.nn.Parameter(torch.randn(5, 40)))
        model.register_parameter(f"big{i}", torch.nn.Parameter(torch.randn(2000)))
    return model


def _sync_worker(rank: int, world: int, store_path: str, q) -> None:
    import datetime

    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        group = dist.new_group(list(range(world)))
        model = _model()  # the receivers replay the sender's updates on a copy: bitwise truth
        if rank == 0:
            # packed buckets that reuse the two ring buffers, and tensors sent zero-copy alone
            sender = S.Sender(model, "float32", bucket_mb=2048 / 2**20, group=group,
                              solo_mb=4096 / 2**20)
            q.put(("plan", [[s.name for s in b] for b in sender.plan]))
            work = S.fan_out(group, torch.arange(4, dtype=torch.uint8))
        else:
            receiver = S.Receiver(group, src=0)
            work = S.fan_out(group, torch.zeros(4, dtype=torch.uint8))
        work.wait()
        work.wait()                                  # idempotent, as a collective's work is
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.5)
            if rank == 0:
                sender.send(version)
                continue
            got, _ = receiver.control()
            received = {n: t.clone() for named in receiver.buckets() for n, t in named}
            want = dict(model.named_parameters())
            q.put((rank, got, sorted(received) == sorted(want)
                   and all(torch.equal(received[n], want[n]) for n in want)))
    finally:
        dist.destroy_process_group()


def test_sender_receiver_over_gloo_every_path_three_syncs(tmp_path):
    """1 sender -> 2 receivers, three syncs: packed buckets reusing the sender's two ring
    buffers (each reuse waits on an earlier send), zero-copy tensors, all in flight at once.
    A second `wait()` on a point-to-point work must not block (it used to, until the timeout)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_sync_worker, args=(r, 3, str(tmp_path / "store"), q))
             for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=60) for _ in range(1 + 2 * 3)]  # a hang fails here, in a minute
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            p.kill() if p.is_alive() else None
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    plan = next(v for k, v in got if k == "plan")
    assert sum(len(b) == 1 and b[0].startswith("big") for b in plan) == 5
    assert sum(len(b) == 2 for b in plan) == 5
    results = sorted((r, v, ok) for r, v, ok in (g for g in got if g[0] != "plan"))
    assert results == [(r, v, True) for r in (1, 2) for v in (1, 2, 3)]


def test_send_gathers_without_autograd(monkeypatch):
    """FSDP2's full_tensor() is differentiable: under autograd every sync would record a graph
    node per parameter. Sender.send runs without grad: the gathered tensors have no grad_fn."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for p in model.parameters():  # stands in for a DTensor: an autograd op like the all-gather
        p.full_tensor = (lambda p=p: p * 1.0)
    gathered = []
    real = lora.full_tensor

    def recording(p):
        t = real(p)
        gathered.append(t)
        return t
    monkeypatch.setattr(lora, "full_tensor", recording)  # what every engine tensor's gather calls
    assert model[0].weight.full_tensor().grad_fn is not None  # the stand-in does record a graph
    S.Sender(model, "bfloat16", bucket_mb=64 / 2**20).send(1, sink=lambda named: None)
    assert len(gathered) == 4
    assert all(t.grad_fn is None and not t.requires_grad for t in gathered)


def test_chunk_bytes_is_the_largest_packed_bucket():
    """vLLM's packed transfer's chunk size, derived from the plan on both ends: the largest bucket
    of several tensors, else the largest bucket."""
    plan = S.plan_buckets([("a", (10,), "float32"), ("b", (10,), "float32"),
                           ("c", (1000,), "float32"), ("d", (3,), "float32")], 256, 1000)
    assert [len(b) for b in plan] == [2, 1, 1] and S.chunk_bytes(plan) == 64 + 40
    assert S.chunk_bytes([plan[1]]) == 4000
