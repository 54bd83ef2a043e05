"""Every CPU / CUDA / NPU difference lives here (one :data:`TABLE` row per kind; docs/gpu-npu.md).

`torch_npu` is imported lazily, so nothing here needs it on a CPU machine. No other module calls
`torch.cuda` / `torch.npu` directly (a test greps for it).
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
    fan_out: bool = False   # weight buckets go point to point (gloo), not by broadcast
    vllm_workers: str = "spawn"  # how vLLM's (always spawned) engine process starts its workers
    vllm_eager_helpers: bool = False  # with rollout.enforce_eager, vLLM's compiled helpers too
    # vLLM 0.23's CPU MoE activation, replaced by its native formula (vllm_engine._cpu_moe_activation)
    vllm_cpu_moe_fix: bool = False
    # vLLM serves linear-attention (Gated DeltaNet) models here: its CPU build's causal_conv1d
    # kernels fail while loading them (measured with vLLM 0.23.0+cpu)
    vllm_linear_attention: bool = True
    # vLLM returns each token's routed experts (enable_return_routed_experts; routing.py): its CPU
    # build returns all zeros there (its CPU MoE kernel never fills the capture, vLLM 0.23.0+cpu)
    vllm_routed_experts: bool = True
    # vLLM splits a long prefill over engine steps (chunked prefill): not on its CPU build, where
    # a seeded request's unfinished prefill rewinds its generator with `set_offset`, which a CPU
    # generator refuses ("CPU Generator does not use offset", vLLM 0.23.0 gpu_model_runner.py
    # _bookkeeping_sync): the engine died on long multi-turn batches. Off, each prompt is
    # scheduled whole (vLLM then raises max_num_batched_tokens to max_model_len at least)
    vllm_chunked_prefill: bool = True
    # vLLM's sleep mode (`enable_sleep_mode`: CUDA's cumem allocator, vllm-ascend's own): a
    # colocated engine gives the device up for the train phase. vLLM 0.23's CPU platform refuses
    # the flag; its CPU worker's sleep and wake_up are no-ops (host memory is shared anyway)
    vllm_sleep_mode: bool = True
    experts: str | None = None  # transformers' experts_implementation for MoE (None: its default)
    # train.packing's rows, every sequence of a micro-batch in one row: "segments" = attention.py's
    # kernel (each prompt causally, each response over its prompt and itself: batched SDPA calls,
    # prompts shared by their responses, no [W, W] mask; needs nothing beyond torch, measured on
    # CPU and on an H200); "varlen" = no mask, positions restarting per sequence, run by
    # flash_attention_2 (flash-attn's varlen kernel on CUDA, npu_fusion_attention's TND layout on
    # NPU: transformers' packed-sequence path; a prompt copied per response; not run on hardware)
    packed_attention: str = "segments"
    # the package the "varlen" layout's flash_attention_2 needs here (None: the device's own
    # fused op, torch_npu's on NPU); checked at start (microbatches.resolve_layout)
    varlen_package: str | None = "flash_attn"
    # the "varlen" kernel takes fp32 (model.mixed_precision = false: the trainer computes in its
    # fp32 weights' dtype). flash-attn's does not: "FlashAttention only support fp16 and bf16
    # data type" (flash-attn 2.8.3 csrc/flash_attn/flash_api.cpp, mha_varlen_fwd);
    # npu_fusion_attention does (op-plugin docs/context/torch_npu-npu_fusion_attention.md:
    # query/key/value float16, bfloat16, float32). Refused at start (packing_refusal)
    varlen_fp32: bool = True
    # sequences one varlen call may take (None: no limit known): op-plugin's npu_fusion_attention
    # documents B in 1..2K and actual_seq_qlen "at most 1K long in the varlen case" (same page);
    # the vision tower's window calls are chunked to it (vision_chunks)
    varlen_max_seqs: int | None = None
    # what train.packing = "auto" picks, from what bench/packing.py measured (docs/benchmarks.md):
    # "always" packs; "rows" packs when micro-batches are counted in rows (micro_batch_tokens = 0:
    # on an H200, 2.7-3.2x padded micro-batches of micro_batch_size rows at 3B shapes, but 0.77-
    # 0.93x length-sorted micro-batches of a token budget); "never": not measured there
    auto_packing: str = "always"
    # the "segments" kernel batches pieces whose lengths are within this ratio into one call
    # (attention.plan): higher = fewer calls, more padded query-key pairs. The CPU's attention
    # is compute-bound, an accelerator's bound by the calls it launches (bench/packing.py
    # --bucket-ratios; docs/benchmarks.md)
    bucket_ratio: float = 1.25
    # AdamW's kernels (adamw_options): "fused" = one kernel per step over every tensor (torch's
    # _fused_adamw_: CUDA's; torch-npu dispatches it to CANN's aclnnApplyAdamWV2, not yet run on
    # an NPU here); "foreach" = grouped kernels, ~10 passes over the parameters and a
    # parameter-sized temporary (the 3B's H200 peak: five copies of the fp32 model). The CPU has a
    # fused kernel too (torch >= 2.4) but keeps foreach, bitwise the per-tensor loop, so CPU runs
    # repeat earlier ones exactly: fused differs by ~1 ulp a step (tests/test_optimizer.py)
    adamw: str = "foreach"
    # vLLM's own weight-transfer engine for the static split (channel.open_engine_channel,
    # vllm_worker.VLLMWorkerExtension): (factory name, module, class), the module imported only
    # where it runs. None: the project's channel over `comm` (the CPU: vLLM 0.23 has no gloo
    # engine). cuda: vLLM 0.23's NCCL engine; npu: vllm-ascend 0.23's HCCL engine (registered by
    # its plugin as "hccl"). Not run on hardware yet (docs/vllm.md, "Weight transfer")
    weight_transfer: tuple[str, str, str] | None = None


TABLE = {
    "cpu": Device("cpu", "gloo", None, "gloo", fan_out=True, vllm_workers="fork",
                  vllm_eager_helpers=True, vllm_cpu_moe_fix=True, vllm_linear_attention=False,
                  vllm_routed_experts=False, vllm_chunked_prefill=False, vllm_sleep_mode=False),
    "cuda": Device("cuda", "cpu:gloo,cuda:nccl", "CUDA_VISIBLE_DEVICES", "pynccl",
                   auto_packing="rows", bucket_ratio=4.0, varlen_fp32=False, adamw="fused",
                   weight_transfer=("nccl", "vllm.distributed.weight_transfer.nccl_engine",
                                    "NCCLWeightTransferEngine")),
    "npu": Device("npu", "cpu:gloo,npu:hccl", "ASCEND_RT_VISIBLE_DEVICES", "pyhccl",
                  experts="eager", packed_attention="varlen", auto_packing="never",
                  varlen_package=None, varlen_max_seqs=1024, adamw="fused",
                  weight_transfer=("hccl", "vllm_ascend.distributed.weight_transfer.hccl_engine",
                                   "HCCLWeightTransferEngine")),
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


def adamw_options(kind: str) -> dict:
    """torch.optim.AdamW's keyword for the kernels of device kind `kind` (Device.adamw)."""
    return {"fused": True} if TABLE[kind].adamw == "fused" else {"foreach": True}


