"""Weight transport from the trainers to the engines, in buckets, with version numbers.

Protocol, per sync (after every rollout step):
1. Every trainer rank walks the engines' tensors in one fixed order (`lora.engine_tensors`: the
   policy's parameters, or with LoRA the base model's with each adapted weight merged) and
   gathers each (`full_tensor()`): FSDP2 shards are all-gathered on the trainer group, so all
   trainer ranks must make the same calls in the same order.
2. Trainer rank 0 casts each full tensor to the transport dtype and packs it into a byte bucket
   (`bucket_mb`); a full bucket is broadcast over the dedicated sync group {trainer 0, every
   generation rank} while the next one is packed (two buffers, asynchronous broadcast).
3. Metadata (names, shapes, dtypes as strings, offsets) travels once, on the first sync; every
   later sync sends one small control tensor (version, bucket count, plan) and then the buckets.
   There are one or two plans: every tensor (the first sync), and with LoRA the tensors that
   change in training (every later sync: the adapted linear layers and their siblings; the
   rest never changes).
4. The generation rank unpacks each bucket into views of its receive buffer (reused across
   syncs) and its engine loads the `(name, tensor)` pairs (`engine.receive_weights(receiver)`).

:func:`sync_weights` is the whole protocol from the loop's side, for every engine and a world
of one. An engine with `OWN_CHANNEL` (vLLM) receives the bucket data inside its own worker
process over a communicator of its own (:func:`open_engine_channel`); its side of the same plan
lives in `vllm_engine.VLLMWorkerExtension`, which uses `plan_from_plain` / `unpack` from here.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

import device as D
from errors import ConfigError
from lora import engine_tensors, full_tensor  # noqa: F401  (full_tensor: trainer.py's too)
from model import DTYPES, checkpoint_pieces

ALIGN = 64  # byte alignment of each tensor inside a bucket (dtype views need aligned offsets)
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")



def clean_name(name: str) -> str:
    """The HF parameter name, without wrapper prefixes that checkpointing/compile insert."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in a bucket. Plain values only: it crosses RPCs and pickles."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


