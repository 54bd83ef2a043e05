"""Weight transport from the trainers to the engines, in buckets, with version numbers.

:func:`sync_weights` is the whole protocol from the loop's side (docs/benchmarks.md, "Weight
sync"): every trainer rank gathers the engines' tensors in one order, trainer rank 0 packs and
broadcasts them, the generation ranks' engines load them. An engine with `OWN_CHANNEL` (vLLM)
receives the buckets in its own workers over channel.py's communicator
(`vllm_worker.VLLMWorkerExtension`, with `plan_from_plain` / `unpack` from here).
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

import device as D
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
    """Group (name, shape, dtype) in order into buckets of at most `bucket_bytes` bytes; a tensor
    of at least `solo_bytes` (or larger than a bucket) gets one of its own (sent unpacked)."""
    solo = bucket_bytes if solo_bytes is None else min(solo_bytes, bucket_bytes)
    buckets: list[list[Slot]] = [[]]
    used = 0
    for name, shape, dt in specs:
        nbytes = math.prod(shape) * DTYPES[dt].itemsize
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


def chunk_bytes(plan: list[list[Slot]]) -> int:
    """The chunk size of vLLM's packed weight transfer for `plan`: its largest bucket of several
    tensors (at most `sync.bucket_mb`; its largest bucket when every one holds one tensor). Both
    ends derive it from the plan they share, as vLLM's producer and consumer must agree on it."""
    packed = [bucket_size(b) for b in plan if len(b) > 1]
    return max(packed or [bucket_size(b) for b in plan])