def device_count(dev: Device) -> int:
    """How many devices of `dev`'s kind this process sees (through any visibility the launcher
    set); 0 on CPU. Asked lazily: torch_npu is imported only here, on NPU."""
    if dev.kind == "cpu":
        return 0
    if dev.kind == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    return torch.get_device_module(dev.kind).device_count()


def world_backend(dev: Device, uses_device: bool) -> str:
    """This rank's backend for init_process_group: the device's pair (gloo + NCCL/HCCL) where the
    process computes on its device, plain gloo where it never touches it (a generation rank whose
    vLLM engine runs in processes of its own: torch-npu's ProcessGroupHCCL would call ACL with no
    device set; docs/gpu-npu.md). Its groups must then be gloo too (world.setup)."""
    return dev.backend if uses_device else "gloo"


# torch-npu's "not set" process-group timeout (ProcessGroupHCCL.hpp DEFAULT_TIMEOUT; docs/gpu-npu.md)
HCCL_UNSET_TIMEOUT_MS = 30 * 60 * 1000


def group_timeout(kind: str, timeout_s: float) -> tuple[float, str]:
    """(seconds, note): the timeout the process groups get for `cluster.timeout_s`, and a line
    saying why when it differs: on NPU, 1800 s (to the millisecond) becomes 1799 s."""
    ms = datetime.timedelta(seconds=timeout_s) // datetime.timedelta(milliseconds=1)
    if kind == "npu" and ms == HCCL_UNSET_TIMEOUT_MS:
        return 1799.0, (f"cluster.timeout_s={timeout_s:g} is torch-npu's 'unset' value (its HCCL "
                        "watchdog would then wait HCCL_EXEC_TIMEOUT + 1800 s): the process groups "
                        "use 1799 s")
    return timeout_s, ""


