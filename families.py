"""Model families: the one table of what differs between Qwen generations (docs/families.md).

The family of a model folder is its `config.json` `model_type`; everything else is asked of the
config or the model, never of the family's name. :data:`FAMILIES` holds what is truly per
family, one row each. Also here: :data:`IMAGE_PROCESSOR`, :func:`build_tiny` (a tiny random
model of any family, for the CPU demos and tests) and :func:`write_weights` (the hub checkpoint
layout). torch, transformers and tokenizers are imported inside functions only.
"""
from __future__ import annotations

import fcntl
import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from errors import ConfigError


# ----------------------------------------------------------------------------- chat templates
# Content is a string or a list of {"type": "image"} / {"type": "text", "text": ...} items, as
# transformers' processors take it. Every piece of output is an explicit string expression, so
# Jinja's whitespace control never eats a newline.
_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}")


# Tools (`rollout.tools`) as Qwen's templates render them: a system turn listing their schemas and
# the <tool_call> format (the run's system prompt first), tool results as a user turn in
# <tool_response> tags
_TOOLS = ("{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
          "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
          "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' -}}"
          "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
          "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
          "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
          "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}{%- endif -%}")


def _template(default_system: str = "", thinking: str = "") -> str:
    """A Qwen chat template: `<|im_start|>role\ncontent<|im_end|>\n` per message, a default
    system turn when the first message is not one (`default_system`, "" = none), and the
    generation prompt `<|im_start|>assistant\n` followed by `thinking` (Jinja: the Qwen3
    `enable_thinking` switch)."""
    system = ("{%- if not tools and messages[0]['role'] != 'system' -%}"
              "{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' -}}{%- endif -%}"
              if default_system else "")
    return (_TOOLS + system + "{%- for message in messages -%}"
            "{%- if tools and loop.first and message['role'] == 'system' -%}"  # inside the tools turn
            "{%- elif message['role'] == 'tool' -%}"
            "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
            "{%- else -%}"
            "{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT
            + "{{- '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}" + thinking
            + "{%- endif -%}")


# Qwen3 / Qwen3-MoE: thinking unless enable_thinking is false (then an empty think block).
_QWEN3_THINKING = ("{%- if enable_thinking is defined and enable_thinking is false -%}"
                   "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}")
# Qwen3.5: the generation prompt opens the think block; enable_thinking=false closes it empty.
_QWEN3_5_THINKING = ("{%- if enable_thinking is defined and enable_thinking is false -%}"
                     "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- else -%}{{- '<think>\\n' -}}"
                     "{%- endif -%}")


# ----------------------------------------------------------------------------- tiny configs
def _text(ids: dict, hidden: int, layers: int, **extra) -> dict:
    """A tiny decoder: head_dim 32 (vLLM's CPU attention supports 32, 64, 80, ... not 16)."""
    head_dim = 32
    return dict(vocab_size=ids["vocab"], hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=hidden // head_dim,
                num_key_value_heads=max(1, hidden // head_dim // 2), head_dim=head_dim,
                max_position_embeddings=4096, tie_word_embeddings=False,
                bos_token_id=ids["pad"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], **extra)


def _rope(mrope: bool = False, interleaved: bool = False) -> dict:
    r = {"rope_type": "default", "rope_theta": 10000.0}
    if mrope:
        r["mrope_section"] = [4, 6, 6]  # sums to head_dim / 2
    if interleaved:
        r["mrope_interleaved"] = True
    return r


def _vlm(ids: dict, text: dict, vision: dict) -> dict:
    return dict(text_config=text, vision_config=vision, image_token_id=ids["image_pad"],
                video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
                vision_end_token_id=ids["vision_end"], tie_word_embeddings=False)


def _vision3(hidden: int, **extra) -> dict:
    """Qwen3-VL / Qwen3.5 vision tower: patch 16 (32 pixels a token after the 2 x 2 merge)."""
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden,
                num_position_embeddings=64, **extra)


