"""The code that runs inside vLLM's worker processes (`worker_extension_cls`): the receiving
end of weight sync (docs/vllm.md), through vLLM's weight-transfer engine where the device has one
(`device.Device.weight_transfer`), else over the project's channel (channel.py). vLLM imports it
there by name ("vllm_worker.VLLMWorkerExtension"); the rank's client is vllm_engine.py."""
from __future__ import annotations

import contextlib
import logging

import torch

import channel as CH
import device as D
import sync


class PartialReload(logging.Filter):
    """Context manager around a partial reload (`active`: LoRA syncs after the first): holds
    back the per-layer "not loaded" warnings, and stops the sync naming any layer that got only
    part of its weights (vocabulary layers exempt; docs/vllm.md, "Partial reloads")."""

    LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.worker.gpu_model_runner")
    PADDED = ("ParallelLMHead", "VocabParallelEmbedding")

    def __init__(self, active: bool):
        super().__init__()
        self.active = active
        self.partly: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "Delayed processing" in msg and not msg.split(":")[0].endswith(self.PADDED):
            self.partly.append(msg.split(":")[0])
        return record.levelno >= logging.ERROR

    def __enter__(self) -> "PartialReload":
        if self.active:
            self._levels = []
            for name in self.LOGGERS:
                log = logging.getLogger(name)
                self._levels.append(log.level)
                log.setLevel(logging.DEBUG)  # the layerwise debug lines name partly loaded layers
                log.addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        if not self.active:
            return
        for name, level in zip(self.LOGGERS, self._levels):
            logging.getLogger(name).removeFilter(self)
            logging.getLogger(name).setLevel(level)
        if self.partly and exc[0] is None:
            raise RuntimeError(f"weight sync: vLLM layer(s) {', '.join(sorted(set(self.partly)))} "
                               "got only part of their weights in a partial sync (the rest would "
                               "be garbage); send every tensor of such a layer")


class VLLMWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`), called by name through
    `collective_rpc`; `device`, `rank`, `model_config`, `model_runner` are the worker's."""

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int,
                         deadline_s: float | None = None) -> None:
        """Join trainer rank 0's weight channel at host:port as member `rank_offset + rank`: through
        vLLM's weight-transfer engine where the device has one (device.Device.weight_transfer),
        else over the project's channel of the device's communicator (as trainer rank 0 picks
        by its own device kind: channel.open_engine_channel)."""
        self.refuse_unloadable()
        entry = D.TABLE[self.device.type].weight_transfer
        if entry is None:
            comm = D.TABLE[self.device.type].comm
            self.weight_channel = CH.open_channel(comm, host, port, rank_offset + self.rank,
                                                  world_size, self.device, deadline_s=deadline_s)
            return
        self.weight_transfer_engine = transfer_engine(self, entry[0], entry[1], entry[2])
        # the engine's own rendezvous: rank = its rank in the vLLM world + rank_offset
        self.init_weight_transfer_engine(dict(master_address=host, master_port=port,
                                              rank_offset=rank_offset, world_size=world_size))

    def refuse_unloadable(self) -> None:
        """Weights the trainer's bf16/fp32 HF tensors cannot update: a quantized model, or
        vllm-ascend's FRACTAL_NZ layout (any nz mode but 0; always on Atlas 300I / 310P)."""
        q = self.model_config.quantization
        if q is not None:
            raise RuntimeError(f"weight sync: the engine's model is quantized ({q}); the trainer "
                               "sends unquantized Hugging Face weights")
        if self.device.type == "npu":
            from vllm_ascend.ascend_config import get_ascend_config
            from vllm_ascend.utils import is_310p
            if is_310p() or get_ascend_config().weight_nz_mode != 0:
                raise RuntimeError("weight sync: vllm-ascend stores weights as FRACTAL_NZ; set "
                                   "VLLM_ASCEND_ENABLE_NZ=0 (Atlas 300I / 310P is not supported)")

    def receive_weights(self, version: int, plan: list, partial: bool = False,
                        stage: bool = False) -> int:
        """Receive every bucket of `plan` (plain data) and load it through vLLM's layerwise
        reload (which redoes each layer's post-load processing); `partial`: only some tensors
        (:class:`PartialReload`); `stage`: keep them for :meth:`load_staged` instead (an engine
        running ahead, mid-batch: a copy of what the sync sends, outside vLLM's memory budget,
        merged over a staged sync not yet loaded). Through vLLM's weight-transfer engine once
        `init_weight_sync` made one (:meth:`_receive_by_engine`). Returns the tensor count."""
        buckets = sync.plan_from_plain(plan)
        if getattr(self, "weight_transfer_engine", None) is not None:
            self._receive_by_engine(buckets, version, partial, stage)
        elif stage:
            old = getattr(self, "staged", None) or (version, {}, True)
            self.staged = (version, {**old[1], **dict(self.weight_stream(buckets))}, partial and old[2])
        else:
            self._reload(self.weight_stream(buckets), partial, version)
        said = "staged_said" if stage else "sync_said"
        if not getattr(self, said, False) and getattr(self, "receive_memory", None) is not None:
            # once: what a sync costs here (the project's channel; vLLM's engine: docs/vllm.md)
            setattr(self, said, True)
            held = (f"a staged weight sync holds {self.receive_memory.now / 2**20:.1f} MiB until "
                    "the next batch loads it" if stage else f"a weight sync held at most "
                    f"{self.receive_memory.peak / 2**20:.1f} MiB of received tensors at once")
            print(f"vLLM worker {self.rank}: {held}, outside vLLM's memory budget (largest bucket "
                  f"{max(map(sync.bucket_size, buckets)) / 2**20:.1f} MiB)", flush=True)
        return sum(len(b) for b in buckets)

    def _receive_by_engine(self, buckets: list, version: int, partial: bool, stage: bool) -> None:
        """One sync through vLLM's weight-transfer engine (`init_weight_sync`): loaded through the
        worker's own start/update/finish_weight_update (vLLM's layerwise reload, as
        :meth:`_reload`), or with `stage`, kept through the engine's `receive_weights` with a
        loader of our own (each chunk the engine receives into is its own allocation, so the
        views stay valid) and merged over a staged sync not yet loaded."""
        info = update_info(buckets)
        if not stage:
            with PartialReload(partial):
                self.start_weight_update(is_checkpoint_format=True)
                self.update_weights(info)
                self.finish_weight_update()
            self.weight_version = version
            return
        got: dict = {}
        engine = self.weight_transfer_engine
        with torch.device(self.device):
            engine.receive_weights(engine.parse_update_info(info), load_weights=got.update)
        D.synchronize(D.TABLE[self.device.type])
        old = getattr(self, "staged", None) or (version, {}, True)
        self.staged = (version, {**old[1], **got}, partial and old[2])

    def load_staged(self) -> int:
        """Load the staged sync (`receive_weights(..., stage=True)`), then free it; its version."""
        version, named, partial = self.staged
        self.staged = None
        self._reload(iter(list(named.items())), partial, version)
        return version

    def _reload(self, named, partial: bool, version: int) -> None:
        with torch.device(self.device), PartialReload(partial):
            self.model_runner.reload_weights(weights_iterator=named, is_checkpoint_format=True)
        D.synchronize(D.TABLE[self.device.type])
        self.weight_version = version

    def weight_sync_memory(self) -> dict:
        """The last sync's received tensors: bytes alive now and at most at once (tests)."""
        return {"peak": self.receive_memory.peak, "now": self.receive_memory.now}

    def weight_stream(self, buckets: list):
        """(HF name, tensor) of every bucket, in order, the next received while one loads: a
        one-tensor bucket into memory of its own, a packed one into one of two reused buffers,
        handed over as copies, so a sync adds about two buckets (docs/vllm.md, "Memory a sync
        adds"). `receive_memory` counts the bytes alive."""
        live = self.receive_memory = sync.LiveBytes()
        packed = [i for i, b in enumerate(buckets) if len(b) > 1]
        size = max((sync.bucket_size(buckets[i]) for i in packed), default=0)
        ring = [live.track(torch.empty(size, dtype=torch.uint8, device=self.device))
                for _ in range(min(2, len(packed)))]
        slot = {i: k % 2 for k, i in enumerate(packed)}

        def receive(i: int):
            n = sync.bucket_size(buckets[i])
            buf = (ring[slot[i]][:n] if i in slot else
                   live.track(torch.empty(n, dtype=torch.uint8, device=self.device)))
            # the broadcast waits for this thread's earlier work (the copies out of the same
            # ring buffer two buckets ago): channel.CommChannel.broadcast
            return buf, self.weight_channel.broadcast(buf)

        pending = receive(0) if buckets else None
        for i, bucket in enumerate(buckets):
            buf, work = pending
            work.wait()
            pending = receive(i + 1) if i + 1 < len(buckets) else None
            if i in slot:
                for name, t in sync.unpack(buf, bucket):
                    yield name, live.track(t.clone())
            else:
                yield from sync.unpack(buf, bucket)  # the whole buffer: the reload owns it
            del buf


def update_info(buckets: list) -> dict:
    """The engine's update info (vLLM 0.23 NCCLWeightTransferUpdateInfo, vllm-ascend 0.23
    HCCLWeightTransferUpdateInfo: the same fields) for the sync planned as `buckets`: every
    tensor's checkpoint name, dtype and shape in plan order, packed in chunks of
    `sync.chunk_bytes`, as trainer rank 0's channel.EngineChannel sends them."""
    slots = [s for bucket in buckets for s in bucket]
    return {"names": [s.name for s in slots], "dtype_names": [s.dtype for s in slots],
            "shapes": [list(s.shape) for s in slots], "packed": True,
            "packed_buffer_size_bytes": sync.chunk_bytes(buckets),
            "packed_num_buffers": CH.EngineChannel.NUM_BUFFERS}


def transfer_engine(worker, name: str, module: str, cls: str):
    """vLLM's weight-transfer engine `name` for `worker`, made by vLLM's factory as the worker's
    load_model makes it when vLLM is given a weight_transfer_config (vLLM 0.23
    v1/worker/gpu_worker.py:358-363; vllm-ascend 0.23 worker/worker.py:694-704): the one the
    worker made already, else registered (module, cls) under `name` unless registered (vLLM's
    "nccl"; vllm-ascend's plugin registers "hccl") and created for the worker's model."""
    if getattr(worker, "weight_transfer_engine", None) is not None:
        return worker.weight_transfer_engine
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    with contextlib.suppress(ValueError):  # "already registered": the same engine, by its owner
        WeightTransferEngineFactory.register_engine(name, module, cls)
    return WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=name), worker.vllm_config.parallel_config,
        worker.model_runner.get_model())
