"""The policy model: loading any supported family, the tiny random ones, prompts, logprobs, FSDP2.

Owns everything that touches the model's structure, so that train.py, rollout.py and sync.py
stay free of it. What differs between families is in families.py (one table); everything here
asks the config or the model:
- a config with a `vision_config` is a vision-language model (AutoModelForImageTextToText, an
  image processor, image token ids from the config); without one it is a text LLM
  (AutoModelForCausalLM; no vision tower or image processor is ever built or loaded);
- positions: the model's own `get_rope_index` (mRoPE) where it has one, else 1-D;
- FSDP units: the model's `_no_split_modules` (its decoder layers and vision blocks);
- one packed row per prompt is exact only when every text layer is full attention
  (:func:`packs_exactly`: linear-attention layers see the whole row);
- MoE experts, fused in memory by transformers 5 (`experts.gate_up_proj [E, 2I, H]`,
  `experts.down_proj [E, H, I]`), go to the engines per expert (:func:`checkpoint_pieces`).

- `build_tiny(dir, model_type=...)`: a randomly initialised tiny model of a family with a locally
  made byte-level tokenizer, the family's chat template and (VLMs) an image-processor config,
  written as an ordinary Hugging Face folder. The CPU demos and every test use them.
- `Processors`: what the engines and the trainer must agree on (tokenizer, token ids, image
  processor, chat template with `data.system_prompt` / `data.enable_thinking`).
- `prompt_ids` / `expand_images`: the prompt rendered by the model's own chat template, with ONE
  unexpanded placeholder per image (what vLLM wants), or expanded to each image's patch count
  (what transformers wants).
- `sequence_logprobs`: the trainer's forward pass, with the positions the engine used.
- `apply_fsdp` / `shard_from_rank0`: FSDP2 over the trainer-only mesh, the weights read once
  (trainer rank 0) and scattered, so a trainer node holds about one host copy of the model.

Logprob convention (engine and trainer alike): log softmax of `logits / temperature` over the
full vocabulary with the suppressed ids removed, i.e. the policy that sampling draws from before
top-p / top-k truncation (as verl does). Top-p / top-k therefore make the engine sample from a
slightly different distribution than the one the loss sees; keep them off (the defaults) for
exact on-policy training.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import families as F
from errors import ModelError, one_line

IMAGE_MARKER = "<image>"  # in a problem or template: where an image goes (else images come first)
TINY = F.TINY  # `[model] path = "tiny"` builds the random tiny Qwen2.5-VL in the run folder;
#               "tiny-<model_type>" a tiny model of that family
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_tiny(out_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2,
               model_type: str = F.DEFAULT_TINY) -> Path:
    """Write a random tiny model of `model_type`, its tokenizer, chat template and (VLMs) image
    processor to `out_dir`.

    Deterministic in `seed`. The tokenizer is byte-level (256 byte tokens, no merges) plus the
    Qwen chat / vision special tokens and `<think>`, `</think>`, `<answer>`, `</answer>` as single
    tokens, so a tiny policy can learn the answer format. Returns the folder. Safe to call from
    several processes at once (a file lock; the folder appears complete or not at all).
    """
    F.get(model_type)
    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    import fcntl
    with open(out.with_name(out.name + ".lock"), "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").exists():
            _build_tiny(out, seed, hidden, layers, model_type)
    return out


def _tiny_tokenizer(model_type: str):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _TINY_SPECIALS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False)
                    for s in ["<think>", "</think>", "<answer>", "</answer>"]])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = F.get(model_type).chat_template
    return tokenizer


def _build_tiny(out: Path, seed: int, hidden: int, layers: int, model_type: str) -> None:
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer(model_type)
    tokenizer.save_pretrained(tmp)
    conv = tokenizer.convert_tokens_to_ids
    ids = dict(vocab=len(tokenizer), pad=conv("<|endoftext|>"), eos=conv("<|im_end|>"),
               image_pad=conv("<|image_pad|>"), video_pad=conv("<|video_pad|>"),
               vision_start=conv("<|vision_start|>"), vision_end=conv("<|vision_end|>"))
    config = F.tiny_config(model_type, ids, hidden, layers)
    torch.manual_seed(seed)
    model = _auto_class(config).from_config(config).to(torch.float32)
    config.architectures = [type(model).__name__]
    # transformers' default init (std 0.02) gives a nearly uniform policy; a larger init makes
    # the tiny random model's samples varied enough for GRPO groups to disagree (the embeddings
    # too where they are the LM head as well: tied)
    tied = _ties(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and ("embed" not in name or tied):
                p.normal_(0.0, 0.08)
    # Written directly (transformers' save_pretrained silently skips non-zero ranks once
    # torch.distributed is initialised, and any rank may be the one building), in the checkpoint
    # layout a hub folder of the family has (MoE experts per expert), as save_pretrained would.
    write_weights(tmp, model, model.state_dict(), torch.float32)
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    if is_vlm(config):
        v = config.vision_config
        image_processor_cls()(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=v.patch_size,
                              merge_size=v.spatial_merge_size,
                              temporal_patch_size=v.temporal_patch_size).save_pretrained(tmp)
    (tmp / "README.md").write_text(f"Random tiny {type(model).__name__} built by model.build_tiny "
                                   f"(seed {seed}); for tests and the CPU demos only.\n")
    tmp.rename(out)  # atomic: a half-written folder is never seen as the model


def write_weights(folder: Path, model, state: dict, dtype: torch.dtype) -> None:
    """`state` (the model's in-memory names) as `model.safetensors` in the checkpoint layout of
    the family's hub folders (transformers' `revert_weight_conversion`, as `save_pretrained`), so
    transformers and vLLM load it as they load a released model; tied weights are written once.

    One mend: transformers 5.24 reverses a load-time `Transpose(check_dims=True)` (Qwen3-VL-MoE's
    fused experts: hub [E, H, 2I], memory [E, 2I, H]) by comparing the tensor with the in-memory
    shape, which always matches, so save_pretrained writes the memory layout; vLLM's loader then
    transposes it wrongly. Reversed, such an op always transposes here (transformers still loads
    it: its check sees the hub shape)."""
    from safetensors.torch import save_file
    from transformers import core_model_loading as cml
    tied = set(getattr(model, "_tied_weights_keys", None) or {}) if _ties(model.config) else set()
    state = {k: v for k, v in state.items() if k not in tied}  # safetensors refuses shared storage
    reverse = cml.Transpose.reverse_op
    cml.Transpose.reverse_op = property(lambda op: cml.Transpose(op.dim1, op.dim0, check_dims=False))
    try:
        state = cml.revert_weight_conversion(model, state)
    finally:
        cml.Transpose.reverse_op = reverse
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()},
              str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})


def _ties(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False) or
                getattr(getattr(config, "text_config", None), "tie_word_embeddings", False))


def resolve_path(path: str, run_dir: Path, seed: int) -> str:
    """`"tiny"` / `"tiny-<model_type>"` -> build (once) that tiny random model under the run
    folder ("tiny-model" / "tiny-<model_type>"); else `path`."""
    kind = F.tiny_type(path)
    if kind is None:
        return path
    folder = run_dir / ("tiny-model" if path == TINY else path)
    return str(build_tiny(folder, seed=seed, model_type=kind))


# ----------------------------------------------------------------------------- what a model is
def load_config(path: str):
    """The model's config; ModelError naming `model.path` when its family is not in the table."""
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - an unknown model_type, a broken config.json, ...
        kind = F.model_type_of(path)
        if kind and kind not in F.FAMILIES:
            raise ModelError(_unsupported(path, kind)) from None
        raise ModelError(f"model.path={path}: cannot read its config ({one_line(e, 240, typed=False)})") from None
    if config.model_type not in F.FAMILIES:
        raise ModelError(_unsupported(path, config.model_type))
    return config