# expert size 96 != hidden 64 and 2 x 96 != 64: a transposed expert weight cannot load by
# accident; norm_topk_prob as the released MoE configs set it (vLLM's loaders read it)
_MOE = dict(moe_intermediate_size=96, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
# Qwen3.5's Gated DeltaNet layers (3 of every 4), tiny
_LINEAR_ATTENTION = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4)


def _tiny_qwen2_vl(ids, hidden, layers):
    return _vlm(ids, _text(ids, hidden, layers, rope_parameters=_rope(mrope=True)),
                dict(depth=2, embed_dim=32, hidden_size=hidden, mlp_ratio=2, num_heads=2,
                     patch_size=14, spatial_merge_size=2, temporal_patch_size=2))


def _tiny_qwen2_5_vl(ids, hidden, layers):
    return _vlm(ids, _text(ids, hidden, layers, rope_parameters=_rope(mrope=True)),
                dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                     fullatt_block_indexes=[1], out_hidden_size=hidden))


def _tiny_qwen3_vl(ids, hidden, layers, moe=False):
    text = _text(ids, hidden, layers, rope_parameters=_rope(mrope=True, interleaved=True),
                 **(_MOE if moe else {}))
    return _vlm(ids, text, _vision3(hidden, deepstack_visual_indexes=[0]))


def _tiny_qwen3_5(ids, hidden, layers, moe=False):
    # 4 layers: three linear-attention layers and one full-attention layer, as the real ratio
    rope = {**_rope(mrope=True, interleaved=True), "partial_rotary_factor": 1.0}
    extra = dict(_MOE, shared_expert_intermediate_size=96) if moe else {}
    text = _text(ids, hidden, max(layers, 4), rope_parameters=rope, **_LINEAR_ATTENTION, **extra)
    return _vlm(ids, text, _vision3(hidden))


def _tiny_text(ids, hidden, layers, moe=False, tied=False):
    return _text(ids, hidden, layers, rope_parameters=_rope(), **(_MOE if moe else {}),
                 ) | dict(tie_word_embeddings=tied)


@dataclass(frozen=True)
class Family:
    model_type: str                  # config.json's model_type
    tiny: Callable[..., dict]        # (token ids, hidden, layers) -> tiny config kwargs
    # the tiny folder's template: the parts of the family's published one a prompt uses (a real
    # folder's own template is always what is used)
    chat_template: str
    processor: str = ""              # the HF processor class vLLM's loader asks for (VLMs)
    notes: str = ""                  # what a user should know (README's families table)
    linear_attention: bool = False   # some text layers are linear attention (Gated DeltaNet)
    label: str = ""                  # the family's name in messages ("" = model_type)
    # MoE: the class name of transformers' router modules (each returns (logits, top-k weights,
    # top-k indices) in 5.5.4, 5.17 and 5.24; routing.py hooks them); "" = a dense family
    router: str = ""
    # the trainer places the vision tower's output into the token embeddings itself (model.py's
    # image hook): the tower returns one [image tokens, hidden] tensor in token order and the
    # language model needs nothing else of the images (Qwen3-VL's and Qwen3.5's towers also feed
    # deepstack features into decoder layers: those keep transformers' own forward)
    places_images: bool = False


_QWEN2_VL_SYSTEM = "You are a helpful assistant."
_QWEN2_5_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_ONE_ROW = ("linear-attention layers: one sequence per episode, its prompt copied (train.share_prompt "
            "off); packed rows run each sequence from a zero state")

