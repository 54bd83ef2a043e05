"""The engines' own weight channel: trainer rank 0 and every vLLM worker join a communicator
outside torch's global world (the trainers' torch.distributed holds the torchrun world), gloo /
PyNccl / PyHccl by `device.Device.comm`, opened once at start-up (:func:`open_engine_channel`).
Where vLLM has a weight-transfer engine for the device (`device.Device.weight_transfer`: NCCL on
CUDA, vllm-ascend's HCCL on NPU) the data goes through it (:class:`EngineChannel`, the workers'
side in vllm_worker.py); on the CPU the bucket protocol of sync.py runs over gloo (docs/vllm.md,
"Weight transfer"). :func:`check_channel` is `--check-channel`.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import sys
import threading
import time
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist

import device as D
from config import SyncConfig
from errors import ConfigError
from sync import TorchChannel, fan_out
from world import one_node


class _StreamWork:
    """`.wait()` for a collective enqueued on `stream` (its event is recorded on that stream, not
    the calling thread's current one). `deadline_s`: PyNccl / PyHccl have no watchdog, so past
    it `wait()` raises instead of blocking forever."""

    def __init__(self, stream, deadline_s: float | None = None):
        self.event = stream.record_event()
        self.deadline_s = deadline_s

    def wait(self) -> None:
        if self.deadline_s is None:
            self.event.synchronize()
            return
        end = time.monotonic() + self.deadline_s
        while not self.event.query():
            if time.monotonic() > end:
                raise RuntimeError(f"weight channel: a broadcast did not complete within "
                                   f"{self.deadline_s:.0f} s (a peer is stuck or dead)")
            time.sleep(0.0002)


class CommChannel:
    """Broadcast from this channel's rank 0 (trainer rank 0) to every vLLM worker: `broadcast(buf)`
    sends on rank 0 and receives into `buf` elsewhere; every member calls it for every bucket,
    in order. PyNccl/PyHccl run on the channel's own side stream, passed explicitly (their
    default stream need not be torch's current one)."""

    def __init__(self, group, comm=None, stream=None, deadline_s: float | None = None):
        self.group, self.comm = group, comm  # comm: PyNccl/PyHccl communicator; None: gloo group
        self.stream, self.deadline_s = stream, deadline_s

    def broadcast(self, buf: torch.Tensor):
        if self.comm is None:
            return fan_out(self.group, buf)     # gloo; root = rank 0 within this group
        # wait for the current stream's work on `buf` (the sender's pack, the receiver's loader)
        self.stream.wait_stream(D.current_stream(buf.device))
        self.comm.broadcast(buf, src=0, stream=self.stream)
        return _StreamWork(self.stream, self.deadline_s)


def transfer_engine(kind: str):
    """vLLM's weight-transfer engine class for device kind `kind` (`device.Device.weight_transfer`,
    its module imported here, on the machine that has it); None where the project's channel
    carries the buckets (the CPU)."""
    entry = D.TABLE[kind].weight_transfer
    return None if entry is None else getattr(importlib.import_module(entry[1]), entry[2])


def transfer_path(kind: str) -> str:
    """What carries a vLLM engine's weights on device kind `kind`, in words (bench/sync.py)."""
    entry = D.TABLE[kind].weight_transfer
    if entry is None:
        return (f"sync.py buckets over the project's {D.TABLE[kind].comm} channel (vLLM 0.23 has "
                "no weight-transfer engine for it)")
    return f"vLLM weight-transfer engine {entry[0]!r} ({entry[2]}), packed, the plan's order"


class EngineChannel:
    """Trainer rank 0's end when the workers receive through vLLM's weight-transfer engine: one
    sync is one `trainer_send_weights(named tensors, packed)` of the engine class (vLLM 0.23's
    NCCLWeightTransferEngine, vllm-ascend 0.23's HCCLWeightTransferEngine), in chunks of
    `sync.chunk_bytes(plan)`, which the workers derive from the same plan. This object is the
    engine's `group`: its packed producer calls only `group.broadcast(tensor, src=0)`, which goes
    to `chan` (the communicator open_channel built, on its side stream), with every broadcast's
    wait bounded by the channel's deadline and its tensor held until that wait: vLLM's producer
    itself would block on a dead peer (docs/vllm.md, "Weight transfer")."""

    NUM_BUFFERS = 2  # chunks in flight: vLLM's default (packed_tensor.DEFAULT_PACKED_NUM_BUFFERS)

    def __init__(self, chan: CommChannel, engine_cls):
        self.chan, self.engine_cls = chan, engine_cls
        self._pending: list = []  # (work, tensor) of broadcasts not yet waited, oldest first

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        if src != 0:
            raise ValueError(f"weight transfer: trainer rank 0 is the source, not {src}")
        self._pending.append((self.chan.broadcast(tensor), tensor))
        while len(self._pending) > self.NUM_BUFFERS - 1:
            self._pending.pop(0)[0].wait()

    def send(self, named, chunk_bytes: int) -> int:
        """Send `named` ((name, tensor) in the plan's order, each on this device in the sync
        dtype) through the engine; returns the bytes sent once every broadcast completed."""
        counted = []

        def count(item):
            counted.append(item[1].numel() * item[1].element_size())
            return item[1]

        with warnings.catch_warnings():  # a tensor over `chunk_bytes` goes in a chunk of its size,
            warnings.filterwarnings(        # as sync.py's solo buckets: no warning per such tensor
                "ignore", message=r"Tensor '.*' has size \d+ bytes, which exceeds buffer_size_bytes")
            self.engine_cls.trainer_send_weights(named, dict(
                group=self, src=0, post_iter_func=count, packed=True,
                packed_buffer_size_bytes=chunk_bytes, packed_num_buffers=self.NUM_BUFFERS))
        while self._pending:
            self._pending.pop(0)[0].wait()
        return sum(counted)


@contextlib.contextmanager
def _without_agent_store():
    # under TORCHELASTIC_USE_AGENT_STORE (torchrun) a tcp:// rendezvous waits for a store nobody serves
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


def _stateless_group(host: str, port: int, rank: int, world_size: int, listen_socket=None):
    from vllm.distributed.utils import StatelessProcessGroup
    return StatelessProcessGroup.create(host, port, rank, world_size, listen_socket=listen_socket)


def _stateless_gloo(host: str, port: int, rank: int, world_size: int, listen_socket=None):
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group
    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, "gloo",
                                                          listen_socket=listen_socket)


