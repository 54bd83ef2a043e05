"""Every CPU / CUDA / NPU difference lives here.

| kind | torch device | process-group backend | visible-devices variable | vLLM package |
|------|--------------|-----------------------|--------------------------|--------------|
| cpu  | cpu          | gloo                  | (none)                   | vllm (CPU build) |
| cuda | cuda         | cpu:gloo,cuda:nccl    | CUDA_VISIBLE_DEVICES     | vllm |
| npu  | npu          | cpu:gloo,npu:hccl     | ASCEND_RT_VISIBLE_DEVICES | vllm + vllm_ascend |

The world backend pairs gloo (CPU tensors: object exchange, control messages) with the
accelerator's collective library, as verl does on NPU. `torch_npu` is imported lazily: PyTorch
loads it through its device-backend entry point when installed, and nothing here requires it on a
CPU machine. No other module calls `torch.cuda` / `torch.npu` directly (a test greps for it).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Device:
    kind: str               # "cpu" | "cuda" | "npu"
    backend: str            # for init_process_group
    visible_env: str | None  # the variable that narrows a process to some devices
    comm: str               # vLLM weight-sync communicator: "gloo" | "pynccl" | "pyhccl"
    # Weight buckets on this device's torch backend go point to point from trainer rank 0 to
    # each engine rank (gloo: its broadcast waits on a two-thread queue per bucket), or by
    # broadcast (NCCL / HCCL: pipelined, and the root sends each byte once).
    fan_out: bool = False


TABLE = {
    "cpu": Device("cpu", "gloo", None, "gloo", fan_out=True),
    "cuda": Device("cuda", "cpu:gloo,cuda:nccl", "CUDA_VISIBLE_DEVICES", "pynccl"),
    "npu": Device("npu", "cpu:gloo,npu:hccl", "ASCEND_RT_VISIBLE_DEVICES", "pyhccl"),
}


def detect() -> Device:
    """The accelerator this process can see: NPU, then CUDA, else CPU.

    `GRPO_DEVICE=cpu|cuda|npu` forces a row (tests force cpu; a dry run plans for a device it
    does not have).
    """
    forced = os.environ.get("GRPO_DEVICE")
    if forced:
        if forced not in TABLE:
            raise ValueError(f"GRPO_DEVICE={forced!r}: expected one of {sorted(TABLE)}")
        return TABLE[forced]
    if _npu_available():
        return TABLE["npu"]
    if torch.cuda.is_available():
        return TABLE["cuda"]
    return TABLE["cpu"]


def planned_kind() -> str:
    """The device kind a dry run plans for: GRPO_DEVICE, or "cuda|npu" when unset."""
    return os.environ.get("GRPO_DEVICE", "cuda|npu")


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    return bool(torch.npu.is_available())


def torch_device(dev: Device, local_rank: int) -> torch.device:
    """The torch.device of this rank (CPU: always cpu) and make it current."""
    if dev.kind == "cpu":
        return torch.device("cpu")
    if dev.kind == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        torch.npu.set_device(local_rank)
    return torch.device(dev.kind, local_rank)


def narrow_visible(dev: Device, local_rank: int) -> None:
    """Make only this rank's physical device visible to processes this one spawns (vLLM's engine).

    Must run before the engine starts; the engine then uses logical device 0. The value is
    resolved through any visibility the launcher already set.
    """
    if dev.visible_env is None:
        return
    current = os.environ.get(dev.visible_env)
    ids = current.split(",") if current else [str(i) for i in range(64)]
    os.environ[dev.visible_env] = ids[local_rank]


def synchronize(dev: Device) -> None:
    if dev.kind == "cuda":
        torch.cuda.synchronize()
    elif dev.kind == "npu":
        torch.npu.synchronize()


def new_stream(device: torch.device):
    """A side stream on `device` (the weight channel's own); None on CPU."""
    if device.type == "cuda":
        return torch.cuda.Stream(device=device)
    if device.type == "npu":
        return torch.npu.Stream(device=device)
    return None


def current_stream(device: torch.device):
    """This thread's current stream on `device` (None on CPU)."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    if device.type == "npu":
        return torch.npu.current_stream(device)
    return None


def stream_context(stream):
    """`with stream_context(s):` makes `s` this thread's current stream (a no-op for None).

    On CUDA this goes through torch.cuda.set_stream, which vLLM patches to keep its own
    thread-local "current stream" in step (vllm.utils.torch_utils.current_stream)."""
    if stream is None:
        return contextlib.nullcontext()
    if stream.device.type == "cuda":
        return torch.cuda.stream(stream)
    return torch.npu.stream(stream)


def peak_memory_gb(dev: Device) -> float:
    """Peak allocated accelerator memory of this process (0 on CPU)."""
    if dev.kind == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    if dev.kind == "npu":
        return torch.npu.max_memory_allocated() / 2**30
    return 0.0


def device_name(dev: Device) -> str:
    """A human-readable name of this process's accelerator (the CPU's, on CPU)."""
    if dev.kind == "cuda":
        return torch.cuda.get_device_name()
    if dev.kind == "npu":
        return torch.npu.get_device_name()
    import platform
    return platform.processor() or platform.machine()


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(seed)  # also seeds CUDA and (through torch_npu) NPU generators


def rng_state(dev: Device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if dev.kind == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    elif dev.kind == "npu":
        state["npu"] = torch.npu.get_rng_state()
    return state


def set_rng_state(dev: Device, state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if dev.kind == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    elif dev.kind == "npu" and "npu" in state:
        torch.npu.set_rng_state(state["npu"])
