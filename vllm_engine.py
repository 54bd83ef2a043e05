"""The vLLM / vllm-ascend engine and its worker extension (the receiving side of weight sync).

vLLM runs in processes of its own (engine core; on CPU also a separate worker); this process (a
torchrun rank with torch.distributed initialised) only sends them requests. The engine core is
SPAWNED: it starts with fresh interpreter state, so vLLM builds a private one-rank world in its
worker and never sees the torchrun world (the workers are spawned from the engine core too, or
forked from it on CPU: device.Device.vllm_workers). Weights reach vLLM's worker over a
communicator of their own (`channel.open_channel`: gloo on CPU, PyNccl on CUDA, PyHccl on
Ascend); only metadata crosses `collective_rpc`. vLLM is imported lazily: the pure helpers
here need no vLLM installed.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from pathlib import Path

import torch

import channel as CH
import device as D
import families as F
import inputs as I
import model as M
import sync
from rollout import Completion, Prompt, Sampling


def vllm_sampling_kwargs(sp: Sampling, tokens: I.Tokens, seed: int) -> dict:
    """`vllm.SamplingParams` arguments for one prompt, equal in effect to HFEngine's.

    Suppressed ids get a logit bias of -inf, applied before temperature. With
    `logprobs_mode="processed_logprobs"` vLLM then reports log_softmax((masked logits) /
    temperature): model.py's convention exactly, while top-p / top-k are off (with them on,
    vLLM reports the logprob AFTER truncation, renormalised over the kept tokens). The bias
    costs O(len(suppressed)) per request; `allowed_token_ids` would cost O(vocab) per sample
    (a 151k-entry list copied, validated and scattered for each of the G samples).
    top_k: 0 means off in vLLM 0.23 as here. Greedy: temperature 0 and n=1 (vLLM requires
    it); its logprob is at temperature 1, as in HFEngine. Sample j of a prompt uses seed + j.
    """
    kw = dict(max_tokens=sp.max_new_tokens, logprobs=0, seed=seed,
              logit_bias={i: float("-inf") for i in tokens.suppressed},
              stop_token_ids=list(tokens.stops or (tokens.eos,)),
              detokenize=False)  # rollout() decodes; vLLM's detokenizer would only cost time
    if sp.greedy:
        return kw | dict(n=1, temperature=0.0)
    return kw | dict(n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k)


def vllm_prompt(ids: list[int], images: list, tokens: I.Tokens) -> dict:
    """vLLM's input for one prompt: ids with ONE unexpanded image placeholder per image.

    vLLM expands each placeholder to the image's patch count itself; already expanded ids would
    be expanded again (and then fail), so they are refused here.
    """
    n = sum(t == tokens.image_pad for t in ids)
    if n != len(images):
        raise ValueError(f"prompt has {n} image placeholders for {len(images)} images "
                         "(vLLM wants one unexpanded placeholder per image)")
    prompt: dict = {"prompt_token_ids": list(ids)}
    if images:
        prompt["multi_modal_data"] = {"image": images[0] if len(images) == 1 else list(images)}
    return prompt


def vllm_completion(token_ids, logprobs, finish_reason: str | None) -> Completion:
    """One of vLLM's `CompletionOutput`s (its token_ids, logprobs, finish_reason) as a Completion."""
    ids = list(token_ids)
    return Completion(ids, [float(lp[t].logprob) for t, lp in zip(ids, logprobs, strict=True)],
                      truncated=finish_reason == "length")


IMAGE_PROCESSOR_SEEN: dict[str, str] = {}  # this process: which image processor vLLM loaded