def _communicator_class(comm: str):
    if comm == "pynccl":
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        return PyNcclCommunicator
    from vllm_ascend.distributed.device_communicators.pyhccl import PyHcclCommunicator
    return PyHcclCommunicator


def open_channel(comm: str, host: str, port: int, rank: int, world_size: int,
                 device: torch.device, *, listen_socket=None,
                 deadline_s: float | None = None) -> CommChannel:
    """Join the weight channel: `comm` "gloo" (CPU), "pynccl" (CUDA) or "pyhccl" (Ascend). Rank 0
    hosts the rendezvous at host:port (on `listen_socket`, from :func:`listen`); all `world_size`
    members must call this concurrently. Leaves this thread's current stream as it was.
    `deadline_s` bounds every broadcast's wait (_StreamWork)."""
    if comm not in ("gloo", "pynccl", "pyhccl"):
        raise ValueError(f"weight channel: unknown communicator {comm!r} (gloo | pynccl | pyhccl)")
    with _without_agent_store():
        if comm == "gloo":
            return CommChannel(_stateless_gloo(host, port, rank, world_size, listen_socket))
        group = _stateless_group(host, port, rank, world_size, listen_socket)
    stream = D.new_stream(device)
    with D.stream_context(stream):
        communicator = _communicator_class(comm)(group, device=device)
    if communicator.disabled:  # its broadcast would then return without moving a byte
        raise RuntimeError(f"weight channel: {comm} is unavailable (world_size={world_size}, "
                           "or the NCCL/HCCL library was not found)")
    return CommChannel(group, communicator, stream, deadline_s)


