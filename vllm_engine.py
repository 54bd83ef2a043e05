"""The vLLM / vllm-ascend engine: this rank's client (the code in vLLM's worker processes, the
receiving side of weight sync, is vllm_worker.py).

vLLM runs in processes it spawns, outside the torchrun world; this rank only sends requests.
Weights reach the worker over `channel.open_channel`, only metadata crosses `collective_rpc`
(docs/vllm.md). vLLM is imported lazily: the pure helpers here need no vLLM installed. Driven
from a worker thread when it runs ahead of the trainers: vllm_ahead.py.
"""
from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import threading
from pathlib import Path

import torch

import channel as CH
import children
import device as D
import failures
import families as F
import inputs as I
import model as M
import routing as R
import sync
import vllm_ahead as A
from errors import ModelError
from episode import Check, Completion, Prompt, Sampling


def vllm_sampling_kwargs(sp: Sampling, tokens: I.Tokens, seed: int) -> dict:
    """`vllm.SamplingParams` arguments for one prompt, equal in effect to HFEngine's.

    Suppressed ids get a logit bias of -inf (before temperature), so processed_logprobs are
    model.py's log_softmax(masked logits / temperature) while top-p / top-k are off. Greedy:
    temperature 0, n=1, logprob at temperature 1 as in HFEngine. Sample j uses seed + j.
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


def vllm_completion(token_ids, logprobs, finish_reason: str | None, routed=None) -> Completion:
    """One of vLLM's `CompletionOutput`s (its token_ids, logprobs, finish_reason and, when it
    captures them, `routed_experts` [prompt + response - 1, L, k]) as a Completion."""
    ids = list(token_ids)
    routing, before = R.from_vllm(routed, len(ids))
    return Completion(ids, [float(lp[t].logprob) for t, lp in zip(ids, logprobs, strict=True)],
                      truncated=finish_reason == "length", routing=routing, prompt_routing=before)


IMAGE_PROCESSOR_SEEN: dict[str, str] = {}  # this process: which image processor vLLM loaded


def _image_only_processor() -> None:
    """Patch `InputProcessingContext.get_hf_processor` (every family's processor goes through
    it) so every vLLM process loads the trainer's PIL image processor class and no video
    processor; why: docs/vllm.md, "The image processor". `_VLLMProcessHook` carries it into
    the spawned processes."""
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
    """`processor_cls` (a Qwen VL processor) built with `video_processor=None`; its
    `video_processor` attribute is the image processor, from which vLLM still sizes a video
    token budget at start-up."""
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
    """`rollout.prefix_caching` -> (on, why); "auto" is off for a model with linear-attention
    layers. `config`: the model's (None: not known yet, a dry run of a hub id)."""
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
    """In vLLM's engine core (not the rank): start the workers by WORKERS_ENV's method."""
    method = os.environ.get(WORKERS_ENV)
    if method and _in_vllm_process():
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method


def _eager_helpers() -> None:
    """In vLLM's processes, where EAGER_ENV asks: TORCH_COMPILE_DISABLE=1's effect, without
    touching the rank (it builds vLLM's config)."""
    if os.environ.get(EAGER_ENV) == "1" and _in_vllm_process():
        import torch._dynamo
        torch._dynamo.config.disable = True


def _cpu_moe_activation() -> None:
    """vLLM 0.23's CPU MoE fallback gets silu(gate) * up as a plain function instead of a
    `SiluAndMul` CustomOp built outside vLLM's config context (docs/families.md, "MoE")."""
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
    """`hf_overrides` that changes nothing: unpickled in every process vLLM spawns, it runs
    `_vllm_process_hook` there before the processor loads (no other code of ours runs there)."""

    def __call__(self, hf_config):
        return hf_config

    def __reduce__(self):
        return (_vllm_process_hook, ())