def _unsupported(path: str, kind: str) -> str:
    return (f"model.path={path}: model_type {kind!r} is not a supported family (supported: "
            f"{', '.join(F.supported())})")


is_vlm = F.is_vlm  # a vision-language model: its config has a vision tower


def text_config(config):
    return getattr(config, "text_config", None) or config


def has_linear_attention(config) -> bool:
    """Whether some text layer is not full attention (Qwen3.5's Gated DeltaNet layers): such a
    layer carries a recurrent state over the whole row and takes no 4D mask."""
    kinds = getattr(text_config(config), "layer_types", None) or ["full_attention"]
    return any(k != "full_attention" for k in kinds)


def packs_exactly(config) -> bool:
    """One packed row per prompt (train.share_prompt) equals one row per episode only when every
    text layer is full attention: a linear-attention layer runs over the whole row, so a
    response would see the responses before it."""
    return not has_linear_attention(config)


def peek_config(path: str):
    """The config of `path` without building or downloading anything: a local folder's, a tiny
    family's (`tiny-<model_type>`, ids of no consequence), else None (a hub id: read at start)."""
    kind = F.tiny_type(path)
    if kind is not None:
        if kind not in F.FAMILIES:
            return None
        ids = dict(vocab=300, pad=0, eos=1, image_pad=2, video_pad=3, vision_start=4, vision_end=5)
        return F.tiny_config(kind, ids)
    return load_config(path) if (Path(path) / "config.json").is_file() else None


def _auto_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if is_vlm(config) else AutoModelForCausalLM


# ----------------------------------------------------------------------------- processors
def image_processor_cls():
    # The one image processor class on every device and family, in the trainer and (forced and
    # checked by vllm_engine.checked_processor) in every vLLM process: the torchvision-backed one
    # cannot import beside the CPU torch build, and its pixels differ slightly from the PIL one's.
    # Every Qwen VLM family uses this class; its patch and merge sizes come from the folder.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def load_image_processor(path: str, min_pixels: int, max_pixels: int):
    """The model's image processor with the run's pixel bounds (shared with every engine)."""
    return image_processor_cls().from_pretrained(path, min_pixels=min_pixels, max_pixels=max_pixels)