@contextlib.contextmanager
def fork_rng(device: torch.device):
    """`with fork_rng(device):` seeding inside leaves the CPU's and `device`'s generators as they
    were. Not torch.random.fork_rng: before torch 2.13 its default device type is "cuda", even
    on an NPU."""
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
    torch.get_device_module(dev.kind).set_device(local_rank)
    return torch.device(dev.kind, local_rank)


def current_device(dev: Device) -> torch.device:
    """The device this process made current (:func:`torch_device`); cpu on CPU."""
    if dev.kind == "cpu":
        return torch.device("cpu")
    return torch.device(dev.kind, torch.get_device_module(dev.kind).current_device())


def narrow_visible(dev: Device, device_ids: list[int]) -> None:
    """Make only `device_ids` (this node's device indices, through any visibility the launcher
    set) visible to processes this one spawns (vLLM's engine and its workers); before the engine
    starts. An index beyond what is visible is a ValueError naming the variable."""
    if dev.visible_env is None:
        return
    current = os.environ.get(dev.visible_env)
    ids = current.split(",") if current else [str(i) for i in range(64)]
    if max(device_ids) >= len(ids):
        raise ValueError(f"{dev.visible_env}={current}: this rank needs devices {device_ids} of its "
                         f"node (trainers first, then tensor_parallel_size devices per engine)")
    os.environ[dev.visible_env] = ",".join(ids[i] for i in device_ids)


def hccl_env(timeout_s: float, environ=os.environ) -> dict[str, str]:
    """HCCL settings of an NPU run checked against `cluster.timeout_s` (the watchdog's, as
    :func:`group_timeout` gives it), before any process group exists: HCCL_EXEC_TIMEOUT (how long
    a started collective waits) and HCCL_CONNECT_TIMEOUT (how long a link takes to establish)
    must each stay below it (unset: 90% of it), HCCL_OP_EXPANSION_MODE=AIV is refused
    (docs/gpu-npu.md). Returns the variables to set; raises ValueError (one line) on a
    contradiction."""
    if environ.get("HCCL_OP_EXPANSION_MODE", "").upper() == "AIV":
        raise ValueError("HCCL_OP_EXPANSION_MODE=AIV is for inference only (CANN: not for several "
                         "communicators per process, Broadcast single-node); unset it for training")
    watchdog, note = group_timeout("npu", timeout_s)
    out = {}
    for name in ("HCCL_EXEC_TIMEOUT", "HCCL_CONNECT_TIMEOUT"):
        value = environ.get(name)
        if value is None:
            out[name] = str(max(1, int(watchdog * 0.9)))
        elif not value.strip().isdigit() or not 0 < int(value) < watchdog:
            used = f" (used as {watchdog:g} s)" if note else ""
            raise ValueError(f"{name}={value} must be in [1, cluster.timeout_s={timeout_s:g}){used} "
                             "(torch-npu's watchdog would fire first and HCCL's report be lost); "
                             "lower it, raise cluster.timeout_s, or unset it (then 90% of it)")
    return out


# --- start-up refusals and process settings read from the hardware stacks (issue 52) ----------
def packing_refusal(kind: str, packing, mixed_precision: bool) -> str:
    """The one line refusing `train.packing` on device `kind` at start ("" if it runs): the
    "varlen" layout computes in the trainer's dtype, fp32 without model.mixed_precision, which
    the device's varlen kernel may not take (Device.varlen_fp32)."""
    row = TABLE[kind]
    layout = packing if packing in ("segments", "varlen") else (
        row.packed_attention if packing is True else None)
    if layout != "varlen" or mixed_precision or row.varlen_fp32:
        return ""
    return (f"train.packing = {packing!r} runs the \"varlen\" layout, whose kernel on {kind} "
            "(flash-attn) takes only fp16/bf16, but model.mixed_precision = false computes in fp32: "
            "set model.mixed_precision = true, or train.packing = \"segments\"")


