"""Rollout: the `Episode` record and the inference engines that produce it.

`Episode` is the only thing that crosses from generation to training. An engine turns prompts
(token ids with one unexpanded image placeholder per image, plus PIL images) into G sampled
responses each, with the generation-time logprob of every sampled token (convention in
model.py). `rollout()` runs an engine on a step's problems and scores the responses with the
reward functions: the trainer never calls a reward function.

Engines:
- `HFEngine`: transformers `generate`, any device; what the CPU tests and demo use.
- `VLLMEngine`: vLLM / vllm-ascend in vLLM's own spawned engine process (see its docstring).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import model as M
import rewards


@dataclass
class Episode:
    index: int                  # dataset index of the problem; its image is looked up by it
    group: int                  # prompt number within the step; the G samples of a prompt share it
    prompt_ids: list[int]       # chat prompt, ONE unexpanded placeholder per image
    response_ids: list[int]     # sampled tokens, eos included when sampled
    logprobs: list[float]       # engine's logprob of each response token
    reward: float               # weighted total of the reward functions
    parts: dict[str, float]     # each reward part (accuracy, format, errors, ...)
    version: int                # weight version the engine generated with
    truncated: bool             # stopped by max_new_tokens, not by eos
    text: str = ""              # decoded response, for samples.jsonl and debugging


@dataclass(frozen=True)
class Sampling:
    """Sampling knobs, always passed explicitly (transformers otherwise defaults top_k to 50)."""
    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    greedy: bool = False


@dataclass
class Completion:
    ids: list[int]
    logprobs: list[float]
    truncated: bool


Prompt = tuple[list[int], list]  # (unexpanded token ids, PIL images)


class HFEngine:
    """transformers generation on this rank's device, with its own copy of the weights."""

    def __init__(self, path: str, dtype: torch.dtype, tokens: M.Tokens, image_processor,
                 device: torch.device):
        self.model = M.load_model(path, dtype=dtype, device=device).eval()
        self.tokens, self.image_processor, self.device = tokens, image_processor, device

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], sp: Sampling, seed: int) -> list[list[Completion]]:
        tk = self.tokens
        images = [im for _, ims in prompts for im in ims]
        mm = M.image_inputs(self.image_processor, images)
        counts = iter(M.n_image_tokens(mm["image_grid_thw"]))
        rows = [M.expand_images(ids, [next(counts) for _ in ims], tk.image_pad) for ids, ims in prompts]
        width = max(map(len, rows))
        # Left padding: every row's last prompt token sits at the same column, so generated
        # tokens line up; transformers derives positions (mRoPE) from the attention mask.
        ids = torch.tensor([[tk.pad] * (width - len(r)) + r for r in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        knobs = (dict(do_sample=False) if sp.greedy else
                 dict(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k))
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids, attention_mask=mask,
                pixel_values=mm["pixel_values"].to(self.device, self.model.dtype),
                image_grid_thw=mm["image_grid_thw"].to(self.device),
                mm_token_type_ids=(ids == tk.image_pad).int(),
                num_return_sequences=1 if sp.greedy else sp.n, max_new_tokens=sp.max_new_tokens,
                suppress_tokens=list(tk.suppressed), eos_token_id=tk.eos, pad_token_id=tk.pad,
                output_logits=True, return_dict_in_generate=True, **knobs)
        resp = out.sequences[:, width:]                                   # [P*n, T]
        logits = torch.stack(out.logits, 1)                               # [P*n, T, V] raw
        temp = 1.0 if sp.greedy else sp.temperature
        lp, _ = M.token_logprobs(logits, resp, tk, temp)
        per_prompt = 1 if sp.greedy else sp.n
        result: list[list[Completion]] = [[] for _ in prompts]
        for row in range(resp.shape[0]):
            r = resp[row].tolist()
            n = r.index(tk.eos) + 1 if tk.eos in r else len(r)
            result[row // per_prompt].append(
                Completion(r[:n], lp[row, :n].tolist(), truncated=tk.eos not in r[:n]))
        return result

    @torch.no_grad()
    def load_weights(self, named: list[tuple[str, torch.Tensor]], adopt: bool = False) -> None:
        """Copy `named` into the model, or with `adopt` make the tensors the model's storage
        (they must outlive the model's use of them: sync.Receiver's buffers do, and later syncs
        then write the new weights in place with no copy at all)."""
        params = dict(self.model.named_parameters())
        for name, t in named:
            p = params[name]
            if adopt and t.dtype == p.dtype and t.device == p.device and t.shape == p.shape:
                if p.data_ptr() != t.data_ptr():
                    p.data = t
            else:
                p.copy_(t)

    def named_parameters(self):
        return self.model.named_parameters()


def rollout(engine, problems: list, tokenizer, tokens: M.Tokens, sp: Sampling, template: str,
            reward_functions: list[dict], reward_timeout_s: float, version: int,
            group_offset: int, seed: int) -> tuple[list[Episode], dict[str, float]]:
    """Generate sp.n responses for each problem and score them. Returns (episodes, timings)."""
    from data import user_text
    prompts = [(M.prompt_ids(tokenizer, user_text(p, template), 1, tokens), [p.image])
               for p in problems]
    t0 = time.perf_counter()
    completions = engine.generate(prompts, sp, seed) if prompts else []
    t_gen = time.perf_counter() - t0
    episodes = []
    for g, (p, (ids, _), comps) in enumerate(zip(problems, prompts, completions)):
        for c in comps:
            text = tokenizer.decode(c.ids, skip_special_tokens=True)
            sample = {"answer": p.answer, "index": p.index, "response_len": len(c.ids),
                      "truncated": c.truncated, "max_new_tokens": sp.max_new_tokens}
            parts = rewards.score(text, sample, reward_functions, reward_timeout_s)
            total = parts.pop("reward")
            episodes.append(Episode(p.index, group_offset + g, ids, c.ids, c.logprobs, total,
                                    parts, version, c.truncated, text))
    return episodes, {"generate_s": t_gen, "reward_s": time.perf_counter() - t0 - t_gen}


# ============================================================================= vLLM engine
# vLLM runs in processes of its own that it SPAWNS (engine core; on CPU also a separate worker);
# this process (a torchrun rank with torch.distributed initialised) only sends them requests.
# A spawned process starts with fresh interpreter state, so vLLM builds a private one-rank world
# there and never sees the torchrun world. The pure helpers below need no vLLM installed.
import contextlib  # noqa: E402  (imports of this section, kept with it)
import importlib.util  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import device as D  # noqa: E402
import sync  # noqa: E402


def vllm_sampling_kwargs(sp: Sampling, tokens: M.Tokens, seed: int) -> dict:
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
              stop_token_ids=[tokens.eos],
              detokenize=False)  # rollout() decodes; vLLM's detokenizer would only cost time
    if sp.greedy:
        return kw | dict(n=1, temperature=0.0)
    return kw | dict(n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k)