def plan_buckets(specs: list[tuple[str, tuple[int, ...], str]], bucket_bytes: int,
                 solo_bytes: int | None = None) -> list[list[Slot]]:
    """Group (name, shape, dtype) in order into buckets of at most `bucket_bytes` bytes.

    A tensor of at least `solo_bytes` (or larger than a bucket) gets a bucket of its own: it can
    be broadcast straight from its own memory, without packing.
    """
    solo = bucket_bytes if solo_bytes is None else min(solo_bytes, bucket_bytes)
    buckets: list[list[Slot]] = [[]]
    used = 0
    for name, shape, dt in specs:
        nbytes = _numel(shape) * DTYPES[dt].itemsize
        size = -(-nbytes // ALIGN) * ALIGN
        if buckets[-1] and (used + size > bucket_bytes or nbytes >= solo):
            buckets.append([])
            used = 0
        buckets[-1].append(Slot(name, tuple(shape), dt, used, nbytes))
        used += size
        if nbytes >= solo:
            buckets.append([])
            used = 0
    return [b for b in buckets if b]


def bucket_size(bucket: list[Slot]) -> int:
    """Bytes on the wire: up to the end of the last tensor (a one-tensor bucket is exactly it)."""
    last = bucket[-1]
    return last.offset + last.nbytes


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def view(buf: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor `slot` describes, as a view into the uint8 buffer `buf` (no copy)."""
    return buf[slot.offset:slot.offset + slot.nbytes].view(DTYPES[slot.dtype]).view(slot.shape)


def unpack(buf: torch.Tensor, bucket: list[Slot]) -> list[tuple[str, torch.Tensor]]:
    return [(s.name, view(buf, s)) for s in bucket]


def pack(tensors: list[torch.Tensor], bucket: list[Slot], buf: torch.Tensor) -> None:
    for t, s in zip(tensors, bucket, strict=True):
        view(buf, s).copy_(t)


class LiveBytes:
    """Bytes of the tensors `track`ed that are still alive (their storage, views included), and
    the most at once: a weakref finalizer on each storage subtracts it when freed."""

    def __init__(self):
        self.now = self.peak = 0
        self._lock = threading.Lock()  # a storage may be freed in another thread

    def track(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        n = storage.nbytes()
        with self._lock:
            self.now += n
            self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, n)
        return t

    def _free(self, n: int) -> None:
        with self._lock:
            self.now -= n


def wire_pieces(model) -> list[tuple[str, tuple[int, ...], int, tuple]]:
    """What a sync sends, in order: (checkpoint name, shape, position of the tensor in
    `lora.engine_tensors(model)` (for a plain model: in `named_parameters`), index into it) per
    piece. A tensor goes whole, except MoE experts fused in memory, which go per expert under
    the names vLLM's loaders take (model.checkpoint_pieces); every tensor's pieces are
    consecutive, in order."""
    out = []
    for pos, t in enumerate(engine_tensors(model)):
        for name, index in checkpoint_pieces(clean_name(t.name), t.shape):
            shape = tuple(torch.empty(t.shape, device="meta")[index].shape) if index else t.shape
            out.append((name, shape, pos, index))
    return out


class Sender:
    """Trainer side. Every trainer rank builds one and calls `send` after every step."""

    # Memory that gathered tensors (FSDP2 all-gather outputs) may hold while their broadcasts
    # are in flight, in buckets. A tensor that is the parameter's own memory (one trainer rank,
    # or a packed ring buffer) costs nothing, so its broadcast is never waited on early: every
    # broadcast is posted before the first completes, and gloo never idles between buckets.
    GATHERED_IN_FLIGHT = 4

    def __init__(self, model, dtype: str, bucket_mb: float, *, group=None, src: int = 0,
                 is_root: bool = True, device: torch.device = torch.device("cpu"),
                 channel: "Channel | None" = None, solo_mb: float = 4.0):
        self.model, self.dtype, self.group, self.src, self.is_root = model, dtype, group, src, is_root
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.tensors = engine_tensors(model)
        every = wire_pieces(model)
        changing = [piece for piece in every if self.tensors[piece[2]].changes]
        # plan 0: every tensor (the first sync); plan 1, with LoRA: those that change (the rest)
        wires = [every] + ([changing] if len(changing) < len(every) else [])
        self._pieces = [[(pos, index) for _, _, pos, index in w] for w in wires]  # slot order
        self.plans = [plan_buckets([(n, shape, dtype) for n, shape, _, _ in w],
                                   self.bucket_bytes, int(solo_mb * 2**20)) for w in wires]
        self.sends = 0  # syncs made (each trainer rank counts its own: they all send every sync)
        self.device = device
        # Control messages always go over `group` (torch world, gloo); bucket data goes over
        # `group` too (HF engines) or over `channel`, the communicator shared with vLLM workers.
        self.channel = channel or (TorchChannel(group, src) if group is not None else None)
        self._bufs: list[torch.Tensor] = []
        self._plan_sent = False

    @property
    def which(self) -> int:
        """The plan the next sync uses: every tensor first, then (LoRA) those that change."""
        return 0 if self.sends == 0 else len(self.plans) - 1

    @property
    def plan(self) -> list[list[Slot]]:
        return self.plans[self.which]

    @property
    def partial(self) -> bool:
        """The next sync sends only some of the engines' tensors (the others stay as they are)."""
        return self.which > 0

    @torch.no_grad()  # full_tensor() and the casts would otherwise record autograd nodes
    def send(self, version: int, sink: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None) -> int:
        """Gather, pack and broadcast the tensors of :attr:`plan`. Returns the bytes sent (root
        only).

        A large tensor that already has the transport dtype goes out from its own memory (no
        copy); small ones are packed into one of two reused buffers while earlier broadcasts are
        in flight. `sink` (world of 1): instead of broadcasting, hand each bucket's unpacked
        tensors straight to the in-process engine, through the same pack/unpack path.
        """
        which, tensors = self.which, self.tensors
        plan = self.plans[which]
        if self.is_root and self.group is not None:
            self._send_control(version, which)
        pending: list = []        # (work, ring buffer index or None, gathered bytes, tensor kept alive)
        gathered = 0              # bytes of gathered tensors whose broadcast is still pending
        sent = 0
        ring = 0
        pieces = iter(self._pieces[which])
        pos, whole = -1, None     # the tensor being sent, gathered
        for bucket in plan:
            full, views = [], []
            for _ in bucket:
                p_pos, index = next(pieces)
                if p_pos != pos:  # each tensor once, in order: a collective on every trainer
                    pos, whole = p_pos, tensors[p_pos].gather()
                full.append(whole[index] if index else whole)
                views.append(bool(index))
            if not self.is_root:
                continue
            t = full[0].detach()
            held = 0
            if (len(bucket) == 1 and not views[0] and t.dtype == DTYPES[self.dtype]
                    and t.is_contiguous() and t.device == self.device):
                buf, slot = t.reshape(-1).view(torch.uint8), None      # zero copy
                if full[0] is not tensors[pos].parts[0]:  # a gathered copy, not the parameter
                    held = buf.numel()
            else:
                slot, ring = ring, 1 - ring
                for w, s, _, _ in pending:  # the buffer's previous broadcast must finish first
                    if s == slot:
                        w.wait()
                buf = self._buffer(slot, bucket_size(bucket))[:bucket_size(bucket)]
                pack([x.detach().to(self.device, DTYPES[self.dtype]) for x in full], bucket, buf)
            if sink is not None:
                sink(unpack(buf, bucket))
            else:
                pending.append((self.channel.broadcast(buf), slot, held, buf))
                gathered += held
                while gathered > self.GATHERED_IN_FLIGHT * self.bucket_bytes and pending:
                    w, _, h, _ = pending.pop(0)
                    w.wait()
                    gathered -= h
            sent += bucket_size(bucket)
        for w, _, _, _ in pending:
            w.wait()
        self.sends += 1
        return sent

    def _send_control(self, version: int, which: int) -> None:
        if not self._plan_sent:  # metadata once, as plain Python values
            dist.broadcast_object_list([self.plans], self.src, group=self.group)
            self._plan_sent = True
        ctrl = torch.tensor([version, len(self.plans[which]), which], dtype=torch.int64)  # CPU: gloo
        dist.broadcast(ctrl, self.src, group=self.group)

    def _buffer(self, i: int, size: int) -> torch.Tensor:
        while len(self._bufs) <= i:
            self._bufs.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._bufs[i].numel() < size:
            self._bufs[i] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._bufs[i]


class _Works:
    """One `.wait()` for several point-to-point works (the root's sends to each receiver).

    Idempotent, as a collective's work is: a gloo send/recv work's `wait()` consumes one
    completion of its buffer, so a second call would block until the timeout.
    """

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        while self.works:
            self.works[0].wait()
            self.works.pop(0)


def fan_out(pg, buf: torch.Tensor, src: int = 0):
    """Send `buf` from group rank `src` to every other member of the gloo group `pg`; receive it
    into `buf` elsewhere. Returns a work; every member calls this for every bucket, in order.

    Point-to-point rather than `broadcast`: gloo runs a broadcast on its work queue (two threads
    per group), so only two receives are posted at a time and each bucket waits for a thread
    hand-off; a send or receive is posted at once from the caller's thread, so every bucket's
    receive is posted before the first byte arrives and the data streams back to back (16
    buckets of 16 MB: as fast as one raw broadcast of the same bytes, where broadcasts were
    ~6% slower). Messages on one pair and tag match in posting order.
    """
    if pg.rank() == src:
        return _Works([pg.send([buf], r, 0) for r in range(pg.size()) if r != src])
    return _Works([pg.recv([buf], src, 0)])


class TorchChannel:
    """Bucket data over a torch.distributed group (the HF engine's path): point to point where
    the device's backend is gloo, a broadcast elsewhere (`device.Device.fan_out`)."""

    def __init__(self, group, src: int):
        self.group, self.global_src = group, src
        self.src = dist.get_group_rank(group, src)

    def broadcast(self, buf: torch.Tensor):
        if D.TABLE[buf.device.type].fan_out:
            return fan_out(self.group, buf, self.src)
        return dist.broadcast(buf, self.global_src, group=self.group, async_op=True)


Channel = TorchChannel  # anything with .broadcast(uint8 tensor) -> work with .wait(); sender is its rank 0


class Receiver:
    """Generation-rank side of a sync (a `rollout.WeightSource`): control messages, and bucket
    data for in-process engines."""

    def __init__(self, group, src: int, device: torch.device = torch.device("cpu")):
        self.group, self.src, self.device = group, src, device
        self.plans: list[list[list[Slot]]] | None = None
        self.plan: list[list[Slot]] | None = None   # the current sync's
        self.partial = False                        # it sends only the tensors that change
        self._bufs: dict[int, list[torch.Tensor]] = {}
        self._views: dict[int, list] = {}
        self._which = 0

    def control(self) -> tuple[int, list[list[Slot]]]:
        """(version, plan) of the sync that starts now; the plans themselves travel only once."""
        if self.plans is None:
            obj = [None]
            dist.broadcast_object_list(obj, self.src, group=self.group)
            self.plans = obj[0]
        ctrl = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(ctrl, self.src, group=self.group)
        version, n, which = (int(x) for x in ctrl)
        self.plan, self.partial, self._which = self.plans[which], which > 0, which
        if n != len(self.plan):
            raise RuntimeError(f"weight sync: sender has {n} buckets, receiver planned {len(self.plan)}")
        return version, self.plan

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The buckets of the sync whose `control()` was just received: iterate to receive them,
        in order, each once.

        The yielded tensors are views of this receiver's own buffers, one per bucket, which keep
        their storage across syncs: an engine may adopt them as its weights (zero copy, as
        the transformers engine does) or copy them. Every receive is posted at
        once (nothing is reused within a sync), so the transfer runs back to back while the
        engine loads whatever has arrived.
        """
        w = self._which
        if w not in self._bufs:  # made once per plan
            self._bufs[w] = [torch.empty(bucket_size(b), dtype=torch.uint8, device=self.device)
                             for b in self.plan]
            self._views[w] = [unpack(buf, b) for buf, b in zip(self._bufs[w], self.plan)]
        channel = TorchChannel(self.group, self.src)
        works = [channel.broadcast(buf) for buf in self._bufs[w]]
        for work, named in zip(works, self._views[w]):
            work.wait()
            yield named


class LocalControl:
    """The control side of a sync when the sender is in this process (a world of one): the
    version and plan (and whether it is `partial`: Sender.partial), no message. The data goes
    over the engine's own channel."""

    def __init__(self, version: int, plan: list[list[Slot]], partial: bool = False):
        self.version, self.plan, self.partial = version, plan, partial

    def control(self) -> tuple[int, list[list[Slot]]]:
        return self.version, self.plan

    def buckets(self):
        raise RuntimeError("a local sync hands buckets over with Sender.send(sink=...)")


def sync_weights(world, sender: "Sender | None", receiver: "Receiver | None", engine,
                 version: int) -> int:
    """One sync of weight `version`: trainer ranks send, generation ranks load into their engine.
    Returns the bytes sent (trainer rank 0; 0 elsewhere)."""
    if world.size == 1:  # both ends in this process
        if sender.channel is None:  # the engine lives here: buckets handed straight over
            return sender.send(version, sink=engine.load_weights)
        import concurrent.futures as cf  # the engine's own processes receive over the channel
        control = LocalControl(version, sender.plan, sender.partial)  # before the send moves on
        with cf.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(sender.send, version)
            got = engine.receive_weights(control)
            nbytes = sent.result()
    elif world.is_trainer:
        return sender.send(version)
    else:
        got, nbytes = engine.receive_weights(receiver), 0
    if got != version:
        raise RuntimeError(f"weight sync: rank {world.rank} expected version {version}, got {got}")
    return nbytes


def verify(world, policy, engine, dtype: str) -> bool:
    """Bitwise: every engine's weights == the trainer's full weights (with LoRA: merged, as the
    sync sends them) cast to the sync dtype. Collective over the whole world (`world.ctrl`)."""
    ref = None
    if world.is_trainer:  # every trainer rank gathers (collective); rank 0 fingerprints
        with torch.no_grad():
            full = [(t.name, t.gather().detach().to(DTYPES[dtype])) for t in engine_tensors(policy)]
        ref = checksum(full) if world.is_root else None
    mine = checksum(list(engine.named_parameters())) if world.is_gen else None
    got: list = [None] * world.size
    dist.all_gather_object(got, (ref, mine), group=world.ctrl)
    ref = got[0][0]
    return all(g[1] == ref for g in got if g[1] is not None)


def checksum(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Bitwise fingerprint per tensor (sha1 of the raw bytes), for parity tests."""
    import hashlib
    out = {}
    for name, t in named:
        b = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        out[clean_name(name)] = hashlib.sha1(b).hexdigest()
    return out


# ============================================================================= vLLM channel
# A vLLM engine receives weights inside its own worker process, so trainer rank 0 and the
# workers need a communicator that is not torch's global one (the trainer's torch.distributed
# already holds the torchrun world). One code path; the library is chosen by device.Device.comm.
import contextlib  # noqa: E402  (imports of this section, kept with it)
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def plan_to_plain(plan: list[list[Slot]]) -> list[list[dict]]:
    """The bucket plan as lists, dicts, str and int: what `collective_rpc` (msgpack) carries."""
    return [[{"name": s.name, "shape": list(s.shape), "dtype": s.dtype, "offset": s.offset,
              "nbytes": s.nbytes} for s in bucket] for bucket in plan]


def plan_from_plain(plain: list[list[dict]]) -> list[list[Slot]]:
    return [[Slot(d["name"], tuple(d["shape"]), d["dtype"], d["offset"], d["nbytes"])
             for d in bucket] for bucket in plain]


class _StreamWork:
    """`.wait()` for a collective enqueued on `stream`: its completion event is recorded on that
    same stream object (not on whatever stream is current in the calling thread).

    `deadline_s`: PyNccl / PyHccl have no watchdog, so a peer that never joins a broadcast would
    block `wait()` forever; with a deadline it raises instead (the run's failure path then stops
    every rank)."""

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
    """Broadcast from this channel's rank 0 (trainer rank 0) to every vLLM worker.

    The same object on both sides: `broadcast(buf)` sends `buf` on rank 0 and receives into it
    elsewhere; every member calls it for every bucket, in the same order. With a PyNccl/PyHccl
    communicator the broadcasts run on the channel's own side stream, passed explicitly (their
    default is each library's own notion of the current stream, which need not be torch's), so
    the broadcast of one bucket overlaps the packing or loading of the next.
    """

    def __init__(self, group, comm=None, stream=None, deadline_s: float | None = None):
        self.group, self.comm = group, comm  # comm: PyNccl/PyHccl communicator; None: gloo group
        self.stream, self.deadline_s = stream, deadline_s

    def broadcast(self, buf: torch.Tensor):
        if self.comm is None:
            return fan_out(self.group, buf)     # gloo; root = rank 0 within this group
        # `buf` was just written (sender: pack) or its previous contents read (receiver: the
        # loader) on this thread's current stream: the side stream waits for that work first.
        self.stream.wait_stream(D.current_stream(buf.device))
        self.comm.broadcast(buf, src=0, stream=self.stream)
        return _StreamWork(self.stream, self.deadline_s)


@contextlib.contextmanager
def _without_agent_store():
    # torchrun sets TORCHELASTIC_USE_AGENT_STORE=True; torch's tcp:// rendezvous then makes
    # every rank a client of a store torchrun's agent hosts at that address: nobody serves it.
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
    """Join the weight channel: `comm` "gloo" (CPU), "pynccl" (CUDA) or "pyhccl" (Ascend).

    Rank 0 (trainer rank 0) hosts the rendezvous at host:port, on `listen_socket` when given
    (already bound and listening: see :func:`listen`); all `world_size` members must call this
    concurrently (it blocks until they have). Nothing in torch's global state changes: the
    communicator is built inside a stream context on the channel's side stream, so PyNccl's
    constructor does not make a new stream this thread's current one. `deadline_s` bounds every
    broadcast's wait (see _StreamWork).
    """
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


def listen(port: int) -> socket.socket:
    """Trainer rank 0's listening socket for the weight channel's rendezvous, on every interface,
    at `port` (`[sync] channel_port`; 0: one the OS picks). Bound here and handed to vLLM's
    helpers, so the port announced is the one that listens (no probe-then-bind race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("", port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"sync.channel_port={port}: cannot listen on it ({e.strerror}); "
                           "pick a free port or 0") from None
    sock.listen()
    return sock


def vllm_log_level(verbose: bool) -> None:
    """vLLM's log level for this process and the ones it starts, read when vLLM is first
    imported: warnings only unless `verbose` (run.verbose; INFO is 75 of the 104 lines of the CPU
    vLLM demo). A level the user set (VLLM_LOGGING_LEVEL) stays."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")


def open_engine_channel(world, comm: str, engine, members_per_engine: int,
                        device: torch.device, *, port: int = 0, timeout_s: float | None = None,
                        verbose: bool = False) -> CommChannel | None:
    """Trainer rank 0 and the workers of every engine whose `OWN_CHANNEL` is set join one
    communicator (`comm`: gloo / pynccl / pyhccl, by device), once, at start-up. Collective over
    the world. Trainer rank 0 listens on `port` (0: any free one) and announces MASTER_ADDR and
    the port to the others over the world's gloo group: every generation node must reach
    MASTER_ADDR:port. `timeout_s` bounds each broadcast's wait on both ends. Returns trainer
    rank 0's end (None elsewhere); engines keep theirs. `verbose`: vLLM's INFO lines on trainer
    rank 0 too (its end of the channel imports vLLM)."""
    vllm_log_level(verbose)
    size = 1 + len(world.gens) * members_per_engine
    sock = listen(port) if world.is_root else None
    addr = ([os.environ.get("MASTER_ADDR", "127.0.0.1"), sock.getsockname()[1]] if world.is_root
            else [None, None])
    dist.broadcast_object_list(addr, 0, group=world.ctrl)
    host, port = addr
    if world.size == 1:  # both ends in this process: the engine joins from a thread
        import threading
        t = threading.Thread(target=engine.join_weight_channel, args=(host, port, 1, size))
        t.start()
        chan = open_channel(comm, host, port, 0, size, device, listen_socket=sock,
                            deadline_s=timeout_s)
        t.join()
        return chan
    if world.is_gen:
        engine.join_weight_channel(host, port, 1 + world.gen_index * members_per_engine, size)
        return None
    return (open_channel(comm, host, port, 0, size, device, listen_socket=sock,
                         deadline_s=timeout_s) if world.is_root else None)


def check_channel(world, dev: D.Device, sc, timeout_s: float | None = None) -> int:
    """`train.py --check-channel`: the weight channel alone, before a long run. Trainer rank 0
    broadcasts one bucket of `bucket_mb` (`[sync]` sc) to every generation rank twice (the first
    includes the device library's own connection set-up) and rank 0 prints one JSON line;
    every receiver checks the bytes. Returns the exit code (0: every generation rank got them).

    With `world.own_channel` (vLLM) it is the engines' communicator (gloo / PyNccl / PyHccl, by
    device) opened as vLLM's workers open it, on `channel_port` of MASTER_ADDR, but from each
    generation rank itself on its engine's first device (world.setup(claim_engine_devices=True)),
    so no engine starts; otherwise the torch sync group the HF engines receive over. Collective
    over the world; destroys the process group at the end.
    """
    if world.size == 1:
        raise ConfigError("--check-channel needs generation ranks besides trainer rank 0 (2+ ranks)")
    device = D.current_device(dev)
    member = world.is_root or world.is_gen
    t0 = time.monotonic()
    if world.own_channel:
        sock = listen(sc.channel_port) if world.is_root else None
        addr = ([os.environ.get("MASTER_ADDR", "127.0.0.1"), sock.getsockname()[1]]
                if world.is_root else [None, None])
        dist.broadcast_object_list(addr, 0, group=world.ctrl)
        channel = (open_channel(dev.comm, addr[0], addr[1], 1 + world.gen_index if world.is_gen else 0,
                                1 + len(world.gens), device, listen_socket=sock, deadline_s=timeout_s)
                   if member else None)
        what = f"{dev.comm} at {addr[0]}:{addr[1]} (the vLLM engines' channel)"
    else:
        channel = TorchChannel(world.sync_group, 0) if member else None
        what = "the torch sync group (the hf engines' channel)"
    mine = None
    n = max(8, int(sc.bucket_mb * 2**20) // 8 * 8)
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
            channel.broadcast(buf).wait()
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