@dataclass(frozen=True)
class Chat:
    """How a prompt is rendered: the model's own chat template, the system turn
    (`data.system_prompt`, "" = the template's own behaviour) and `data.enable_thinking` (None =
    the template's default; passed only to a template that reads it)."""
    template: str
    system_prompt: str = ""
    enable_thinking: bool | None = None

    @property
    def takes_thinking(self) -> bool:
        return "enable_thinking" in self.template


@dataclass(frozen=True)
class Processors:
    """What the engines and the trainer must agree on: the tokenizer, the token ids, the image
    processor with the run's pixel bounds (None for a text-only model) and the chat template."""
    tokenizer: Any
    tokens: "Tokens"
    image_processor: Any
    chat: Chat
    packs_exactly: bool = True    # see :func:`packs_exactly`

    @property
    def vision(self) -> bool:
        return self.image_processor is not None


def chat_template(path: str, tokenizer) -> str:
    """The model's chat template: the tokenizer's, else the processor's file in the folder
    (`chat_template.jinja` / `chat_template.json`, where the VLM releases keep it)."""
    if tokenizer.chat_template:
        return tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else \
            tokenizer.chat_template.get("default", "")
    folder = Path(path)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template", "")
    return ""


def load_processors(path: str, min_pixels: int, max_pixels: int, system_prompt: str = "",
                    enable_thinking: bool | None = None) -> Processors:
    """Everything prompts and batches need, from the model folder; ModelError (one line naming
    `model.path`) for an unsupported family, a missing chat template or one that fails to
    render."""
    config = load_config(path)
    tokenizer = load_tokenizer(path)
    template = chat_template(path, tokenizer)
    if not template:
        raise ModelError(f"model.path={path}: no chat template (tokenizer_config.json, "
                         "chat_template.jinja or chat_template.json); prompts are rendered with "
                         "the model's own template")
    ip = load_image_processor(path, min_pixels, max_pixels) if is_vlm(config) else None
    procs = Processors(tokenizer, Tokens.of(tokenizer, config, _stops(path, tokenizer)), ip,
                       Chat(template, system_prompt, enable_thinking), packs_exactly(config))
    try:  # fail now, naming the model, rather than at the first row
        prompt_ids(procs, "1 + 1 = ?", 1 if procs.vision else 0)
    except Exception as e:  # noqa: BLE001 - Jinja raises many types
        raise ModelError(f"model.path={path}: its chat template fails to render a prompt "
                         f"({one_line(e, 240, typed=False)}); check data.system_prompt / data.enable_thinking") from None
    return procs


def processors(path: str, mc, dc) -> Processors:
    """:func:`load_processors` with the run's pixel bounds (`[model]` mc) and prompt settings
    (`[data]` dc), refusing a dataset with images for a text-only model (ModelError)."""
    procs = load_processors(path, mc.min_pixels, mc.max_pixels, dc.system_prompt,
                            dc.enable_thinking)
    import data
    if not procs.vision and (dc.source == "synthetic" or (dc.images_column and
                                                          dc.source not in data.SYNTHETIC)):
        raise ModelError(f"model.path={mc.path} is a text-only model: the dataset's images have "
                         "nowhere to go; use a text-only set (data.images_column = \"\", or "
                         f"data.source = \"synthetic-text\"), got data.source={dc.source!r}, "
                         f"data.images_column={dc.images_column!r}")
    return procs


def _stops(path: str, tokenizer) -> list[int]:
    """The ids that end a response: the generation config's eos ids, else the tokenizer's eos."""
    from transformers import GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError):
        eos = None
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return eos or [tokenizer.eos_token_id]


@dataclass(frozen=True)
class Tokens:
    """Token ids both engines and the trainer agree on (image ids: -1 on a text-only model)."""
    image_pad: int
    vision_start: int
    vision_end: int
    eos: int                        # the primary stop id (also the pad fallback)
    pad: int
    vocab_size: int                 # the model's output width (may exceed the tokenizer's)
    suppressed: tuple[int, ...]     # never sampled: special tokens other than the stops, unused rows
    stops: tuple[int, ...] = ()     # every id that ends a response (eos first)

    @staticmethod
    def of(tokenizer, config, stops: list[int] | None = None) -> "Tokens":
        stops = list(dict.fromkeys(stops or [tokenizer.eos_token_id]))
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id in stops else stops[0]
        stops = [eos] + [s for s in stops if s != eos]
        vocab = text_config(config).vocab_size
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        # A random model samples vision placeholders and chat markers; the trainer's re-encoding
        # would then see image tokens without images. Suppress them on both sides (TRL does).
        suppressed = sorted((special - set(stops)) | set(range(len(tokenizer), vocab)))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        ids = [getattr(config, k, None) for k in ("image_token_id", "vision_start_token_id",
                                                  "vision_end_token_id")]
        ids = [-1 if i is None else int(i) for i in ids]
        return Tokens(*ids, eos, pad, vocab, tuple(suppressed), tuple(stops))