def vllm_prompt(ids: list[int], images: list, tokens: M.Tokens) -> dict:
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


def _image_only_processor() -> None:
    """Let vLLM load Qwen2.5-VL's HF processor where torchvision is missing (the CPU build).

    transformers 5.x loads a video processor with every Qwen2_5_VLProcessor, and the only one
    it has needs torchvision. A subclass without the `video_processor` argument loads from the
    same folder with the same image processor; videos are off (limit_mm_per_prompt). Needed in
    every vLLM process (the front end here, the engine core, the worker): `_VLLMProcessHook`
    carries it into the spawned ones. With torchvision installed this does nothing.
    """
    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLProcessingInfo

    if getattr(Qwen2_5_VLProcessingInfo.get_hf_processor, "image_only", False):
        return

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template, **kwargs)

    def get_hf_processor(self, **kwargs):
        kwargs.pop("use_fast", None)  # a torchvision switch; the PIL image processor is used
        return self.ctx.get_hf_processor(ImageOnlyQwen2_5_VLProcessor, **kwargs)

    get_hf_processor.image_only = True
    Qwen2_5_VLProcessingInfo.get_hf_processor = get_hf_processor


def _vllm_process_hook() -> "_VLLMProcessHook":
    _image_only_processor()
    return _VLLMProcessHook()


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