def _image_only_processor() -> None:
    """Every vLLM process loads each Qwen VLM family's HF processor with the trainer's image
    processor class (`families.IMAGE_PROCESSOR`, PIL) and no video processor, on every device.

    One hook for every family: `InputProcessingContext.get_hf_processor` is the one place every
    family's `...ProcessingInfo.get_hf_processor` goes through (a patch of one family's info class
    would not reach the others); a processor class that takes a video processor is swapped for
    its image-only subclass (:func:`image_only_processor_cls`).
    - One class on both sides: vLLM asks transformers for `use_fast=True`, i.e. the torchvision
      image processor wherever torchvision is installed (GPU/NPU), while the trainer uses the PIL
      one: same grids, slightly different pixels, a systematic logprob gap. `use_fast=False` is
      forced here (a model-level setting loses to vLLM's explicit True; `backend="pil"` would
      also reach the tokenizer), and the class is checked: anything else stops the engine.
    - transformers 5.x loads a video processor with every Qwen VL processor, and the only one it
      has needs torchvision (missing on CPU): the subclass without the `video_processor` argument
      loads from the same folder; videos are off (limit_mm_per_prompt).
    Needed in every vLLM process (the front end here, the engine core, the worker):
    `_VLLMProcessHook` carries it into the spawned ones.
    """
    from vllm.multimodal.processing.context import InputProcessingContext

    if getattr(InputProcessingContext.get_hf_processor, "image_only", False):
        return
    original = InputProcessingContext.get_hf_processor

    def get_hf_processor(self, typ=None, /, **kwargs):
        if isinstance(typ, type) and takes_video(typ):
            cls = image_only_processor_cls(typ)
            return checked_processor(lambda **kw: original(self, cls, **kw), **kwargs)
        return original(self, typ, **kwargs)

    get_hf_processor.image_only = True
    InputProcessingContext.get_hf_processor = get_hf_processor


def takes_video(processor_cls: type) -> bool:
    """Whether a transformers processor class is built with a video processor."""
    import inspect
    return "video_processor" in inspect.signature(processor_cls.__init__).parameters


_IMAGE_ONLY: dict[type, type] = {}


def image_only_processor_cls(processor_cls: type) -> type:
    """`processor_cls` (a Qwen VL processor) without its video processor: same folder, same
    image processor and tokenizer, `video_processor=None`. Its `video_processor` attribute is the
    image processor: videos are off (limit_mm_per_prompt), but vLLM's processing info still sizes
    a video token budget from a video processor's `size` and patch fields at start-up."""
    if processor_cls not in _IMAGE_ONLY:
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            processor_cls.__init__(self, image_processor, tokenizer, None, chat_template, **kwargs)
        _IMAGE_ONLY[processor_cls] = type(f"ImageOnly{processor_cls.__name__}", (processor_cls,),
                                          {"__init__": __init__,
                                           "video_processor": property(lambda p: p.image_processor),
                                           "__module__": processor_cls.__module__})
    return _IMAGE_ONLY[processor_cls]


def checked_processor(load, **kwargs):
    """`load(**kwargs, use_fast=False)`, refusing any image processor class but the trainer's;
    logs the class once per process."""
    kwargs["use_fast"] = False  # transformers: the PIL backend of AutoImageProcessor
    proc = load(**kwargs)
    want, got = F.image_processor_cls(), type(proc.image_processor)
    if got is not want:
        raise RuntimeError(f"vLLM loaded the image processor {got.__name__}; the trainer uses "
                           f"{want.__name__} (pixels would differ)")
    if not IMAGE_PROCESSOR_SEEN:
        IMAGE_PROCESSOR_SEEN["class"] = got.__name__
        print(f"vLLM process {os.getpid()}: image processor {got.__name__}", flush=True)
    return proc


def prefix_caching(setting: str, config) -> tuple[bool, str]:
    """`rollout.prefix_caching` -> (on, why). The G samples of a prompt share its KV when on;
    "auto" leaves it off for a model with linear-attention layers (model.has_linear_attention),
    whose recurrent state vLLM 0.23 caches only through its experimental mamba "align" mode,
    never run here. `config`: the model's (None: not known yet, a dry run of a hub id)."""
    if setting != "auto":
        return setting == "on", f"rollout.prefix_caching = {setting}"
    if config is None:
        return True, "auto: on unless the model's config has linear-attention layers (read at start)"
    if M.has_linear_attention(config):
        return False, ("auto: the model has linear-attention layers, whose recurrent state vLLM "
                       "0.23 prefix-caches only in its experimental mamba 'align' mode; "
                       "--rollout.prefix_caching=on to use it")
    return True, "auto: every text layer is full attention"


def _vllm_process_hook() -> "_VLLMProcessHook":
    _engine_workers_start()
    _eager_helpers()
    _image_only_processor()
    if os.environ.get(CPU_MOE_ENV) == "1":  # device.Device.vllm_cpu_moe_fix: CPU only
        _cpu_moe_activation()
    return _VLLMProcessHook()