# ----------------------------------------------------------------------------- prompts
def chat_messages(user_text: str, n_images: int, system_prompt: str = "",
                  vision: bool = True) -> list[dict]:
    """The chat messages of one prompt: an optional system turn, then the user turn with
    `n_images` image items where `user_text` has `<image>` markers (in order), else first. A
    marker count other than `n_images` is a ValueError (more images than placeholders, or
    fewer)."""
    parts = user_text.split(IMAGE_MARKER)
    markers = len(parts) - 1
    if markers and markers != n_images:
        raise ValueError(f"{n_images} image(s) for {markers} {IMAGE_MARKER} placeholder(s)")
    if not vision:
        if n_images:
            raise ValueError(f"{n_images} image(s) for a text-only model")
        content: Any = user_text
    elif markers:
        content = [item for i, text in enumerate(parts)
                   for item in ([{"type": "image"}] if i else []) + ([{"type": "text", "text": text}]
                                                                     if text else [])]
    else:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": user_text}]
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return system + [{"role": "user", "content": content}]


def prompt_ids(procs: Processors, user_text: str, n_images: int) -> list[int]:
    """The prompt's token ids, rendered by the model's chat template (with the generation
    prompt), with ONE unexpanded image placeholder per image."""
    chat = procs.chat
    kw = ({"enable_thinking": chat.enable_thinking}
          if chat.enable_thinking is not None and chat.takes_thinking else {})
    text = procs.tokenizer.apply_chat_template(
        chat_messages(user_text, n_images, chat.system_prompt, procs.vision),
        chat_template=chat.template, tokenize=False, add_generation_prompt=True, **kw)
    ids = procs.tokenizer.encode(text, add_special_tokens=False)
    if procs.vision and ids.count(procs.tokens.image_pad) != n_images:
        raise ValueError(f"the chat template rendered {ids.count(procs.tokens.image_pad)} image "
                         f"placeholder(s) for {n_images} image(s)")
    return ids


def image_inputs(image_processor, images: list, cache: dict | None = None) -> dict[str, torch.Tensor]:
    """pixel_values [sum patches, C*T*P*P] and image_grid_thw [n_images, 3] for PIL images ({}
    for none).

    `cache` (keyed by `id(image)`, so it holds the images alive: keep it as long as the dataset):
    each image is processed once per run instead of once per step and micro-batch."""
    if not images:
        return {}
    if cache is None:
        out = image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    for im in images:
        if id(im) not in cache:
            one = image_processor(images=[im], return_tensors="pt")
            cache[id(im)] = (im, one["pixel_values"], one["image_grid_thw"])
    return {"pixel_values": torch.cat([cache[id(im)][1] for im in images]),
            "image_grid_thw": torch.cat([cache[id(im)][2] for im in images])}