def listen(port: int) -> tuple[socket.socket, list]:
    """Trainer rank 0's listening socket for the weight channel's rendezvous at `port` (`[sync]
    channel_port`; 0: any), bound here so no probe-then-bind race exists, and the address the
    members connect to: on the loopback when the job runs on one node (world.one_node), else on
    every interface, announced as MASTER_ADDR (docs/gpu-npu.md, "Ports")."""
    local = one_node()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1" if local else "", port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"sync.channel_port={port}: cannot listen on it ({e.strerror}); "
                           "pick a free port or 0") from None
    sock.listen()
    host = "127.0.0.1" if local else os.environ.get("MASTER_ADDR", "127.0.0.1")
    return sock, [host, sock.getsockname()[1]]


def vllm_log_level(verbose: bool) -> None:
    """vLLM's log level for this process and its children, read at vLLM's first import: warnings
    only unless `verbose` (run.verbose); a VLLM_LOGGING_LEVEL the user set stays."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")


def open_engine_channel(world, comm: str, engine, members_per_engine: int,
                        device: torch.device, *, port: int = 0, timeout_s: float | None = None,
                        verbose: bool = False) -> CommChannel | None:
    """Trainer rank 0 and the workers of every `OWN_CHANNEL` engine join one communicator
    (`comm`), once, at start-up; collective over the world. Trainer rank 0 listens on `port` and
    announces MASTER_ADDR:port. `timeout_s` bounds each broadcast's wait on trainer rank 0 (and on
    the workers over the project's channel). Returns trainer rank 0's end (None elsewhere): an
    :class:`EngineChannel` where the device has a vLLM weight-transfer engine (the workers then
    join through it: vllm_worker.VLLMWorkerExtension.init_weight_sync), else the CommChannel.
    `verbose`: vLLM's INFO lines on trainer rank 0 too."""
    vllm_log_level(verbose)
    size = 1 + len(world.gens) * members_per_engine
    sock, addr = listen(port) if world.is_root else (None, [None, None])
    dist.broadcast_object_list(addr, 0, group=world.ctrl)
    host, port = addr
    if world.size == 1:  # both ends in this process: the engine joins from a thread
        t = threading.Thread(target=engine.join_weight_channel, args=(host, port, 1, size))
        t.start()
        chan = open_channel(comm, host, port, 0, size, device, listen_socket=sock,
                            deadline_s=timeout_s)
        t.join()
        return chan
    if world.is_gen:
        engine.join_weight_channel(host, port, 1 + world.gen_index * members_per_engine, size)
        return None
    if not world.is_root:
        return None
    # the rendezvous stays the project's (on the socket bound above): the engines' trainer_init
    # binds host:port itself and has no listening socket to take (docs/vllm.md)
    chan = open_channel(comm, host, port, 0, size, device, listen_socket=sock, deadline_s=timeout_s)
    cls = transfer_engine(device.type)
    return chan if cls is None else EngineChannel(chan, cls)


def _own_channel_mover(world, dev: D.Device, port: int, device, n: int, timeout_s):
    """--check-channel's ends of the vLLM engines' channel at `port`, opened by trainer rank 0 and
    each generation rank (on its engine's first device): `move(buf)` (None elsewhere), which
    sends `buf` of `n` bytes or receives it, and the channel in words. Where the device has a
    vLLM weight-transfer engine, the bytes go through it as a sync's do (a generation rank
    makes the engine itself, for no model: :func:`engine_receiver`)."""
    sock, addr = listen(port) if world.is_root else (None, [None, None])
    dist.broadcast_object_list(addr, 0, group=world.ctrl)
    cls, size = transfer_engine(dev.kind), 1 + len(world.gens)
    what = (f"{dev.comm if cls is None else transfer_path(dev.kind)} at {addr[0]}:{addr[1]} "
            "(the vLLM engines' channel)")
    if world.is_gen and cls is not None:
        return engine_receiver(cls, dev.weight_transfer[0], addr, 1 + world.gen_index, size, n), what
    if not (world.is_root or world.is_gen):
        return None, what
    chan = open_channel(dev.comm, addr[0], addr[1], 1 + world.gen_index if world.is_gen else 0,
                        size, device, listen_socket=sock, deadline_s=timeout_s)
    if cls is not None:  # trainer rank 0
        ends = EngineChannel(chan, cls)
        return (lambda b: ends.send(iter([("check", b)]), n)), what
    return (lambda b: chan.broadcast(b).wait()), what