FAMILIES: dict[str, Family] = {f.model_type: f for f in [
    Family("qwen2_vl", _tiny_qwen2_vl, _template(_QWEN2_VL_SYSTEM), "Qwen2VLProcessor",
           places_images=True),
    Family("qwen2_5_vl", _tiny_qwen2_5_vl, _template(_QWEN2_VL_SYSTEM), "Qwen2_5_VLProcessor",
           places_images=True),
    Family("qwen3_vl", _tiny_qwen3_vl, _template(), "Qwen3VLProcessor"),
    Family("qwen3_vl_moe", lambda i, h, n: _tiny_qwen3_vl(i, h, n, moe=True), _template(),
           "Qwen3VLProcessor", router="Qwen3VLMoeTextTopKRouter"),
    Family("qwen3_5", _tiny_qwen3_5, _template(thinking=_QWEN3_5_THINKING), "Qwen3VLProcessor",
           notes=_ONE_ROW, linear_attention=True, label="Qwen3.5"),
    Family("qwen3_5_moe", lambda i, h, n: _tiny_qwen3_5(i, h, n, moe=True),
           _template(thinking=_QWEN3_5_THINKING), "Qwen3VLProcessor",
           notes=_ONE_ROW, linear_attention=True, label="Qwen3.5-MoE", router="Qwen3_5MoeTopKRouter"),
    Family("qwen2", _tiny_text, _template(_QWEN2_5_SYSTEM)),
    # Qwen3's small dense models tie the LM head to the embeddings: the tiny one does too
    Family("qwen3", lambda i, h, n: _tiny_text(i, h, n, tied=True), _template(thinking=_QWEN3_THINKING)),
    Family("qwen3_moe", lambda i, h, n: _tiny_text(i, h, n, moe=True),
           _template(thinking=_QWEN3_THINKING), router="Qwen3MoeTopKRouter"),
]}

DEFAULT_TINY = "qwen2_5_vl"  # what `model.path = "tiny"` builds
# the attribute under which transformers' decoder layers hold a linear-attention mixer (Gated
# DeltaNet: Qwen3.5's, in 5.5.4, 5.17 and 5.24), whose forward model.py runs per packed sequence
LINEAR_ATTENTION_MODULE = "linear_attn"

TINY = "tiny"  # `model.path = "tiny"`: the default family's tiny model; "tiny-<model_type>" any
# The one image processor class, in the trainer and every vLLM process (vllm_engine.checked_processor):
# the torchvision-backed one cannot import beside the CPU torch build, and its pixels differ.
IMAGE_PROCESSOR = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil"
# The tiny tokenizer: 256 byte tokens (no merges), these special tokens in this order (keyed by
# the role the tiny config gives their ids), then these plain ones
TINY_SPECIALS = {"pad": "<|endoftext|>", "im_start": "<|im_start|>", "eos": "<|im_end|>",
                 "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>",
                 "image_pad": "<|image_pad|>", "video_pad": "<|video_pad|>"}
TINY_WORDS = ("<think>", "</think>", "<answer>", "</answer>")  # one token each: the answer format


def tiny_type(path: str) -> str | None:
    """The family `model.path` asks to build ("tiny" -> the default one), or None for a real
    path (the name may be outside the table: the caller refuses it)."""
    if path == TINY:
        return DEFAULT_TINY
    if path.startswith(TINY + "-"):
        return path[len(TINY) + 1:]
    return None


def is_vlm(config) -> bool:
    """A vision-language model: its config has a vision tower (asked of the config, never of
    the family's name)."""
    return getattr(config, "vision_config", None) is not None


def vision_tower(model):
    """The vision tower module of `model` (every family's `visual`, at the top or under `.model`;
    through FSDP2 and PEFT wrappers, whose modules are the model's own), or None (a text model)."""
    for m in model.modules():
        tower = getattr(m, "visual", None)
        if tower is not None:
            return tower
    return None


def vision_checkpointing_off(model) -> None:
    """After transformers' gradient_checkpointing_enable: the vision tower's blocks run their
    forward once (their activations are small beside the decoder's at these image sizes, and
    recomputing them re-launches every operator of 32 blocks)."""
    tower = vision_tower(model)
    for m in tower.modules() if tower is not None else ():
        if hasattr(m, "gradient_checkpointing"):
            m.gradient_checkpointing = False