WORKERS_ENV = "GRPO_VLLM_WORKERS"      # device.Device.vllm_workers, for vLLM's engine process
EAGER_ENV = "GRPO_VLLM_EAGER_HELPERS"  # "1": device.Device.vllm_eager_helpers and enforce_eager
FRONT_END_ENV = "GRPO_VLLM_FRONT_END"  # the pid of the rank that builds the LLM
CPU_MOE_ENV = "GRPO_VLLM_CPU_MOE"      # "1": device.Device.vllm_cpu_moe_fix (_cpu_moe_activation)


def _in_vllm_process() -> bool:
    """Whether this is one of vLLM's own processes (engine core, worker), not the rank."""
    return os.environ.get(FRONT_END_ENV, str(os.getpid())) != str(os.getpid())


def _engine_workers_start() -> None:
    """In a process vLLM spawned (the engine core; not the rank, which keeps "spawn" for the
    engine core itself): vLLM starts its workers by the method the rank named (WORKERS_ENV)."""
    method = os.environ.get(WORKERS_ENV)
    if method and _in_vllm_process():
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method


def _eager_helpers() -> None:
    """In vLLM's processes, where the rank asked for it (EAGER_ENV): torch.compile'd functions
    run eagerly (read at each call; the workers forked from the engine core inherit it). What
    TORCH_COMPILE_DISABLE=1 does, without touching the rank (it builds vLLM's config)."""
    if os.environ.get(EAGER_ENV) == "1" and _in_vllm_process():
        import torch._dynamo
        torch._dynamo.config.disable = True


def _cpu_moe_activation() -> None:
    """vLLM 0.23's CPU MoE fallback (`cpu_fused_moe.forward_torch`, the path of every fp32 MoE on
    an AMX CPU and of shapes its grouped GEMM does not take) builds a `SiluAndMul` CustomOp inside
    the forward, outside vLLM's config context, and fails ("Current vLLM config is not set").
    Here the same activation, silu(gate) * up, is its native formula (what that op's
    `forward_native` computes). Only where the rank's device row asks (CPU): GPU/NPU MoE never
    take this path, and their processes do not even import the CPU MoE module."""
    try:
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.platforms import current_platform
    except ImportError:  # another vLLM layout: nothing to mend
        return
    if current_platform.is_cpu() and MoEActivation.SILU in getattr(cpu_fused_moe, "_CPU_MOE_ACT_FN", {}):
        def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
            d = x.shape[-1] // 2
            return torch.nn.functional.silu(x[..., :d]) * x[..., d:]
        cpu_fused_moe._CPU_MOE_ACT_FN[MoEActivation.SILU] = silu_and_mul


class _VLLMProcessHook:
    """`hf_overrides` for vLLM that changes nothing in the config.

    vLLM pickles its config into every process it spawns; unpickling this object calls
    `_vllm_process_hook` there, before vLLM loads the processor (the spawned processes run no
    code of ours otherwise: the engine core never imports the worker extension).
    """

    def __call__(self, hf_config):
        return hf_config

    def __reduce__(self):
        return (_vllm_process_hook, ())