def n_image_tokens(grid_thw: torch.Tensor | None, merge_size: int = 2) -> list[int]:
    """Image tokens each image of `grid_thw` becomes once its patches are merged."""
    return [] if grid_thw is None else [int(g.prod()) // merge_size ** 2 for g in grid_thw]


def n_image_tokens_of(image_processor, image) -> int:
    """Image tokens one PIL image becomes (without running the processor on its pixels)."""
    ip = image_processor
    return ip.get_number_of_image_patches(image.height, image.width, {}) // ip.merge_size ** 2


def image_tokens(procs: Processors, images: list) -> int:
    """Tokens `images` take in a prompt once expanded (0 for none)."""
    return sum(n_image_tokens_of(procs.image_processor, im) for im in images)


def prompt_len(procs: Processors, user_text: str, images: list) -> int:
    """Tokens of the chat prompt once its image placeholders are expanded."""
    return len(prompt_ids(procs, user_text, len(images))) - len(images) + image_tokens(procs, images)


def expand_images(ids: list[int], counts: list[int], image_pad: int) -> list[int]:
    """Repeat the i-th image placeholder counts[i] times (transformers' expanded form)."""
    if ids.count(image_pad) != len(counts):
        raise ValueError(f"{ids.count(image_pad)} image placeholders for {len(counts)} images")
    if not counts:
        return list(ids)
    out: list[int] = []
    it = iter(counts)
    for t in ids:
        out.extend([t] * next(it) if t == image_pad else [t])
    return out


def _vision_inputs(procs: Processors, images: list, pixels: dict | None) -> tuple[dict, list[int]]:
    """(pixel_values / image_grid_thw, each image's token count) of `images` ({} and [] for none)."""
    if not images:
        return {}, []
    mm = image_inputs(procs.image_processor, images, pixels)
    return mm, n_image_tokens(mm["image_grid_thw"], procs.image_processor.merge_size)


def collate(episodes, images: list[list], procs: Processors, device: torch.device,
            share_prompt: bool = False, pixels: dict | None = None) -> dict[str, torch.Tensor]:
    """Trainer batch of `episodes` (`images[i]`: episode i's images, in prompt order, maybe none),
    for :func:`sequence_logprobs`.

    Both layouts give `response_mask` and `engine_logprobs` [B, T] in episode order (1 on response
    tokens; the engine's logprob of each), aligned with what :func:`sequence_logprobs` returns,
    plus input_ids, attention_mask [rows, W] (1 on real tokens), pixel_values and image_grid_thw
    (when there are images), and episode_tokens (prompt + response tokens of every episode,
    however laid out).
    - one row per episode (`share_prompt=False`): prompt + response, right-padded; T = W.
    - one row per prompt (`share_prompt=True`, :func:`pack`): consecutive episodes with the same
      prompt share one copy of it, followed by each response; an attention mask lets every
      response see the prompt and itself only, so the result equals one row per episode while the
      prompt (and its images) is encoded once per group instead of G times. T = longest response.
      Only for models whose layers all take the mask (:func:`packs_exactly`).
    `pixels`: a cache of processed images by `id(image)` (the trainer keeps one per run).
    """
    if share_prompt:
        return pack(episodes, images, procs, device, pixels)
    tokens = procs.tokens
    mm, counts = _vision_inputs(procs, [im for ims in images for im in ims], pixels)
    it = iter(counts)
    prompts = [expand_images(e.prompt_ids, [next(it) for _ in ims], tokens.image_pad)
               for e, ims in zip(episodes, images)]
    width = max(len(p) + len(e.response_ids) for p, e in zip(prompts, episodes))
    B = len(episodes)
    ids = torch.full((B, width), tokens.pad, dtype=torch.long)
    attn = torch.zeros(B, width, dtype=torch.long)
    resp = torch.zeros(B, width, dtype=torch.long)
    engine_lp = torch.zeros(B, width, dtype=torch.float32)
    for i, (p, e) in enumerate(zip(prompts, episodes)):
        n, r = len(p), len(e.response_ids)
        ids[i, :n + r] = torch.tensor(p + e.response_ids)
        attn[i, :n + r] = 1
        resp[i, n:n + r] = 1
        engine_lp[i, n:n + r] = torch.tensor(e.logprobs, dtype=torch.float32)
    out = dict(input_ids=ids, attention_mask=attn, response_mask=resp, engine_logprobs=engine_lp,
               episode_tokens=attn.sum(), **mm)
    return {k: v.to(device) for k, v in out.items()}


def _same_images(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def pack(episodes, images: list[list], procs: Processors, device: torch.device,
         pixels: dict | None = None) -> dict[str, torch.Tensor]:
    """One row per run of consecutive episodes with the same prompt (see :func:`collate`).

    Row layout: [prompt (images expanded) | response 1 | response 2 | ... | padding]. Extra keys:
    `attention_mask_4d` [rows, 1, W, W] (bool: a prompt token sees the prompt causally; a response
    token sees the prompt and its own response causally; padding sees itself), `prompt_len`
    [rows], and for every response token (episode-major) its row, the column whose hidden state
    predicts it, its own column and its index in its response: `pred_row`, `pred_col`,
    `target_col`, `offset` [N].
    """
    tokens = procs.tokens
    runs: list[list[int]] = []
    for i, e in enumerate(episodes):
        if (runs and episodes[runs[-1][0]].prompt_ids == e.prompt_ids
                and _same_images(images[runs[-1][0]], images[i])):
            runs[-1].append(i)
        else:
            runs.append([i])
    mm, counts = _vision_inputs(procs, [im for r in runs for im in images[r[0]]], pixels)
    it = iter(counts)
    rows, starts = [], [0] * len(episodes)
    for r in runs:
        row = expand_images(episodes[r[0]].prompt_ids, [next(it) for _ in images[r[0]]],
                            tokens.image_pad)
        plen = len(row)
        for i in r:
            starts[i] = len(row)
            row = row + episodes[i].response_ids
        rows.append((plen, row))
    W, R, B = max(len(row) for _, row in rows), len(rows), len(episodes)
    T = max(len(e.response_ids) for e in episodes)
    ids = torch.full((R, W), tokens.pad, dtype=torch.long)
    attn = torch.zeros(R, W, dtype=torch.long)
    mask4 = torch.zeros(R, 1, W, W, dtype=torch.bool)
    causal = torch.ones(W, W, dtype=torch.bool).tril()
    for k, (plen, row) in enumerate(rows):
        ids[k, :len(row)] = torch.tensor(row)
        attn[k, :len(row)] = 1
        mask4[k, 0, :len(row), :plen] = causal[:len(row), :plen]  # everyone sees the prompt (causally)
        mask4[k, 0, range(W), range(W)] = True                    # padding sees itself: no empty row
    resp = torch.zeros(B, T, dtype=torch.long)
    engine_lp = torch.zeros(B, T, dtype=torch.float32)
    pred_row, pred_col, target_col, offset = [], [], [], []
    for k, (r, (plen, _)) in enumerate(zip(runs, rows)):
        for i in r:
            s, n = starts[i], len(episodes[i].response_ids)
            mask4[k, 0, s:s + n, s:s + n] = causal[:n, :n]
            resp[i, :n] = 1
            engine_lp[i, :n] = torch.tensor(episodes[i].logprobs, dtype=torch.float32)
            pred_row += [k] * n
            pred_col += [plen - 1] + list(range(s, s + n - 1))    # the first token is predicted
            target_col += list(range(s, s + n))                    # by the prompt's last token
            offset += list(range(n))
    out = dict(input_ids=ids, attention_mask=attn, attention_mask_4d=mask4, response_mask=resp,
               engine_logprobs=engine_lp, prompt_len=torch.tensor([p for p, _ in rows]),
               pred_row=torch.tensor(pred_row), pred_col=torch.tensor(pred_col),
               target_col=torch.tensor(target_col), offset=torch.tensor(offset),
               episode_tokens=torch.tensor(sum(rows[k][0] + len(episodes[i].response_ids)
                                               for k, r in enumerate(runs) for i in r)), **mm)
    return {k: v.to(device) for k, v in out.items()}


# ----------------------------------------------------------------------------- logprobs
def masked_logits(logits: torch.Tensor, tokens: Tokens, temperature: float) -> torch.Tensor:
    """The policy's logits as the engines sample them: suppressed ids removed, tempered."""
    logits = logits.float()
    if tokens.suppressed:
        logits = logits.index_fill(-1, torch.tensor(tokens.suppressed, device=logits.device),
                                   float("-inf"))
    return logits / temperature


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, tokens: Tokens,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target token, entropy) under the convention in the module docstring."""
    lp = torch.log_softmax(masked_logits(logits, tokens, temperature), dim=-1)
    picked = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = lp.exp()
    entropy = -(p * lp.nan_to_num(neginf=0.0)).sum(-1)
    return picked, entropy


def _model_inputs(batch: dict[str, torch.Tensor], tokens: Tokens) -> dict:
    """The images of a batch as the model takes them ({} without images). mm_token_type_ids
    marks the image tokens; without it transformers silently falls back to text-only positions
    and the logprobs no longer match generation (mRoPE)."""
    if "pixel_values" not in batch:
        return {}
    return dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                mm_token_type_ids=(batch["input_ids"] == tokens.image_pad).int())


def sequence_logprobs(model, batch: dict[str, torch.Tensor], tokens: Tokens,
                      temperature: float,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer forward: logprobs and entropies of the response tokens of a :func:`collate` batch,
    aligned with its `response_mask` (zero elsewhere). The entropies are detached unless
    `entropy_grad` (the entropy bonus, `loss.entropy_coef > 0`: its graph keeps a vocabulary-wide
    tensor per token alive until the backward).

    Only the positions that predict a response token go through the LM head (the fp32
    log-softmax over a 150k vocabulary is the largest activation of a step; prompt positions
    would only be masked out).
    """
    if "attention_mask_4d" in batch:
        return _packed_logprobs(model, batch, tokens, temperature, entropy_grad)
    ids = batch["input_ids"]
    mask = batch["response_mask"][:, 1:].bool()                  # [B, L-1]: predicts t+1
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, :-1] = mask
    logits = _logits_at(model, keep, input_ids=ids, attention_mask=batch["attention_mask"],
                        use_cache=False, **_model_inputs(batch, tokens))
    rows = mask.nonzero(as_tuple=True)                           # row-major, as `keep`
    lp_sel, ent_sel = token_logprobs(logits, ids[:, 1:][rows], tokens, temperature)
    lp = torch.zeros(ids.shape, dtype=lp_sel.dtype, device=lp_sel.device)
    ent = torch.zeros(ids.shape, dtype=ent_sel.dtype, device=ent_sel.device)
    shifted = (rows[0], rows[1] + 1)                             # column t holds token t
    ent_sel = ent_sel if entropy_grad else ent_sel.detach()
    return lp.index_put(shifted, lp_sel), ent.index_put(shifted, ent_sel)