# the vision towers' attention modules whose forward attention.one_call_vision replaces: each
# projects qkv [S, 3, heads, D], rotates q and k with its module's apply_rotary_pos_emb_vision,
# attends within each sequence of cu_seqlens (its windows, or its images) and projects back
VISION_ATTENTIONS = frozenset({"VisionAttention", "Qwen2_5_VLVisionAttention", "Qwen3VLVisionAttention",
                               "Qwen3VLMoeVisionAttention", "Qwen3_5VisionAttention",
                               "Qwen3_5MoeVisionAttention"})


def vision_attentions(model) -> list:
    """The vision tower's attention modules of `model` ([] for a text model)."""
    tower = vision_tower(model)
    return [m for m in tower.modules() if type(m).__name__ in VISION_ATTENTIONS] if tower is not None else []


def vision_rotary(attention) -> Callable:
    """The rotary function (q, k, cos, sin) -> (q, k) of a vision attention module's family."""
    return sys.modules[type(attention).__module__].apply_rotary_pos_emb_vision


def places_images(model) -> bool:
    """Whether the trainer places `model`'s image features itself (:attr:`Family.places_images`):
    its family's row says so and its vision tower's module takes the grid-derived tensors
    precomputed (it imports transformers.vision_utils' helpers, which pop them from the tower's
    kwargs: 5.24; a release whose tower computes them itself keeps the model's own forward)."""
    row = FAMILIES.get(getattr(model.config, "model_type", ""))
    if not (row and row.places_images) or importlib.util.find_spec("transformers.vision_utils") is None:
        return False
    cls = next((c for c in type(vision_tower(model)).__mro__ if c.__module__.startswith("transformers.")), None)
    tower = sys.modules[cls.__module__] if cls is not None else None  # past FSDP2's subclass
    return all(hasattr(tower, f) for f in ("get_vision_attention_seqlens", "get_vision_position_ids"))


def vision_inputs(model, grid_thw) -> dict:
    """What `model`'s vision tower derives from the image grid (`grid_thw`, on the host), as
    its forward's keyword arguments: computed here by transformers.vision_utils' own functions
    (a :func:`places_images` family only), so the tower, given them on its device, makes no
    host sync."""
    from transformers import vision_utils as VU
    tower = vision_tower(model)
    merge = tower.spatial_merge_size
    cu = VU.get_vision_cu_seqlens(grid_thw)
    out = {"position_ids": VU.get_vision_position_ids(grid_thw, merge), "cu_seqlens": cu,
           "max_seqlen": int((cu[1:] - cu[:-1]).max())}
    if getattr(tower, "window_size", None) is not None:  # Qwen2.5-VL: windowed blocks
        index, cu_w = VU.get_vision_window_index(grid_thw, merge, tower.window_size, tower.patch_size)
        out |= {"window_index": index, "cu_window_seqlens": cu_w,
                "max_window_seqlen": int((cu_w[1:] - cu_w[:-1]).max())}
    return out


def image_features(model, pixel_values, grid_thw, inputs: dict):
    """The vision tower's output for `pixel_values`: [image tokens, text hidden], the images in
    the order their tokens come (`inputs`: :func:`vision_inputs`, on the tower's device)."""
    tower = vision_tower(model)
    return tower(pixel_values.type(tower.dtype), grid_thw=grid_thw, **inputs).pooler_output