def vllm_spawn_env(dev: Device, environ=os.environ) -> dict[str, str]:
    """Variables the vLLM engine's processes get (set in the generation rank before it spawns
    them; a value already set is kept unless said):
    - VLLM_USE_V2_MODEL_RUNNER=0: vLLM 0.23 runs a few dense architectures (one of them the
      text-only reference config's) on its V2 model runner by default on GPU (vllm/config/vllm.py,
      DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES and VllmConfig.use_v2_model_runner); vllm-ascend
      forces V1 and the CPU build runs V1 here, so V1 is what every test ran. Pinned until a
      GPU run validates V2 (set it to 1 to try);
    - on NPU, TASK_QUEUE_ENABLE=1 and CPU_AFFINITY_CONF=0 (always): launch/npu_env.sh sets 2
      and 1 for the trainers; ROLL's vLLM workers force TASK_QUEUE_ENABLE back to 1 (ROLL's
      Ascend env guide, roll/platforms/npu.py), and vllm-ascend 0.23 binds its workers' CPUs
      itself (additional_config enable_cpu_binding, default true: vllm_ascend/platform.py)."""
    out = {} if "VLLM_USE_V2_MODEL_RUNNER" in environ else {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    if dev.kind == "npu":
        out.update(TASK_QUEUE_ENABLE="1", CPU_AFFINITY_CONF="0")
    return out


def chunk_vision(model, limit: int | None) -> bool:
    """Make `model`'s vision tower (a `visual` module with a `grid_thw` forward) run its images in
    runs of at most `limit` varlen sequences per call (:func:`vision_chunks`; the windows of a
    windowed tower, else one per frame), its outputs concatenated in image order as one call's
    would be. For the "varlen" layout on a device with a per-call limit (Device.varlen_max_seqs:
    NPU's TND). Returns whether it wrapped a tower."""
    visual = getattr(model, "visual", None) or getattr(getattr(model, "model", None), "visual", None)
    if visual is None or limit is None:
        return False
    vc = visual.config
    side = max(1, getattr(vc, "window_size", 0) // vc.spatial_merge_size // vc.patch_size)
    windowed = bool(getattr(vc, "window_size", 0))

    def seqs(t: int, h: int, w: int) -> int:  # h, w in patches; windows count merged tokens
        m = vc.spatial_merge_size
        return t * (-(-(h // m) // side) * -(-(w // m) // side) if windowed else 1)

    whole = visual.forward

    def forward(hidden_states, grid_thw, **kwargs):
        runs = vision_chunks([seqs(*g) for g in grid_thw.tolist()], limit)
        if len(runs) <= 1:
            return whole(hidden_states, grid_thw, **kwargs)
        ends = grid_thw.prod(-1).cumsum(0).tolist()  # patch rows per image, cumulated
        outs = [whole(hidden_states[(ends[r.start - 1] if r.start else 0):ends[r.stop - 1]],
                      grid_thw[r.start:r.stop], **kwargs) for r in runs]
        return type(outs[0])(**{k: _cat([o[k] for o in outs]) for k in outs[0].keys()})

    visual.forward = forward
    return True


def varlen_attention(device_type: str, dtype: torch.dtype):
    """torch's variable-length attention, (q, k, v [T, H, D], cu_seq_q, cu_seq_k, max_q, max_k)
    -> [T, H, D] without a mask, where the device has it: CUDA's flash kernels
    (torch.nn.attention.varlen, half precision only); else None (attention.vision_forward: one
    padded SDPA call). NPU's vision tower runs transformers' flash path (chunk_vision)."""
    if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _cat(parts: list):
    """One call's output field from the chunks' (tensors: concatenated; lists: per entry)."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    if isinstance(parts[0], (list, tuple)):
        return type(parts[0])(_cat(list(entry)) for entry in zip(*parts))
    return parts[0]


def staging_memory(ro, dtype: str, n_params: int, total_bytes: int) -> tuple[str, bool]:
    """(the start-up memory line, whether it fits) of an engine device that stages a received
    version (pipeline.stages_received): a full copy of the model in `dtype` (model.dtype)
    outside rollout.gpu_memory_utilization (`[rollout]` ro), against what that leaves of a
    device of `total_bytes` (0: not known, as on CPU: not checked)."""
    need, util = n_params * (2 if dtype == "bfloat16" else 4), ro.gpu_memory_utilization
    line = (f"engine memory: staging a received version holds {need / 2**30:.1f} GiB ({n_params / 1e9:.2f} B "
            f"parameters in {dtype}; rollout.max_staleness={ro.max_staleness}, stale={ro.stale!r}, no "
            f"rollout.partial) outside rollout.gpu_memory_utilization={util:g}")
    if not total_bytes:
        return line + " (the device's memory is not known here: not checked)", True
    slack = (1 - util) * total_bytes
    line += f", which leaves {slack / 2**30:.1f} GiB of each {total_bytes / 2**30:.0f} GiB device"
    if need <= slack:
        return line, True
    most = max(0.0, 1 - need / total_bytes)
    return (line + f": it does not fit; lower rollout.gpu_memory_utilization to {most:.2f} or less, or set "
            "rollout.partial = true (loads at once, stages nothing)"), False


def total_memory(dev: Device, device: torch.device) -> int:
    """Bytes of memory of `device` (0 on CPU: not an engine's budget)."""
    if dev.kind == "cpu":
        return 0
    return torch.get_device_module(device.type).get_device_properties(device).total_memory


def vision_chunks(seqs_per_image: list[int], limit: int | None) -> list[range]:
    """Consecutive runs of images whose varlen sequences (a vision tower's windows or frames,
    per image) add up to at most `limit` per call (Device.varlen_max_seqs; None: one run). An
    image over the limit alone is a run of its own (one call cannot split an image's windows:
    they share its full-attention layers). Every image is in exactly one run, in order."""
    if limit is None or sum(seqs_per_image) <= limit:
        return [range(len(seqs_per_image))] if seqs_per_image else []
    runs, start, count = [], 0, 0
    for i, n in enumerate(seqs_per_image):
        if i > start and count + n > limit:
            runs.append(range(start, i))
            start, count = i, 0
        count += n
    runs.append(range(start, len(seqs_per_image)))
    return runs


def synchronize(dev: Device) -> None:
    if dev.kind != "cpu":
        torch.get_device_module(dev.kind).synchronize()


def new_stream(device: torch.device):
    """A side stream on `device` (the weight channel's own); None on CPU."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device.type).Stream(device=device)


def current_stream(device: torch.device):
    """This thread's current stream on `device` (None on CPU)."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device.type).current_stream(device)


def stream_context(stream):
    """`with stream_context(s):` makes `s` this thread's current stream (a no-op for None); on
    CUDA through torch.cuda.set_stream, which vLLM patches to keep its own in step."""
    if stream is None:
        return contextlib.nullcontext()
    return torch.get_device_module(stream.device.type).stream(stream)


def peak_memory_gb(dev: Device) -> float:
    """Peak allocated accelerator memory of this process (0 on CPU)."""
    if dev.kind == "cpu":
        return 0.0
    return torch.get_device_module(dev.kind).max_memory_allocated() / 2**30


def release_cached_memory(device: torch.device) -> None:
    """Hand the caching allocator's free blocks on `device` back to the driver (a colocated
    engine's sleep); a no-op on CPU."""
    if device.type != "cpu":
        torch.get_device_module(device.type).empty_cache()


def allocated_gb(dev: Device) -> float:
    """Accelerator memory this process's tensors hold now (0 on CPU)."""
    if dev.kind == "cpu":
        return 0.0
    return torch.get_device_module(dev.kind).memory_allocated() / 2**30


def reset_peak_memory(dev: Device) -> None:
    """Start :func:`peak_memory_gb` over from what is allocated now (a no-op on CPU)."""
    if dev.kind != "cpu":
        torch.get_device_module(dev.kind).reset_peak_memory_stats()


def device_name(dev: Device) -> str:
    """A human-readable name of this process's accelerator (the CPU's, on CPU)."""
    if dev.kind != "cpu":
        return torch.get_device_module(dev.kind).get_device_name()
    import platform
    return platform.processor() or platform.machine()


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(seed)  # also seeds CUDA and (through torch_npu) NPU generators


def rng_state(dev: Device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if dev.kind != "cpu":
        state[dev.kind] = torch.get_device_module(dev.kind).get_rng_state()
    return state


def set_rng_state(dev: Device, state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if dev.kind != "cpu" and dev.kind in state:
        torch.get_device_module(dev.kind).set_rng_state(state[dev.kind])


def vllm_engine_args(dev: Device) -> dict:
    """`vllm.LLM` arguments that differ by device (`dev`'s row): chunked prefill off where it
    crashes (Device.vllm_chunked_prefill); vLLM's own defaults elsewhere."""
    return {} if dev.vllm_chunked_prefill else {"enable_chunked_prefill": False}


def loopback_env() -> dict:
    """Environment for a job whose ranks all run on one node: gloo's sockets (the world's CPU
    groups, the CPU weight channel, vLLM's own groups on every kind) on the loopback, not on the
    interface the host name resolves to. NCCL's and HCCL's bootstrap sockets are left to their
    own settings (NCCL_SOCKET_IFNAME, HCCL_IF_IP: docs/gpu-npu.md, "Ports"), not measured here."""
    return {"GLOO_SOCKET_IFNAME": "lo"}