def _prepare_spawn(start_timeout_s: float | None = None, verbose: bool = False,
                   workers: str = "spawn", eager_helpers: bool = False,
                   cpu_moe_fix: bool = False) -> None:
    """Environment that vLLM's spawned processes inherit, set before this process imports
    vLLM's engine client (it reads its start-up deadline once). `workers`, `eager_helpers`,
    `cpu_moe_fix`: device.Device's vllm_workers, vllm_eager_helpers, vllm_cpu_moe_fix."""
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
    # vLLM's worker imports "vllm_worker.VLLMWorkerExtension" (spawn also passes sys.path).
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
    """vLLM / vllm-ascend generation: an episode.AheadEngine (`generate`, `receive_weights`,
    `shutdown`; `join_weight_channel` once before the syncs; `receive_ahead`, `load_staged`,
    `weights_waiting` while pipeline.Producer drives it). This rank never touches the
    accelerator (vLLM's processes see only its devices)."""
    OWN_CHANNEL = True  # weight data goes to vLLM's worker over channel.open_channel
    STEPS_SHARED = True  # concurrent stepped calls share its steps (vllm_ahead.share_steps)

    @classmethod
    def start_note(cls, rc, config) -> str:
        on, why = prefix_caching(rc.prefix_caching, config)
        return f"vLLM prefix caching {'on' if on else 'off'} ({why})"

    @classmethod
    def from_config(cls, cfg, path: str, procs: I.Processors, *, dev: D.Device,
                    device: torch.device, seed: int, max_images: int = 1) -> "VLLMEngine":
        refuse_npu_nz(dev.kind)
        family = F.get(M.load_config(path).model_type)
        if family.linear_attention and not dev.vllm_linear_attention:
            raise ModelError(f"model.path={path}: {family.label or family.model_type} is not served "
                             f"by this vLLM build on {dev.kind} (its linear-attention kernels fail "
                             "to load there); use rollout.engine = 'hf' here")
        capture = bool(family.router) and dev.vllm_routed_experts  # MoE: each token's experts (routing.py)
        if cfg.model.moe_routing_replay and not capture:
            raise ModelError(f"model.moe_routing_replay: vLLM on {dev.kind} returns no routed experts (its CPU "
                             "build: all zeros, docs/families.md); use rollout.engine = 'hf' here")
        if procs.vision:
            print(f"rank {os.environ.get('RANK', 0)} (generation): trainer image processor "
                  f"{type(procs.image_processor).__name__}; every vLLM process checks it loads "
                  "the same", flush=True)
        return cls(path, procs.tokens, cfg.rollout, cfg.model, seed=seed,
                   timeout_s=cfg.cluster.timeout_s, max_images=max_images if procs.vision else None,
                   verbose=cfg.run.verbose, device_kind=dev.kind,
                   llm_kwargs={**({"enable_return_routed_experts": True} if cfg.model.moe_routing_replay else {}),
                               **(colocated_args(dev) if cfg.cluster.colocate else {})})

    def __init__(self, path: str, tokens: I.Tokens, rc, mc, seed: int,
                 timeout_s: float | None = None, llm_kwargs: dict | None = None,
                 max_images: int | None = 1, verbose: bool = False, device_kind: str | None = None):
        """From `[rollout]` (rc) and `[model]` (mc); `max_images`: per prompt (None: text-only,
        no multimodal arguments); `llm_kwargs`: more `vllm.LLM` arguments (tests); `verbose`:
        vLLM's INFO lines too; `device_kind`: device.TABLE's row (None: this machine's).
        With :func:`colocated_args` among `llm_kwargs` (cluster.colocate) vLLM runs in this
        process on this rank's device, asleep while the trainer trains."""
        self.colocated = (llm_kwargs or {}).get("distributed_executor_backend") == "external_launcher"
        self.asleep: set[str] = set()  # colocated: what `sleep` put to sleep and no wake_up woke
        self.timeout_s = timeout_s  # every collective_rpc (weight channel, weight loading)
        self.who = f"rank {os.environ.get('RANK', 0)} (generation)"
        self.owner = A.Owner(self.who, timeout_s)  # one thread at a time in the LLM
        self.weight_version = 0         # the weights the engine holds: the base until a sync
        self.staged_version: int | None = None  # received into the worker's staging, not loaded
        self.keep = rc.partial == "keep"  # loads mid-batch keep the requests' KV (vllm_ahead.load_kept)
        self.stale_caches = False  # prefix / encoder caches hold the old weights' (keep: reset at a call's end)
        dev = D.TABLE[device_kind] if device_kind else D.detect()
        _prepare_spawn(rc.start_timeout_s, verbose, dev.vllm_workers,
                       eager_helpers=dev.vllm_eager_helpers and rc.enforce_eager,
                       cpu_moe_fix=dev.vllm_cpu_moe_fix)
        os.environ.update(D.vllm_spawn_env(dev))  # V1 model runner; NPU: the engines' dispatch/CPU binding
        _image_only_processor()  # the front end (this process) runs the HF processor too
        from vllm import LLM

        self.tokens = tokens
        # at least one image even for text-only prompts: with every limit 0 vLLM would not build
        # the vision tower, and the weight sync sends it
        mm = ({} if max_images is None else dict(
            limit_mm_per_prompt={"image": max(1, max_images), "video": 0},
            mm_processor_kwargs={"min_pixels": mc.min_pixels, "max_pixels": mc.max_pixels},
            mm_processor_cache_gb=0))  # its text-only HF call fails on transformers 5.x
        self.reaper = children.start_reaper()  # the engine's processes never outlive this rank
        before = set(multiprocessing.active_children())
        kept = D.rng_state(dev) if self.colocated else None  # its worker here reseeds torch's generators
        with _environ_restored(), failures.EngineLog().attached():  # its error in our line
            self.llm = LLM(
                model=path, dtype=mc.dtype, seed=seed,
                tensor_parallel_size=rc.tensor_parallel_size,
                gpu_memory_utilization=rc.gpu_memory_utilization,
                max_model_len=rc.max_model_len, enforce_eager=rc.enforce_eager,
                enable_prefix_caching=prefix_caching(rc.prefix_caching, M.peek_config(path))[0],
                logprobs_mode="processed_logprobs",  # see vllm_sampling_kwargs
                async_scheduling=False,  # as vLLM's CPU build forces: docs/vllm.md
                worker_extension_cls="vllm_worker.VLLMWorkerExtension",
                hf_overrides=_VLLMProcessHook(),
                disable_log_stats=True, **D.vllm_engine_args(dev), **mm, **(llm_kwargs or {}))
        if kept is not None:  # the trainer's random streams as the static split's
            D.set_rng_state(dev, kept)
        # a dead engine core ends this rank at once, naming it (vLLM's client would wait)
        self.watch = children.Watch([p for p in multiprocessing.active_children() if p not in before],
                                    "the vLLM engine's", failures.fail_now)

    def generate(self, rows: list[Prompt], sp: Sampling, seed: int,
                 check: Check | None = None) -> list[list[Completion]]:
        """episode.Engine.generate: `LLM.generate`, or with a check vLLM's engine stepped by
        hand (vllm_ahead.stepped; the same seeds)."""
        if check is not None:
            return A.stepped(self, rows, sp, seed, check)
        from vllm import SamplingParams
        per = 1 if sp.greedy else sp.n
        # row i's samples use seeds seed + i*per + j: distinct across the whole call
        params = [SamplingParams(**vllm_sampling_kwargs(sp, self.tokens, seed + i * per))
                  for i in range(len(rows))]
        inputs = [vllm_prompt(ids, ims, self.tokens) for ids, ims in rows]
        with self.owner.hold():
            outs = self.llm.generate(inputs, params, use_tqdm=False)
        return [[vllm_completion(c.token_ids, c.logprobs, c.finish_reason, c.routed_experts)
                 for c in o.outputs] for o in outs]

    def render(self, prompts: list[Prompt]) -> list:
        """vLLM's processed inputs for `prompts`, as `LLM.generate` makes them (its renderer:
        the image processor, the placeholders' expansion), for `LLMEngine.add_request`."""
        return list(self.llm._preprocess_cmpl([vllm_prompt(ids, ims, self.tokens) for ids, ims in prompts]))

    def stream_params(self, sp: Sampling, seed: int):
        """`SamplingParams` as `generate`'s, streaming each step's new tokens (DELTA): what a
        request had sampled when it is aborted stays known (LLM.generate asks FINAL_ONLY)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        return SamplingParams(**vllm_sampling_kwargs(sp, self.tokens, seed),
                              output_kind=RequestOutputKind.DELTA)

    def _rpc(self, method: str, *args):
        """`collective_rpc(method, args)` within `timeout_s`, in a daemon thread (vLLM's own
        timeout is ignored at tp = 1 and leaves late replies queued at tp > 1); past it the
        engine is stopped and one line names this rank and the method."""
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
        """Join, once, the weight channel trainer rank 0 opens at host:port (blocks until all
        joined): this engine's workers take ranks rank_offset + (0 .. tp-1) of
        world_size = 1 + engines * tp."""
        self._rpc("init_weight_sync", host, port, rank_offset, world_size, self.timeout_s)

    def sleep(self) -> None:
        """Colocated: `LLM.sleep(level=1)`, the weights to host memory and the KV cache freed
        for the train phase (a no-op on vLLM's CPU build, which has no sleep mode)."""
        with self.owner.hold():
            self.llm.sleep(level=1)
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Colocated: `LLM.wake_up(tags)`: "weights" before a sync loads them, "kv_cache" after,
        None for both; what is awake already is left as it is (a resume's first sync)."""
        tags = [t for t in tags or ("weights", "kv_cache") if t in self.asleep]
        if tags:
            with self.owner.hold():
                self.llm.wake_up(tags)
            self.asleep -= set(tags)

    def receive_weights(self, source) -> int:
        """Receive one sync (`source.control()`: version and bucket plan; the buckets go to
        the worker over the weight channel; colocated, `source.buckets()` in this process,
        :meth:`_load_here`), then reset the prefix and encoder caches, computed with the old
        weights. Returns the version received."""
        if self.colocated:
            return self._load_here(source)
        version, plan = source.control()
        with self.owner.hold():
            self._rpc("receive_weights", version, sync.plan_to_plain(plan), source.partial)
            self._loaded(version)
        return version

    def _loaded(self, version: int) -> None:
        """After new weights loaded: no KV or vision features of the old ones are reused. With
        `keep` and requests in flight (they decode on over their KV) the caches are reset when
        the call ends (:meth:`fresh_caches`, by vllm_ahead.stepped): no request is added before."""
        self.stale_caches = True
        if not (self.keep and self.llm.llm_engine.has_unfinished_requests()):
            self.fresh_caches()
        self.weight_version = version

    def fresh_caches(self) -> None:
        """Reset the prefix and encoder caches if a load left them stale (no request running)."""
        if not self.stale_caches:
            return
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
        self.llm.llm_engine.reset_encoder_cache()  # not on `LLM` in vLLM 0.23
        self.stale_caches = False

    def _load_here(self, source) -> int:
        """Colocated: every bucket of `source` (sync.GatheredSource) through one layerwise reload
        of the engine's worker, which the external launcher runs in this process: the tensors
        go by reference, nothing is copied but into vLLM's own weights."""
        version, _ = source.control()
        named = (pair for bucket in source.buckets() for pair in bucket)
        with self.owner.hold():
            self.llm.collective_rpc(_reload_in_process, args=(named, source.partial))
            self._loaded(version)
        return version

    def receive_ahead(self, source, stage: bool) -> int:
        """One sync while a worker thread drives generation (pipeline.Producer), called from
        the rank's main thread; the receive runs inside the LLM (vllm_ahead.Owner.call: at the
        worker's next decode step, or here when it is not generating). `stage`: into staging
        buffers in vLLM's worker, loaded by :meth:`load_staged` (no weight changes mid-batch);
        else loaded at once, the batch's requests aborted first (partial rollouts), or with
        `keep` kept (vllm_ahead.load_kept)."""
        version, plan = source.control()
        plain, partial = sync.plan_to_plain(plan), source.partial

        def receive():
            self._rpc("receive_weights", version, plain, partial, stage)
            if stage:
                self.staged_version = version
            else:
                self._loaded(version)
        self.owner.call(receive, empty=not stage and not self.keep)
        return version

    def weights_waiting(self) -> bool:
        """A receive posted by :meth:`receive_ahead` waits for the worker thread's next check."""
        return bool(self.owner.tasks)

    def load_staged(self) -> int | None:
        """Load what :meth:`receive_ahead` staged (a batch's start); its version, or None
        when nothing is staged."""
        if self.staged_version is None:
            return None
        with self.owner.hold():
            version, self.staged_version = self.staged_version, None
            if version is not None:
                self._rpc("load_staged")
                self._loaded(version)
        return version

    def shutdown(self) -> None:
        """Stop vLLM's processes (also done at interpreter exit)."""
        llm, self.llm = getattr(self, "llm", None), None
        if getattr(self, "watch", None) is not None:
            self.watch.stop()
        if llm is not None and getattr(self, "colocated", False):  # in this process: its engine
            llm.llm_engine.model_executor.shutdown()  # core's teardown would end the rank's world
        elif llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if getattr(self, "reaper", None) is not None:  # nothing left to reap
            self.reaper.kill()
            self.reaper.wait()


def colocated_args(dev: D.Device) -> dict:
    """`vllm.LLM` arguments of a colocated engine (cluster.colocate): vLLM's external launcher
    runs its one worker in this process (TRL's colocate mode; every rank builds its engine at
    the same point, so the process groups vLLM makes over the torchrun world are made on every
    rank in one order; each rank its own tensor-parallel group of one), with sleep mode where
    the device has it (Device.vllm_sleep_mode)."""
    _quiet_cpu_worker()
    return {"distributed_executor_backend": "external_launcher",
            "enable_sleep_mode": dev.vllm_sleep_mode}


def _reload_in_process(worker, named, partial: bool) -> None:
    """Run by a colocated engine's worker (in the rank's process): `named` through vLLM's
    layerwise reload, as vllm_worker's receive does with what it received."""
    from vllm_worker import PartialReload
    with torch.device(worker.device), PartialReload(partial):
        worker.model_runner.reload_weights(weights_iterator=named, is_checkpoint_format=True)
    D.synchronize(D.TABLE[worker.device.type])


class _CpuWorkerNotes(logging.Filter):
    """vLLM's CPU worker, in the rank's process (colocated), warns at every sleep and wake-up
    that it ignores them, and at every request that vLLM's own renderer may not change torch's
    thread count after its binding: lines every step, said once in docs/colocate.md instead."""
    NOTES = ("sleep mode is not supported on CPU", "doesn't allow to use `torch.set_num_threads`")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.NOTES)


def _quiet_cpu_worker() -> None:
    log = logging.getLogger("vllm.v1.worker.cpu_worker")
    if not any(isinstance(f, _CpuWorkerNotes) for f in log.filters):
        log.addFilter(_CpuWorkerNotes())


def refuse_npu_nz(kind: str) -> None:
    """Before vLLM starts: vllm-ascend's FRACTAL_NZ weights (VLLM_ASCEND_ENABLE_NZ != 0) would
    take a plain-layout update silently wrong (the worker checks the resolved mode too)."""
    if kind == "npu" and os.environ.get("VLLM_ASCEND_ENABLE_NZ", "1") != "0":
        raise RuntimeError(f"VLLM_ASCEND_ENABLE_NZ={os.environ.get('VLLM_ASCEND_ENABLE_NZ', '1 (unset)')}: "
                           "weight sync needs VLLM_ASCEND_ENABLE_NZ=0 (source launch/npu_env.sh)")