def auto_class(config):
    """transformers' Auto class for `config`: image-text-to-text for a VLM, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if is_vlm(config) else AutoModelForCausalLM


def image_processor_cls():
    """The class :data:`IMAGE_PROCESSOR` names."""
    module, _, name = IMAGE_PROCESSOR.rpartition(".")
    return getattr(importlib.import_module(module), name)


def supported() -> list[str]:
    return list(FAMILIES)


def model_type_of(path: str | Path) -> str:
    """`model_type` of the model folder at `path` (its config.json); "" when it has none."""
    try:  # no such file (or a folder of that name): OSError
        return str(json.loads((Path(path) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError):
        return ""


def unsupported(model_type: str) -> str:
    """The one message for a model_type outside the table."""
    return f"model_type {model_type!r} is not a supported family (supported: {', '.join(FAMILIES)})"


def get(model_type: str) -> Family:
    """The table row of `model_type`; KeyError naming the supported ones."""
    if model_type not in FAMILIES:
        raise KeyError(unsupported(model_type))
    return FAMILIES[model_type]


_ROUTERS = frozenset(f.router for f in FAMILIES.values() if f.router)


def moe_routers(model) -> list:
    """The MoE router modules of `model` in layer order ([] for a dense model); looks through
    wrappers (FSDP2, PEFT), whose modules are the model's own."""
    return [m for m in model.modules() if type(m).__name__ in _ROUTERS]


def router_normalizes(router) -> bool:
    """Whether `router` renormalises its top-k weights to sum to 1: Qwen3-MoE's as its config's
    `norm_topk_prob` says (the attribute), Qwen3-VL-MoE's and Qwen3.5-MoE's always (none)."""
    return bool(getattr(router, "norm_topk_prob", True))


def is_moe(model_type: str) -> bool:
    return bool(FAMILIES[model_type].router) if model_type in FAMILIES else False


def check_routing_replay(path: str, replay: bool) -> None:
    """`model.moe_routing_replay` only for a MoE family (a hub id not downloaded yet: the
    trainer checks its routers); ConfigError naming the key otherwise."""
    kind = tiny_type(path) or model_type_of(Path(path).expanduser())
    if replay and kind in FAMILIES and not FAMILIES[kind].router:
        raise ConfigError(f"model.moe_routing_replay: {FAMILIES[kind].label or kind} is a dense "
                          f"family (no experts to route); it applies to {', '.join(t for t in FAMILIES if is_moe(t))}")


def check_model_path(path: str, key: str = "model.path") -> None:
    """`model.path` (or `key`) names a family of the table: a tiny one ("tiny-<model_type>"), or
    a local folder whose config.json says its model_type (a hub id is checked once downloaded);
    ConfigError naming the key otherwise."""
    kind = tiny_type(path)
    if kind is not None:
        if kind not in FAMILIES:
            raise ConfigError(f"{key}={path}: no tiny model of {kind!r} (known: tiny, "
                              f"{', '.join('tiny-' + t for t in supported())})")
        return
    if path.startswith(("/", ".", "~")) and not Path(path).expanduser().exists():
        raise ConfigError(f"{key}: no such folder {path}")
    kind = model_type_of(Path(path).expanduser())
    if kind and kind not in FAMILIES:
        raise ConfigError(f"{key}={path}: {unsupported(kind)}")


def tiny_config(model_type: str, ids: dict, hidden: int = 64, layers: int = 2,
                sizes: dict | None = None):
    """The transformers config of a tiny random model of `model_type` (`ids`: the tiny
    tokenizer's vocab size and special token ids; `sizes`: text-model config keys set over the
    family's tiny ones, e.g. odd head counts for a test)."""
    from transformers import CONFIG_MAPPING
    kwargs = get(model_type).tiny(ids, hidden, layers)
    (kwargs["text_config"] if "text_config" in kwargs else kwargs).update(sizes or {})
    return CONFIG_MAPPING[model_type](**kwargs)


# ----------------------------------------------------------------------------- tiny models
def build_tiny(out_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2,
               model_type: str = DEFAULT_TINY, sizes: dict | None = None) -> Path:
    """Write a random tiny model of `model_type`, its tokenizer (:data:`TINY_SPECIALS`,
    :data:`TINY_WORDS`), chat template and (VLMs) image processor to `out_dir`; returns the
    folder (`sizes`: :func:`tiny_config`'s). Deterministic in `seed`; safe from several
    processes at once (a file lock; the folder appears complete or not at all)."""
    get(model_type)
    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").exists():
            _build_tiny(out, seed, hidden, layers, model_type, sizes)
    return out