def engine_receiver(cls, name: str, addr, rank: int, size: int, n: int):
    """A generation rank's end of --check-channel through vLLM's weight-transfer engine `cls`
    (registered as `name`), made here outside any vLLM worker (no model: the engine only
    receives) and joined as member `rank` of `size` at addr; returns `receive(buf)`, which takes
    one packed chunk of `n` bytes into `buf`, as a worker's sync receives a chunk."""
    from vllm.config import WeightTransferConfig
    alone = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)  # the engine adds rank
    xfer = cls(WeightTransferConfig(backend=name), alone, None)
    xfer.init_transfer_engine(xfer.parse_init_info(dict(
        master_address=addr[0], master_port=addr[1], rank_offset=rank, world_size=size)))
    info = xfer.parse_update_info(dict(
        names=["check"], dtype_names=["uint8"], shapes=[[n]], packed=True,
        packed_buffer_size_bytes=n, packed_num_buffers=EngineChannel.NUM_BUFFERS))
    return lambda buf: xfer.receive_weights(info, load_weights=lambda got: buf.copy_(got[0][1]))


def check_channel(world, dev: D.Device, sc: SyncConfig, timeout_s: float | None = None) -> int:
    """`train.py --check-channel` (docs/gpu-npu.md): one bucket of `bucket_mb` (`[sync]` sc) from
    trainer rank 0 to every generation rank, twice, over the run's channel (with
    `world.own_channel`, opened by each generation rank on its engine's first device); rank 0
    prints one JSON line. Returns the exit code (0: every generation rank got the bytes).
    Collective over the world; destroys the process group at the end."""
    if world.size == 1:
        raise ConfigError("--check-channel needs generation ranks besides trainer rank 0 (2+ ranks)")
    device = D.current_device(dev)
    member = world.is_root or world.is_gen
    t0 = time.monotonic()
    n = max(8, int(sc.bucket_mb * 2**20) // 8 * 8)
    if world.own_channel:
        move, what = _own_channel_mover(world, dev, sc.channel_port, device, n, timeout_s)
    else:
        channel = TorchChannel(world.sync_group, 0) if member else None
        move = channel and (lambda b: channel.broadcast(b).wait())
        what = "the torch sync group (the hf engines' channel)"
    mine = None
    if member:
        expect = torch.arange(n // 8, dtype=torch.int64, device=device).view(torch.uint8)
        buf = expect.clone() if world.is_root else torch.zeros(n, dtype=torch.uint8, device=device)
        mine = {"rank": world.rank, "open_s": time.monotonic() - t0}
    for key in ("first_s", "broadcast_s"):
        dist.barrier(group=world.ctrl)  # every member starts together
        if member:
            if not world.is_root:
                buf.zero_()
            t = time.monotonic()
            move(buf)
            D.synchronize(dev)  # an NCCL/HCCL work's wait() only orders the current stream
            mine[key] = time.monotonic() - t
            mine["ok"] = mine.get("ok", True) and bool(torch.equal(buf, expect))
    got: list = [None] * world.size
    dist.all_gather_object(got, mine, group=world.ctrl)
    rows = [g for g in got if g is not None]
    bad = [r["rank"] for r in rows if not r["ok"]]
    if world.is_root:
        slow = max(r["broadcast_s"] for r in rows)
        print(json.dumps({"check": "weight channel", "ok": not bad, "channel": what,
                          "from": "trainer rank 0", "to": list(world.gens), "bytes": n,
                          "open_s": round(max(r["open_s"] for r in rows), 3),
                          "first_s": round(max(r["first_s"] for r in rows), 4),
                          "broadcast_s": round(slow, 4), "gb_per_s": round(n / slow / 1e9, 3),
                          "per_rank": [{k: round(v, 4) if isinstance(v, float) else v
                                        for k, v in r.items()} for r in rows]}), flush=True)
        if bad:
            print(f"error: weight channel check: rank(s) {bad} received other bytes than trainer "
                  f"rank 0 sent", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return 1 if bad else 0