def _packed_logprobs(model, batch: dict[str, torch.Tensor], tokens: Tokens,
                     temperature: float,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids, pr, pc = batch["input_ids"], batch["pred_row"], batch["pred_col"]
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[pr, pc] = True
    logits = _logits_at(model, keep, input_ids=ids, attention_mask=batch["attention_mask_4d"],
                        position_ids=packed_positions(model, batch, tokens), use_cache=False,
                        **_model_inputs(batch, tokens))
    where = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
    where[keep] = torch.arange(int(keep.sum()), device=ids.device)  # row-major, as the logits
    lp_sel, ent_sel = token_logprobs(logits[where[pr, pc]], ids[pr, batch["target_col"]], tokens,
                                     temperature)
    resp = batch["response_mask"].bool()                         # [B, T], episode-major as pr
    lp = torch.zeros(resp.shape, dtype=lp_sel.dtype, device=lp_sel.device)
    ent = torch.zeros(resp.shape, dtype=ent_sel.dtype, device=ent_sel.device)
    ent_sel = ent_sel if entropy_grad else ent_sel.detach()
    return lp.masked_scatter(resp, lp_sel), ent.masked_scatter(resp, ent_sel)


def rope_index_fn(model):
    """The model's own mRoPE index function (`get_rope_index` of its multimodal base model), or
    None for a model with 1-D positions (text LLMs). Looks through wrappers (FSDP2, PEFT)."""
    todo, seen = [model], set()
    while todo:
        m = todo.pop(0)
        if m is None or id(m) in seen or len(seen) > 8:
            continue
        seen.add(id(m))
        fn = getattr(m, "get_rope_index", None)
        if callable(fn):
            return fn
        todo += [getattr(m, "model", None), getattr(m, "base_model", None)]
    return None


def packed_positions(model, batch: dict[str, torch.Tensor], tokens: Tokens) -> torch.Tensor:
    """Position ids of a packed batch: the prompt's as the model computes them (mRoPE [3, rows, W]
    with its images' 3D grids, where the model has its own rope index; else 1-D [rows, W]), then
    every response continues from the prompt's largest position + 1, as generation does (so a
    response's positions do not depend on the responses before it)."""
    ids, plen = batch["input_ids"], batch["prompt_len"].tolist()
    R, P = ids.shape[0], max(plen)
    am = (torch.arange(P, device=ids.device)[None, :] < torch.tensor(plen, device=ids.device)[:, None])
    rope_index = rope_index_fn(model)
    if rope_index is None:
        pos = (torch.arange(P, device=ids.device)[None, :] * am)[None]        # [1, R, P]
    else:
        prompt = ids[:, :P].clone()
        prompt[~am] = tokens.pad
        pos, _ = rope_index(prompt, (prompt == tokens.image_pad).int(),
                            image_grid_thw=batch.get("image_grid_thw"), attention_mask=am.long())
    out = torch.zeros(pos.shape[0], R, ids.shape[1], dtype=torch.long, device=ids.device)
    out[:, :, :P] = pos
    nxt = (pos.amax(dim=(0, 2)) + 1).tolist()
    pr, tc = batch["pred_row"], batch["target_col"]
    # a response token j tokens into its response, in row r: position nxt[r] + j
    out[:, pr, tc] = (torch.tensor(nxt, device=ids.device)[pr] + batch["offset"]).expand(pos.shape[0], -1)
    return out if rope_index is not None else out[0]


def _logits_at(model, keep: torch.Tensor, **inputs) -> torch.Tensor:
    """The model's logits at the `keep` positions [N, V] (row-major).

    The positions are selected on the way into the LM head (a forward pre-hook on the output
    embeddings), so no [rows, W, vocab] tensor exists, whatever the transformers version (older
    ones take no boolean `logits_to_keep`). The hook fires inside the model's own forward, where
    FSDP2 has gathered the head's weights."""
    head = model.get_output_embeddings()

    def select(_module, args):
        return (args[0][keep],) + tuple(args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        return model(**inputs, logits_to_keep=0).logits            # 0: every position reaches the hook
    finally:
        handle.remove()


# ----------------------------------------------------------------------------- loading
def load_model(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The model at `path`, every weight loaded (transformers leaves it in eval mode: a policy that
    trains must call `.train()`, or activation checkpointing never runs).

    A load that leaves any weight missing, unexpected or of another shape is a ModelError naming
    the first few keys (transformers would otherwise initialise missing weights at random and
    only log it)."""
    config = load_config(path)
    refuse_dropout(config, path)
    try:
        model, info = _auto_class(config).from_pretrained(path, dtype=dtype,
                                                          attn_implementation="sdpa",
                                                          output_loading_info=True,
                                                          **_kernels(torch.device(device).type))
    except (RuntimeError, ValueError) as e:  # size mismatches and the like
        raise ModelError(f"model.path={path}: the weights do not fit {config.model_type}'s "
                         f"architecture ({one_line(e, 240, typed=False)})") from None
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(kind) or ())
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            raise ModelError(f"model.path={path}: {kind.replace('_keys', '')} weights: "
                             f"{', '.join(keys[:3])}{more} ({config.model_type}); the folder does "
                             "not hold this model's weights")
    return model.to(device)


def model_from_config(path: str, dtype: torch.dtype = torch.float32, meta: bool = False,
                      device_type: str = "cpu"):
    """The architecture of `path` with random (or, `meta`, no) weights: no weight file is read.
    `device_type`: where it will run ("cpu", "cuda", "npu"; its kernels: device.Device.experts)."""
    config = load_config(path)
    refuse_dropout(config, path)
    with torch.device("meta") if meta else torch.device("cpu"):
        return _auto_class(config).from_config(config, dtype=dtype, attn_implementation="sdpa",
                                               **_kernels(device_type))


def _kernels(device_type: str) -> dict:
    """transformers' implementation choices for a model that runs on `device_type`: the MoE
    experts' (device.Device.experts; a dense model ignores it), where the device row names one."""
    import device as D
    row = D.TABLE.get(device_type)
    return {"experts_implementation": row.experts} if row is not None and row.experts else {}


def refuse_dropout(config, path: str) -> None:
    """Train mode must compute what eval mode computes: the trainer's logprobs (train mode) are
    compared with the engines' (eval) and enter the GRPO ratio. The Qwen families' only
    mode-dependent op is the text attention's dropout (the vision towers hard-code 0)."""
    p = getattr(text_config(config), "attention_dropout", 0.0)
    if p:
        raise ModelError(f"model.path={path}: attention_dropout={p}; the policy must be "
                         "deterministic in train mode (GRPO ratio, engine/trainer logprob parity): "
                         "set it to 0.0 in the model's config.json")


def checkpoint_pieces(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple]]:
    """How parameter `name` of `shape` goes to an engine: [(checkpoint name, index into the
    parameter)], in order. MoE experts fused in memory (transformers 5: `experts.gate_up_proj`
    [E, 2I, H] with gate rows first, `experts.down_proj` [E, H, I]) go per expert under the
    names every vLLM MoE loader takes (`experts.{e}.gate_proj.weight`, ...); anything else goes
    whole (index `()`)."""
    head, _, leaf = name.rpartition(".")
    if head.endswith("experts") and len(shape) == 3 and leaf in ("gate_up_proj", "down_proj"):
        E, rows = shape[0], shape[1]
        if leaf == "down_proj":
            return [(f"{head}.{e}.down_proj.weight", (e,)) for e in range(E)]
        half = rows // 2
        return [piece for e in range(E) for piece in
                ((f"{head}.{e}.gate_proj.weight", (e, slice(0, half))),
                 (f"{head}.{e}.up_proj.weight", (e, slice(half, rows))))]
    return [(name, ())]


# ----------------------------------------------------------------------------- FSDP2
def fsdp_units(model) -> list:
    """The modules FSDP2 shards one at a time: every instance of the model's `_no_split_modules`
    (its decoder layers and vision blocks), children before parents."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_fsdp(model, mesh, *, mixed_precision: bool = False, checkpointing: bool = False):
    """Shard the policy with FSDP2 over `mesh` (the trainer-only mesh).

    Each decoder layer and vision block is its own unit so that only one layer's full weights
    live at a time; the root unit then takes the embeddings, norms and lm_head. Order matters:
    children first, root last (fully_shard on the root skips already-sharded children).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if checkpointing:  # acts only in train mode (transformers checks `self.training`)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kw = {"mesh": mesh}
    if mixed_precision:  # bf16 compute, fp32 master weights and gradient reduction
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for block in fsdp_units(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


@torch.no_grad()
def shard_from_rank0(path: str, full, mesh, device: torch.device, group, *,
                     mixed_precision: bool = False, checkpointing: bool = False,
                     lora_mc=None, seed: int = 0):
    """The policy sharded with FSDP2 over `mesh`, its weights those of `full` (the model loaded on
    the first trainer rank, None on the others).

    Every trainer rank builds the architecture on the meta device (no memory), shards it and
    allocates only its own shards; the first rank then scatters each full weight in turn
    (`distribute_tensor` over the trainer group), and broadcasts the buffers (rotary tables are
    not in a state dict). So a trainer node needs one host copy of the model, not one per rank.
    `lora_mc` (the `[model]` config, when `lora_rank > 0`): adapters on both (lora.add_lora, the
    first rank's initialised from `seed` and scattered like the rest; `full` is wrapped in
    place), each layer's FSDP unit then holding its frozen base and its trainable adapters.
    Collective over `group` (the trainer ranks)."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    model = model_from_config(path, meta=True, device_type=device.type)
    if lora_mc is not None:
        import lora
        model = lora.add_lora(model, lora_mc, seed)
        full = lora.add_lora(full, lora_mc, seed) if full is not None else None
    apply_fsdp(model, mesh, mixed_precision=mixed_precision, checkpointing=checkpointing)
    model.to_empty(device=device)
    src = dict(full.named_parameters()) if full is not None else {}
    for name, p in model.named_parameters():  # every parameter is a DTensor after fully_shard
        whole = (src[name].detach().to(device, p.dtype) if full is not None
                 else torch.empty(p.shape, dtype=p.dtype, device=device))
        p.to_local().copy_(distribute_tensor(whole, mesh, p.placements).to_local())
    bufs = dict(full.named_buffers()) if full is not None else {}
    for name, b in model.named_buffers():
        if full is not None:
            b.copy_(bufs[name])
        dist.broadcast(b, dist.get_global_rank(group, 0), group=group)
    return model


class CheckpointCounter:
    """Activation checkpointing at work, counted: `calls` is the number of layer forwards that went
    through the checkpoint function, `recomputes` the number of those the backward ran again
    (what checkpointing is for). Both stay 0 when checkpointing is off or the model is in eval
    mode. Wraps each layer's `_gradient_checkpointing_func` (transformers 5.x, set by
    `gradient_checkpointing_enable`); for tests and bench/step.py."""

    def __init__(self, model):
        self.calls = self.runs = 0
        for m in model.modules():
            f = getattr(m, "_gradient_checkpointing_func", None)
            if f is not None:
                m._gradient_checkpointing_func = self._wrap(f)

    def _wrap(self, checkpoint):
        def counted(fn, *args, **kwargs):
            self.calls += 1

            def run(*a, **k):
                self.runs += 1
                return fn(*a, **k)
            return checkpoint(run, *args, **kwargs)
        return counted

    @property
    def recomputes(self) -> int:
        return self.runs - self.calls

    def reset(self) -> None:
        self.calls = self.runs = 0
