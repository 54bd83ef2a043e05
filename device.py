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
import datetime
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
    # How vLLM's engine process starts its workers. That process is always spawned (it must not
    # inherit this rank's world) and holds no world or accelerator state itself. On CPU its
    # workers fork from it, vLLM's own default there (each skips a fresh interpreter and ~5 s of
    # imports); on GPU/NPU they are spawned, as the vLLM notes prescribe (not yet run there).
    vllm_workers: str = "spawn"
    # With rollout.enforce_eager, whether vLLM's processes run its torch.compile'd helpers
    # eagerly too. On CPU the one on the generation path is the sampler's
    # `compiled_random_sample`, for requests without a seed (this project seeds every one), which
    # vLLM still compiles with inductor (a C++ build) in every engine's warm-up: ~2 s a start
    # here, more on a fresh machine's cold cache. GPU/NPU keep vLLM's compiled helpers.
    vllm_eager_helpers: bool = False
    # vLLM 0.23's CPU MoE fallback builds a CustomOp outside vLLM's config and fails; its
    # processes replace that activation with its native formula (vllm_engine._cpu_moe_activation).
    vllm_cpu_moe_fix: bool = False
    # transformers' `experts_implementation` for MoE layers (trainer and HF engine; None: its
    # default, "grouped_mm": torch's grouped GEMM, with kernels on CUDA, transformers' own loop
    # on CPU). NPU: "eager". torch-npu 2.10 has no kernel for torch's grouped_mm, so the
    # default there runs through an unsupported-op fallback; "eager" is transformers' plain loop
    # over the experts that received tokens (the alternative, "batched_mm", copies each token's
    # expert weights: gigabytes per layer at training lengths). Not yet run on an NPU; torch-npu's
    # own grouped matmul (npu_grouped_matmul) behind transformers' experts interface is the next
    # step.
    experts: str | None = None