def _prepare_spawn(start_timeout_s: float | None = None, verbose: bool = False,
                   workers: str = "spawn", eager_helpers: bool = False,
                   cpu_moe_fix: bool = False) -> None:
    """Environment that vLLM's spawned processes inherit; set before vLLM starts them (and
    before this process imports vLLM's engine client, which reads its start-up deadline once).
    `workers`: how the engine process starts vLLM's workers (device.Device.vllm_workers);
    `eager_helpers`: vLLM's torch.compile'd helpers run eagerly (device.Device.vllm_eager_helpers,
    with rollout.enforce_eager)."""
    if start_timeout_s is not None:  # vLLM's own wait for its engine process: ours, unless set
        os.environ.setdefault("VLLM_ENGINE_READY_TIMEOUT_S", str(math.ceil(start_timeout_s)))
    CH.vllm_log_level(verbose)  # before vLLM is imported here and in every process it spawns
    # fork would copy this rank's threads, process groups and accelerator state.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if workers not in ("spawn", "fork"):
        raise ValueError(f"vLLM workers start by 'spawn' or 'fork', not {workers!r}")
    os.environ[WORKERS_ENV], os.environ[FRONT_END_ENV] = workers, str(os.getpid())
    os.environ[EAGER_ENV] = "1" if eager_helpers else "0"
    os.environ[CPU_MOE_ENV] = "1" if cpu_moe_fix else "0"
    # torchrun sets it; torch's tcp:// rendezvous (vLLM's private world) then never starts a
    # store of its own and waits forever for torchrun's.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    # vLLM's worker imports "vllm_engine.VLLMWorkerExtension" (spawn also passes sys.path).
    root = str(Path(__file__).resolve().parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(paths + [root])
    # CPU backend only: otherwise it reserves gpu_memory_utilization of the host's RAM.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@contextlib.contextmanager
def _environ_restored():
    """vLLM edits os.environ for its children (LOCAL_WORLD_SIZE, LD_PRELOAD, ...); leave this
    rank's own environment as torchrun made it."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class VLLMEngine:
    """vLLM / vllm-ascend generation with vLLM's default multiprocess engine.

    The engine (and its worker) run in processes vLLM spawns; this rank never touches the
    accelerator itself (world.setup narrowed the visible devices to the engine's own).
    Weights arrive straight in the worker over a communicator of their own (channel.open_channel):
    `join_weight_channel` once, then `receive_weights` per sync; only metadata crosses
    `collective_rpc`, each call with a deadline of this rank's own (:meth:`_rpc`). The engine
    interface of rollout.py (`generate`, `receive_weights`, `shutdown`), like HFEngine.
    """
    OWN_CHANNEL = True  # weight data goes to vLLM's worker over channel.open_channel

    @classmethod
    def start_note(cls, rc, config) -> str:
        on, why = prefix_caching(rc.prefix_caching, config)
        return f"vLLM prefix caching {'on' if on else 'off'} ({why})"

    @classmethod
    def from_config(cls, cfg, path: str, procs: I.Processors, *, dev: D.Device,
                    device: torch.device, seed: int, max_images: int = 1) -> "VLLMEngine":
        # vLLM runs in processes it spawns, which see only this rank's devices (world.setup
        # narrowed them); this process never touches the accelerator (`device` is the CPU).
        refuse_npu_nz(dev.kind)
        if procs.vision:
            print(f"rank {os.environ.get('RANK', 0)} (generation): trainer image processor "
                  f"{type(procs.image_processor).__name__}; every vLLM process checks it loads "
                  "the same", flush=True)
        return cls(path, procs.tokens, cfg.rollout, cfg.model, seed=seed,
                   timeout_s=cfg.cluster.timeout_s, max_images=max_images if procs.vision else None,
                   verbose=cfg.run.verbose, device_kind=dev.kind)

    def __init__(self, path: str, tokens: I.Tokens, rc, mc, seed: int,
                 timeout_s: float | None = None, llm_kwargs: dict | None = None,
                 max_images: int | None = 1, verbose: bool = False, device_kind: str | None = None):
        """From `[rollout]` (rc) and `[model]` (mc: dtype, pixel bounds); `max_images`: the most
        images a prompt holds (None: a text-only model, no multimodal arguments); `llm_kwargs`:
        more `vllm.LLM` arguments (tests: `distributed_executor_backend`); `verbose` (run.verbose):
        vLLM's INFO lines too, else its warnings only; `device_kind`: the device vLLM runs on
        (device.TABLE's row: how its processes start; None: this machine's)."""
        self.timeout_s = timeout_s  # every collective_rpc (weight channel, weight loading)
        self.who = f"rank {os.environ.get('RANK', 0)} (generation)"
        dev = D.TABLE[device_kind] if device_kind else D.detect()
        _prepare_spawn(rc.start_timeout_s, verbose, dev.vllm_workers,
                       eager_helpers=dev.vllm_eager_helpers and rc.enforce_eager,
                       cpu_moe_fix=dev.vllm_cpu_moe_fix)
        _image_only_processor()  # the front end (this process) runs the HF processor too
        from vllm import LLM

        self.tokens = tokens
        # at least one image even for text-only prompts: with every limit 0 vLLM would not build
        # the vision tower, and the weight sync sends it
        mm = ({} if max_images is None else dict(
            limit_mm_per_prompt={"image": max(1, max_images), "video": 0},
            mm_processor_kwargs={"min_pixels": mc.min_pixels, "max_pixels": mc.max_pixels},
            # vLLM's processor cache runs the HF processor on text alone, which transformers
            # 5.x rejects for text with image placeholders; the encoder cache still shares one
            # image's features among its G samples.
            mm_processor_cache_gb=0))
        with _environ_restored():
            self.llm = LLM(
                model=path, dtype=mc.dtype, seed=seed,
                tensor_parallel_size=rc.tensor_parallel_size,
                gpu_memory_utilization=rc.gpu_memory_utilization,
                max_model_len=rc.max_model_len, enforce_eager=rc.enforce_eager,
                enable_prefix_caching=prefix_caching(rc.prefix_caching, M.peek_config(path))[0],
                logprobs_mode="processed_logprobs",  # see vllm_sampling_kwargs
                # Off on every device: vLLM turns it on by default on GPU/NPU, but its CPU build
                # forces it off, so generate -> reset_prefix_cache -> reload only ever ran
                # without it; one behaviour everywhere (the engine's batches are whole steps).
                async_scheduling=False,
                worker_extension_cls="vllm_engine.VLLMWorkerExtension",
                hf_overrides=_VLLMProcessHook(),
                disable_log_stats=True, **mm, **(llm_kwargs or {}))

    def generate(self, prompts: list[Prompt], sp: Sampling, seed: int) -> list[list[Completion]]:
        from vllm import SamplingParams
        per = 1 if sp.greedy else sp.n
        # prompt i's samples use seeds seed + i*per + j: distinct across the whole call
        params = [SamplingParams(**vllm_sampling_kwargs(sp, self.tokens, seed + i * per))
                  for i in range(len(prompts))]
        inputs = [vllm_prompt(ids, ims, self.tokens) for ids, ims in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        return [[vllm_completion(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs]
                for o in outs]

    def _rpc(self, method: str, *args):
        """`collective_rpc(method, args)` within `timeout_s`, enforced here.

        vLLM's own `timeout` is ignored by its single-process executor (tp = 1 on GPU/NPU), and
        where it is honoured (tp > 1) a late reply is left queued for the next call. So the call
        runs in a daemon thread (a stuck one must not block interpreter exit); past the deadline
        the engine is stopped and one line names this rank and the method.
        """
        box: dict = {}

        def run():
            try:
                box["result"] = self.llm.collective_rpc(method, args=args)
            except BaseException as e:  # re-raised in the caller's thread
                box["error"] = e

        t = threading.Thread(target=run, daemon=True, name=f"vllm-rpc:{method}")
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            self.shutdown()
            raise RuntimeError(f"{self.who}: vLLM worker call {method!r} did not return within "
                               f"{self.timeout_s:.0f} s (cluster.timeout_s); engine stopped")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def join_weight_channel(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join the weight channel that trainer rank 0 opens at host:port as its rank 0.

        Blocks until every member joined (trainer rank 0 calls channel.open_channel concurrently).
        This engine's workers take ranks rank_offset + (0 .. tensor_parallel_size-1);
        world_size = 1 + (number of engines) * tensor_parallel_size. Call once.
        """
        self._rpc("init_weight_sync", host, port, rank_offset, world_size, self.timeout_s)

    def receive_weights(self, source) -> int:
        """Receive one sync (trainer rank 0 is sending concurrently) and drop stale caches.

        `source.control()` gives the version and sync.Sender's bucket plan; the bucket data
        itself goes from trainer rank 0 straight to the worker over the weight channel. After
        new weights the prefix cache's KV and the encoder cache's vision features (keyed by
        image hash: GRPO sees every image again next epoch) were computed with the old weights.
        Returns the version received.
        """
        version, plan = source.control()
        self._rpc("receive_weights", version, sync.plan_to_plain(plan), source.partial)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
        self.llm.llm_engine.reset_encoder_cache()  # not on `LLM` in vLLM 0.23
        return version

    def shutdown(self) -> None:
        """Stop vLLM's processes (also done at interpreter exit)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def refuse_npu_nz(kind: str) -> None:
    """vllm-ascend stores weights as FRACTAL_NZ unless VLLM_ASCEND_ENABLE_NZ=0 (its default 1 does
    so for quantized weights, 2 for all): an update in the trainer's plain layout would then be
    wrong without an error. Checked before vLLM starts (the worker checks the resolved mode)."""
    if kind == "npu" and os.environ.get("VLLM_ASCEND_ENABLE_NZ", "1") != "0":
        raise RuntimeError(f"VLLM_ASCEND_ENABLE_NZ={os.environ.get('VLLM_ASCEND_ENABLE_NZ', '1 (unset)')}: "
                           "weight sync needs VLLM_ASCEND_ENABLE_NZ=0 (source launch/npu_env.sh)")


class PartialReload(logging.Filter):
    """A reload of only some tensors (`active`; LoRA syncs after the first) through vLLM 0.23's
    layerwise reload: each layer that gets no weights keeps its own, with a warning per layer
    per sync ("Failed to load weights", "weights were not loaded"), expected here and held back.
    A layer that gets only PART of its weights is not fine: the reload refills the rest from
    uninitialised memory (its "Delayed processing" debug message); that stops the sync naming
    the layer (sync.py sends every sibling of an adapted layer, which vLLM fuses with it, so
    this is a guard). Used as a context manager around the reload. The vocabulary layers are
    exempt: each is one weight, padded to a multiple of 64 rows, so it always loads "in part"
    (the padding rows, whose logits vLLM drops); they arrive whole or not at all (LoRA of the
    output head, configs/tiny.toml)."""

    LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.worker.gpu_model_runner")
    # vLLM's vocabulary layers, matched as name suffixes: vllm-ascend builds its own subclasses
    # (AscendParallelLMHead, AscendVocabParallelEmbedding)
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
    """Mixed into vLLM's worker class (`worker_extension_cls`); runs in vLLM's worker process.

    Its methods are called by name through `llm.collective_rpc`. `self.device`, `self.rank`,
    `self.model_config` and `self.model_runner` are the worker's own.
    """

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int,
                         deadline_s: float | None = None) -> None:
        self.refuse_unloadable()
        # the communicator of this worker's device kind, as trainer rank 0 picks by its own
        comm = D.TABLE[self.device.type].comm
        self.weight_channel = CH.open_channel(comm, host, port, rank_offset + self.rank,
                                              world_size, self.device, deadline_s=deadline_s)

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

    def receive_weights(self, version: int, plan: list, partial: bool = False) -> int:
        """Receive every bucket of `plan` (plain data) and load it. Returns the tensor count.

        Through vLLM's layerwise reload on every device (the path vLLM's own RL weight updates
        take): it re-runs each layer's post-load processing (CPU: the oneDNN repack; NPU: the
        weight layout; quantization), which a bare `load_weights` would skip. `partial` (LoRA:
        only the tensors that change): the layers that get nothing keep their weights
        (:class:`PartialReload`).
        """
        buckets = sync.plan_from_plain(plan)
        with torch.device(self.device), PartialReload(partial):
            self.model_runner.reload_weights(weights_iterator=self.weight_stream(buckets),
                                             is_checkpoint_format=True)
        D.synchronize(D.TABLE[self.device.type])
        if getattr(self, "weight_version", None) is None:  # once: what a sync costs here
            print(f"vLLM worker {self.rank}: a weight sync held at most "
                  f"{self.receive_memory.peak / 2**20:.1f} MiB of received tensors at once, outside "
                  f"vLLM's memory budget (largest bucket {max(map(sync.bucket_size, buckets)) / 2**20:.1f} MiB)",
                  flush=True)
        self.weight_version = version
        return sum(len(b) for b in buckets)

    def weight_sync_memory(self) -> dict:
        """The last sync's received tensors: bytes alive now and at most at once (tests)."""
        return {"peak": self.receive_memory.peak, "now": self.receive_memory.now}

    def weight_stream(self, buckets: list):
        """(HF name, tensor) of every bucket, received in order; each tensor is one the reload
        owns, so what a sync adds outside vLLM's memory budget stays about two buckets.

        The reload keeps a layer's tensors until the layer is complete (a layer can span buckets;
        one that never completes, e.g. a padded vocabulary, until the end of the sync) and then
        drops them. So a bucket of one tensor is received straight into memory of its own (the
        reload then owns it, no copy), and a packed bucket (tensors under sync's solo size) into
        one of two receive buffers reused for the whole sync, each of its tensors handed over as
        a copy: an unfinished layer keeps its own bytes alive, never a whole bucket (views into a
        fresh buffer per bucket kept each buffer alive until every layer in it was done). The
        next bucket is received while this one loads: the other ring buffer, or its own memory.
        `receive_memory` counts the bytes alive (weakref finalizers on the storages).
        """
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