def _prepare_spawn() -> None:
    """Environment that vLLM's spawned processes inherit; set before vLLM starts them."""
    # fork would copy this rank's threads, process groups and accelerator state.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    # torchrun sets it; torch's tcp:// rendezvous (vLLM's private world) then never starts a
    # store of its own and waits forever for torchrun's.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    # vLLM's worker imports "rollout.VLLMWorkerExtension" (spawn also passes sys.path).
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
    accelerator itself (narrow the visible devices before constructing: device.narrow_visible).
    Weights arrive straight in the worker over a communicator of their own (sync.open_channel):
    `init_weight_sync` once, then `receive_weights` per sync; only metadata crosses
    `collective_rpc`. Same `generate` as HFEngine.
    """

    def __init__(self, path: str, dtype, tokens: M.Tokens, rollout_cfg, min_pixels: int,
                 max_pixels: int, seed: int, timeout_s: float | None = None):
        self.timeout_s = timeout_s  # every collective_rpc (weight channel, weight loading)
        _prepare_spawn()
        _image_only_processor()  # the front end (this process) runs the HF processor too
        from vllm import LLM

        rc = rollout_cfg
        self.tokens = tokens
        with _environ_restored():
            self.llm = LLM(
                model=path, dtype=str(dtype).removeprefix("torch."), seed=seed,
                tensor_parallel_size=rc.tensor_parallel_size,
                gpu_memory_utilization=rc.gpu_memory_utilization,
                max_model_len=rc.max_model_len, enforce_eager=rc.enforce_eager,
                enable_prefix_caching=True,  # the G samples of a prompt share its KV
                limit_mm_per_prompt={"image": 1, "video": 0},
                mm_processor_kwargs={"min_pixels": min_pixels, "max_pixels": max_pixels},
                # vLLM's processor cache runs the HF processor on text alone, which transformers
                # 5.x rejects for text with image placeholders; the encoder cache still
                # shares one image's features among its G samples.
                mm_processor_cache_gb=0,
                logprobs_mode="processed_logprobs",  # see vllm_sampling_kwargs
                worker_extension_cls="rollout.VLLMWorkerExtension",
                hf_overrides=_VLLMProcessHook(),
                disable_log_stats=True)

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

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join the weight channel that trainer rank 0 opens at host:port as its rank 0.

        Blocks until every member joined (trainer rank 0 calls sync.open_channel concurrently).
        This engine's workers take ranks rank_offset + (0 .. tensor_parallel_size-1);
        world_size = 1 + (number of engines) * tensor_parallel_size. Call once.
        """
        self.llm.collective_rpc("init_weight_sync", timeout=self.timeout_s,
                                args=(host, port, rank_offset, world_size))

    def receive_weights(self, version: int, plan) -> None:
        """Receive one sync (trainer rank 0 is sending concurrently) and drop stale caches.

        `plan`: sync.Sender's bucket plan (list of buckets of sync.Slot). After new weights the
        prefix cache's KV and the encoder cache's vision features (keyed by image hash: GRPO
        sees every image again next epoch) were computed with the old weights.
        """
        self.llm.collective_rpc("receive_weights", timeout=self.timeout_s,
                                args=(version, sync.plan_to_plain(plan)))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
        self.llm.llm_engine.reset_encoder_cache()  # not on `LLM` in vLLM 0.23

    def shutdown(self) -> None:
        """Stop vLLM's processes (also done at interpreter exit)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


class VLLMWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); runs in vLLM's worker process.

    Its methods are called by name through `llm.collective_rpc`. `self.device`, `self.rank` and
    `self.model_runner` are the worker's own.
    """

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        # the communicator of this worker's device kind, as trainer rank 0 picks by its own
        comm = D.TABLE[self.device.type].comm
        self.weight_channel = sync.open_channel(comm, host, port, rank_offset + self.rank,
                                                world_size, self.device)
        self.weight_buffer = torch.empty(0, dtype=torch.uint8, device=self.device)

    def receive_weights(self, version: int, plan: list) -> int:
        """Receive every bucket of `plan` (plain data) and load it. Returns the tensor count."""
        buckets = sync.plan_from_plain(plan)
        size = max(sync.bucket_size(b) for b in buckets)
        if self.weight_buffer.numel() < size:
            self.weight_buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        named = self.weight_stream(buckets)
        if self.device.type == "cpu":
            # CPU linear layers are repacked for oneDNN at load (their `weight` emptied):
            # only a reload re-runs that processing. It keeps a layer's tensors until the layer
            # is complete, so weight_stream hands it copies.
            self.model_runner.reload_weights(weights_iterator=named, is_checkpoint_format=True)
        else:
            self.model_runner.get_model().load_weights(weights=named)
        self.weight_version = version
        return sum(len(b) for b in buckets)

    def weight_stream(self, buckets: list):
        """(HF name, tensor) of every bucket, received in order into the reused buffer."""
        copy = self.device.type == "cpu"
        for bucket in buckets:
            buf = self.weight_buffer[:sync.bucket_size(bucket)]
            self.weight_channel.broadcast(buf).wait()
            for name, t in sync.unpack(buf, bucket):
                yield name, (t.clone() if copy else t)  # views are overwritten by the next bucket