def _tiny_tokenizer(model_type: str):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in TINY_SPECIALS.values()])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in TINY_WORDS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=TINY_SPECIALS["eos"],
                                        pad_token=TINY_SPECIALS["pad"])
    tokenizer.chat_template = get(model_type).chat_template
    return tokenizer


def _build_tiny(out: Path, seed: int, hidden: int, layers: int, model_type: str,
                sizes: dict | None = None) -> None:
    import torch

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer(model_type)
    tokenizer.save_pretrained(tmp)
    ids = {"vocab": len(tokenizer)} | {role: tokenizer.convert_tokens_to_ids(t)
                                       for role, t in TINY_SPECIALS.items()}
    config = tiny_config(model_type, ids, hidden, layers, sizes)
    torch.manual_seed(seed)
    model = auto_class(config).from_config(config).to(torch.float32)
    config.architectures = [type(model).__name__]
    # std 0.08, not transformers' 0.02 (a nearly uniform policy): samples varied enough for
    # GRPO groups to disagree (the embeddings too where they are the LM head: tied)
    tied = _ties(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and ("embed" not in name or tied):
                p.normal_(0.0, 0.08)
    # not save_pretrained: it silently skips non-zero ranks once torch.distributed is initialised
    write_weights(tmp, model, model.state_dict(), torch.float32)
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    if is_vlm(config):
        v = config.vision_config
        image_processor_cls()(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=v.patch_size,
                              merge_size=v.spatial_merge_size,
                              temporal_patch_size=v.temporal_patch_size).save_pretrained(tmp)
    (tmp / "README.md").write_text(f"Random tiny {type(model).__name__} built by families.build_tiny "
                                   f"(seed {seed}); for tests and the CPU demos only.\n")
    tmp.rename(out)  # atomic: a half-written folder is never seen as the model


def write_weights(folder: Path, model, state: dict, dtype) -> None:
    """`state` (the model's in-memory names) as `model.safetensors` (of torch `dtype`) in the
    checkpoint layout of the family's hub folders (transformers' `revert_weight_conversion`), so
    transformers and vLLM load it as a released model; tied weights are written once. A reversed
    `Transpose` always transposes here: transformers 5.24 skips it (docs/families.md, MoE)."""
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


def qkv_bias(text_config) -> bool:
    """Whether the family's attention projections q, k, v carry biases (Qwen2 and Qwen2.5's do)."""
    return getattr(text_config, "model_type", "").startswith("qwen2")


# The memory plan's shapes (memplan.py) for the configs' hub ids, read from each model's
# config.json on the hub; `vision_params`: the vision tower's parameter count (0: text-only;
# Qwen2.5-VL-3B's counted on its architecture, Qwen3-VL-4B's estimated from its vision_config:
# 24 blocks of 1024 with MLPs of 4096, four patch mergers, the position table).
REFERENCE_SHAPES: dict[str, dict] = {
    "Qwen/Qwen2.5-VL-3B-Instruct": dict(hidden=2048, layers=36, intermediate=11008, vocab=151936,
                                        heads=16, kv_heads=2, head_dim=128, tied=True, qkv_bias=True,
                                        vision_params=668_684_288),
    "Qwen/Qwen3-VL-4B-Instruct": dict(hidden=2560, layers=36, intermediate=9728, vocab=151936,
                                      heads=32, kv_heads=8, head_dim=128, tied=True, qkv_bias=False,
                                      vision_params=412_000_000),
    "Qwen/Qwen3-4B": dict(hidden=2560, layers=36, intermediate=9728, vocab=151936, heads=32,
                          kv_heads=8, head_dim=128, tied=True, qkv_bias=False, vision_params=0),
}