def view(buf: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor `slot` describes, as a view into the uint8 buffer `buf` (no copy)."""
    return buf[slot.offset:slot.offset + slot.nbytes].view(DTYPES[slot.dtype]).view(slot.shape)


def unpack(buf: torch.Tensor, bucket: list[Slot]) -> list[tuple[str, torch.Tensor]]:
    return [(s.name, view(buf, s)) for s in bucket]


def pack(tensors: list[torch.Tensor], bucket: list[Slot], buf: torch.Tensor) -> None:
    for t, s in zip(tensors, bucket, strict=True):
        view(buf, s).copy_(t)


def plan_to_plain(plan: list[list[Slot]]) -> list[list[dict]]:
    """The bucket plan as lists, dicts, str and int: what `collective_rpc` (msgpack) carries."""
    return [[{"name": s.name, "shape": list(s.shape), "dtype": s.dtype, "offset": s.offset,
              "nbytes": s.nbytes} for s in bucket] for bucket in plan]


def plan_from_plain(plain: list[list[dict]]) -> list[list[Slot]]:
    return [[Slot(d["name"], tuple(d["shape"]), d["dtype"], d["offset"], d["nbytes"])
             for d in bucket] for bucket in plain]


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
    `lora.engine_tensors(model)`, index into it) per piece (model.checkpoint_pieces); every
    tensor's pieces are consecutive."""
    out = []
    for pos, t in enumerate(engine_tensors(model)):
        for name, index in checkpoint_pieces(clean_name(t.name), t.shape):
            shape = tuple(torch.empty(t.shape, device="meta")[index].shape) if index else t.shape
            out.append((name, shape, pos, index))
    return out


class Sender:
    """Trainer side. Every trainer rank builds one and calls `send` after every step."""

    # Buckets' worth of gathered tensors (FSDP2 all-gather outputs) held while their broadcasts
    # are in flight; a parameter's own memory or a ring buffer does not count.
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
        # control messages over `group`; bucket data over `group` (HF) or `channel` (vLLM)
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
        """Gather, pack and broadcast the tensors of :attr:`plan`; returns the bytes sent (root
        only). `sink` (world of 1): hand each bucket's unpacked tensors straight to the
        in-process engine instead, through the same pack/unpack path."""
        which, tensors = self.which, self.tensors
        plan = self.plans[which]
        if self.is_root and self.group is not None:
            self._send_control(version, which)
        if self.is_root and sink is None and hasattr(self.channel, "send"):  # vLLM's engine
            sent = self.channel.send((p for b in self.gathered(which) for p in b), chunk_bytes(plan))
            self.sends += 1
            return sent
        pending: list = []        # (work, ring buffer index or None, gathered bytes, tensor kept alive)
        gathered = 0              # bytes of gathered tensors whose broadcast is still pending
        sent = 0
        ring = 0
        pieces = self._gather(which)
        for bucket in plan:
            full = [next(pieces) for _ in bucket]  # gathered on every trainer rank
            if not self.is_root:
                continue
            first, pos, index = full[0]
            t = first.detach()
            held = 0
            if (len(bucket) == 1 and not index and t.dtype == DTYPES[self.dtype]
                    and t.is_contiguous() and t.device == self.device):
                buf, slot = t.reshape(-1).view(torch.uint8), None      # zero copy
                if first is not tensors[pos].parts[0]:  # a gathered copy, not the parameter
                    held = buf.numel()
            else:
                slot, ring = ring, 1 - ring
                for w, s, _, _ in pending:  # the buffer's previous broadcast must finish first
                    if s == slot:
                        w.wait()
                buf = self._buffer(slot, bucket_size(bucket))[:bucket_size(bucket)]
                pack([x.detach().to(self.device, DTYPES[self.dtype]) for x, _, _ in full], bucket, buf)
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

    @torch.no_grad()
    def gathered(self, which: int | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Plan `which`'s buckets (default: the next sync's, :attr:`plan`) as (HF name, tensor)
        pieces, bucket by bucket: every trainer rank gathers each tensor once, in order (a
        collective), and casts its pieces to the sync dtype on this rank's device; no packing, no
        broadcast (vLLM's weight-transfer engine, channel.EngineChannel; a colocated rank's own
        engine, :class:`GatheredSource`). A piece may be the trainer's own tensor (a world of one
        in the sync dtype): to be copied, never adopted."""
        which = self.which if which is None else which
        pieces = self._gather(which)
        for bucket in self.plans[which]:
            yield [(slot.name, next(pieces)[0].detach().to(self.device, DTYPES[slot.dtype]))
                   for slot in bucket]

    def _gather(self, which: int) -> Iterator[tuple[torch.Tensor, int, tuple]]:
        """Plan `which`'s pieces in slot order as (tensor, its position in :attr:`tensors`, index
        into it; (): the whole tensor): every trainer rank gathers each tensor once, in order,
        when its first piece is asked for (a collective)."""
        pos, whole = -1, None
        for p_pos, index in self._pieces[which]:
            if p_pos != pos:  # each tensor once, in order: a collective on every trainer
                pos, whole = p_pos, self.tensors[p_pos].gather()
            yield (whole[index] if index else whole), pos, index

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
    """One `.wait()` for several point-to-point works (the root's sends to each receiver);
    idempotent, unlike a gloo send/recv work's (a second `wait()` blocks until the timeout)."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        while self.works:
            self.works[0].wait()
            self.works.pop(0)


def fan_out(pg, buf: torch.Tensor, src: int = 0):
    """Send `buf` from group rank `src` to every other member of the gloo group `pg`; receive it
    into `buf` elsewhere. Returns a work; every member calls this for every bucket, in order.
    Point to point, not gloo's queued broadcast, so every receive is posted at once."""
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
    """Generation-rank side of a sync (an `episode.WeightSource`): control messages, and bucket
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
        """The buckets of the sync whose `control()` was just received, in order, each once: views
        of this receiver's own buffers (one per bucket, kept across syncs), which an engine may
        adopt as its weights or copy. Every receive is posted at once."""
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


class GatheredSource(LocalControl):
    """A colocated rank's sync into its own vLLM engine (an `episode.WeightSource`): the
    version and plan, and :meth:`Sender.gathered`'s buckets, pulled by the engine's one
    layerwise reload (a layer's weights may span buckets); nothing crosses a process."""

    def __init__(self, sender: Sender, version: int):
        super().__init__(version, sender.plan, sender.partial)
        self.sender = sender

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        yield from self.sender.gathered()
        self.sender.sends += 1


def sync_weights(world, sender: "Sender | None", receiver: "Receiver | None", engine,
                 version: int) -> int:
    """One sync of weight `version`: trainer ranks send, generation ranks load into their engine
    (colocated: every rank gathers the full tensors and loads its own engine, bucket by bucket,
    between the engine's wake-ups of its weights and of its KV cache). Returns the bytes sent
    (rank 0; 0 elsewhere)."""
    if world.colocated:  # this rank's own engine, asleep since the train phase (cluster.colocate)
        engine.wake_up(["weights"])
        if engine.OWN_CHANNEL:  # vLLM, in this process: its worker reloads the whole sync at once
            sent = sum(map(bucket_size, sender.plan))
            got = engine.receive_weights(GatheredSource(sender, version))
            if got != version:
                raise RuntimeError(f"weight sync: rank {world.rank} expected version {version}, got {got}")
        else:
            sent = sender.send(version, sink=engine.load_weights)  # gathered buckets, in-process
        engine.wake_up(["kv_cache"])
        return sent if world.is_root else 0
    if world.size == 1:  # both ends in this process
        if sender.channel is None:  # the engine lives here: buckets handed straight over
            return sender.send(version, sink=engine.load_weights)
        control = LocalControl(version, sender.plan, sender.partial)  # before the send moves on
        with cf.ThreadPoolExecutor(1) as pool:  # the engine's own processes receive over the channel
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
    out = {}
    for name, t in named:
        b = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        out[clean_name(name)] = hashlib.sha1(b).hexdigest()
    return out