TABLE = {
    "cpu": Device("cpu", "gloo", None, "gloo", fan_out=True, vllm_workers="fork",
                  vllm_eager_helpers=True, vllm_cpu_moe_fix=True),
    "cuda": Device("cuda", "cpu:gloo,cuda:nccl", "CUDA_VISIBLE_DEVICES", "pynccl"),
    "npu": Device("npu", "cpu:gloo,npu:hccl", "ASCEND_RT_VISIBLE_DEVICES", "pyhccl",
                  experts="eager"),
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


def device_count(dev: Device) -> int:
    """How many devices of `dev`'s kind this process sees (through any visibility the launcher
    set); 0 on CPU. Asked lazily: torch_npu is imported only here, on NPU."""
    if dev.kind == "cuda":
        return torch.cuda.device_count()
    if dev.kind == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
        return torch.npu.device_count()
    return 0


def world_backend(dev: Device, uses_device: bool) -> str:
    """This rank's backend for init_process_group: the device's pair (gloo + NCCL/HCCL) where the
    process computes on its device, plain gloo where it never touches it (a generation rank whose
    vLLM engine runs in processes of its own).

    Why: torch builds a group's backends when the group is created, on every member, and
    torch-npu's ProcessGroupHCCL constructor calls ACL at once (aclrtSetOpWaitTimeout, torch-npu
    2.10 ProcessGroupHCCL.cpp), with no device set in such a process; NCCL communicators are
    created lazily, but a process that never computes has no use for them either. Backends may
    differ across ranks (torch checks no agreement; each collective goes to the backend of its
    tensors' device): such a rank joins only CPU-tensor collectives, on gloo, as every rank
    does for those. Its groups must then be gloo too (world.setup: the sync group)."""
    return dev.backend if uses_device else "gloo"


# torch-npu reads a process-group timeout of exactly 30 min as "not set" (ProcessGroupHCCL.hpp
# DEFAULT_TIMEOUT = 30 * 60 * 1000 ms; torch-npu 2.9-2.12) and then runs its watchdog for
# HCCL_EXEC_TIMEOUT + 1800 s instead (3,420 s with the derived HCCL_EXEC_TIMEOUT of 1,620 s).
HCCL_UNSET_TIMEOUT_MS = 30 * 60 * 1000


def group_timeout(kind: str, timeout_s: float) -> tuple[float, str]:
    """(seconds, note): the timeout the process groups get for `cluster.timeout_s`, and a line
    saying why when it differs. On NPU a value torch-npu would take as "unset" (1800 s, to the
    millisecond its timedelta conversion keeps) becomes 1799 s, so the watchdog fires after
    what the config says and HCCL_EXEC_TIMEOUT stays below it (:func:`hccl_env`)."""
    ms = datetime.timedelta(seconds=timeout_s) // datetime.timedelta(milliseconds=1)
    if kind == "npu" and ms == HCCL_UNSET_TIMEOUT_MS:
        return 1799.0, (f"cluster.timeout_s={timeout_s:g} is torch-npu's 'unset' value (its HCCL "
                        "watchdog would then wait HCCL_EXEC_TIMEOUT + 1800 s): the process groups "
                        "use 1799 s")
    return timeout_s, ""


@contextlib.contextmanager
def fork_rng(device: torch.device):
    """`with fork_rng(device):` seeding inside leaves the CPU's and `device`'s generators as they
    were. Not torch.random.fork_rng: its default device type is the current accelerator in torch
    2.13 but "cuda" before (on an NPU: "Torch not compiled with CUDA enabled"), and torch 2.10
    parses the type through torch.device() and looks up `torch.<type>` itself."""
    cpu_state = torch.get_rng_state()
    mod = None if device.type == "cpu" else torch.get_device_module(device.type)
    dev_state = mod.get_rng_state(device) if mod is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if mod is not None:
            mod.set_rng_state(dev_state, device)


def torch_device(dev: Device, local_rank: int) -> torch.device:
    """The torch.device of this rank (CPU: always cpu) and make it current."""
    if dev.kind == "cpu":
        return torch.device("cpu")
    if dev.kind == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        torch.npu.set_device(local_rank)
    return torch.device(dev.kind, local_rank)


def current_device(dev: Device) -> torch.device:
    """The device this process made current (:func:`torch_device`); cpu on CPU."""
    if dev.kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if dev.kind == "npu":
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


def narrow_visible(dev: Device, device_ids: list[int]) -> None:
    """Make only `device_ids` (this node's device indices) visible to processes this one spawns
    (vLLM's engine and its workers, which then number them from 0).

    Must run before the engine starts. The indices are resolved through any visibility the
    launcher already set; one beyond it is an error naming the variable.
    """
    if dev.visible_env is None:
        return
    current = os.environ.get(dev.visible_env)
    ids = current.split(",") if current else [str(i) for i in range(64)]
    if max(device_ids) >= len(ids):
        raise ValueError(f"{dev.visible_env}={current}: this rank needs devices {device_ids} of its "
                         f"node (trainers first, then tensor_parallel_size devices per engine)")
    os.environ[dev.visible_env] = ",".join(ids[i] for i in device_ids)


def hccl_env(timeout_s: float, environ=os.environ) -> dict[str, str]:
    """HCCL settings of an NPU run checked against `cluster.timeout_s` (the process groups'
    timeout, i.e. torch-npu's watchdog, as :func:`group_timeout` gives it), before any process
    group exists. Returns the variables to set; raises ValueError (one line) on a contradiction.

    - HCCL_EXEC_TIMEOUT (how long a started collective waits for its peers) must stay below the
      watchdog, or the watchdog kills the job first and HCCL's own report (plog) is lost; unset,
      it becomes 90% of the watchdog's timeout (HCCL reads it when communicators are created).
    - HCCL_OP_EXPANSION_MODE=AIV is refused: CANN documents it for inference only, not for
      several communicators in one process, with a single-node Broadcast, and it caps
      HCCL_EXEC_TIMEOUT at 1091 s.
    """
    if environ.get("HCCL_OP_EXPANSION_MODE", "").upper() == "AIV":
        raise ValueError("HCCL_OP_EXPANSION_MODE=AIV is for inference only (CANN: not for several "
                         "communicators per process, Broadcast single-node); unset it for training")
    watchdog, note = group_timeout("npu", timeout_s)
    exec_s = environ.get("HCCL_EXEC_TIMEOUT")
    if exec_s is None:
        return {"HCCL_EXEC_TIMEOUT": str(max(1, int(watchdog * 0.9)))}
    if not exec_s.strip().isdigit() or not 0 < int(exec_s) < watchdog:
        used = f" (used as {watchdog:g} s)" if note else ""
        raise ValueError(f"HCCL_EXEC_TIMEOUT={exec_s} must be in [1, cluster.timeout_s={timeout_s:g}"
                         f"){used} (torch-npu's watchdog would fire first and HCCL's report be "
                         "lost); lower it, raise cluster.timeout_s, or unset it (then 90% of it)")
    return {}


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
