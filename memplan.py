"""The memory plan (`--dry-run`): what each phase of a step holds on one device, by term.

Every figure is a formula of the model's shape and the config (docs/memory.md writes them out);
the shape is the local config.json's, or for the configs' hub ids families.REFERENCE_SHAPES.
The device's memory is `cluster.device_memory_gib` (0: the plan is printed, not judged). A plan
whose peak does not fit is one ConfigError naming the knob to change. The plan also decides
model.activation_checkpointing = "auto" (:func:`checkpointing`), once at start.
"""
from __future__ import annotations

from dataclasses import dataclass

import families as F
from errors import ConfigError
from head import CHUNK_BYTES
from sharding import checkpointing_mode

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = True
    qkv_bias: bool = False
    vision_params: int = 0

    @property
    def layer_params(self) -> int:
        """One decoder layer: q, k, v (biases with qkv_bias), o, the gated MLP, two norms."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate + 2 * h + (q + 2 * kv) * self.qkv_bias

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params + embed + self.hidden + self.vision_params

    def lora_params(self, rank: int) -> int:
        """LoRA over every linear layer of the language model ("all-linear"): r x (in + out) each."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return self.layers * rank * ((h + q) * 2 + (h + kv) * 2 + (h + i) * 3)


def shape_of(path: str, config=None) -> Shape | None:
    """The shape of `path`: from its config (a local folder's, model.peek_config) or the table
    of the configs' hub ids; None when neither knows it."""
    if config is None:
        ref = F.REFERENCE_SHAPES.get(path)
        return Shape(**ref) if ref else None
    t = getattr(config, "text_config", None) or config
    v = getattr(config, "vision_config", None)
    vision = 0
    if v is not None:  # blocks of attention + MLP, and the merger (docs/memory.md)
        hv, iv = v.hidden_size, v.intermediate_size
        vision = getattr(v, "depth", 0) * (4 * hv * hv + 3 * hv * iv) + 16 * hv * hv + 4 * hv * getattr(v, "out_hidden_size", t.hidden_size)
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    return Shape(t.hidden_size, t.num_hidden_layers, t.intermediate_size, t.vocab_size,
                 t.num_attention_heads, t.num_key_value_heads, head_dim,
                 bool(getattr(config, "tie_word_embeddings", False) or getattr(t, "tie_word_embeddings", False)),
                 F.qkv_bias(t), vision)


def terms(cfg, shape: Shape, trainers: int, mode: str) -> dict[str, float]:
    """Every term of the plan in bytes, per device (docs/memory.md, "The terms"); `mode`: the
    activation checkpointing the trainer runs (:func:`checkpointing`: "auto" resolved)."""
    mc, tc, ro = cfg.model, cfg.train, cfg.rollout
    master = 4 if mc.mixed_precision or tc.master_dtype == "float32" else 2
    compute = 2 if mc.mixed_precision or tc.master_dtype == "bfloat16" else 4
    trainable = shape.lora_params(mc.lora_rank) if mc.lora_rank else shape.params
    tokens = tc.micro_batch_tokens or tc.micro_batch_size * (cfg.data.max_prompt_len + ro.max_new_tokens)
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    layer_act = compute * tokens * (7 * h + 2 * kv + 4 * shape.intermediate)
    # kept per layer: its input ("full"), and with "selective" the matmuls' and attention's outputs
    # too (q, k, v, attention, o, gate, up, down); every activation of every layer ("off"); one
    # layer's during its recompute
    saved = {"full": h, "selective": 5 * h + 2 * kv + 2 * shape.intermediate}
    act = (shape.layers * compute * tokens * saved[mode] + layer_act if mode != "off"
           else shape.layers * layer_act)
    engine_weights = shape.params * BYTES[mc.dtype]
    rows = ro.prompts_per_step // max(1, len_gens(cfg, trainers)) * ro.group_size
    kv_hf = 2 * shape.layers * kv * BYTES[mc.dtype] * rows * (cfg.data.max_prompt_len + ro.max_new_tokens)
    return {
        "parameters": (shape.params if not mc.lora_rank else shape.params - trainable) * master / trainers
        + (trainable * 4 / trainers if mc.lora_rank else 0),
        "reference": shape.params * master / trainers if cfg.loss.kl_coef > 0 and not mc.lora_rank else 0,
        "gradients": trainable * (4 if mc.lora_rank else master) / trainers,
        "optimizer": 2 * trainable * (4 if mc.lora_rank else master) / trainers,
        "gathered": 2 * shape.layer_params * compute,
        "activations": act + 3 * CHUNK_BYTES,
        "engine weights": engine_weights,
        "kv cache (hf)": kv_hf,
        # transformers' generate keeps every step's logits (output_logits), then stacks them
        "logits (hf)": 2 * rows * ro.max_new_tokens * shape.vocab * BYTES[mc.dtype],
        "sync buffers": 2 * cfg.sync.bucket_mb * 2**20,
    }


def len_gens(cfg, trainers: int) -> int:
    return trainers if cfg.cluster.colocate else cfg.cluster.gen_ranks


def phases(cfg, shape: Shape, trainers: int, memory: float, mode: str) -> dict[str, dict[str, float]]:
    """Each phase's terms (bytes) on the device that holds most: a colocated rank's, else a
    trainer's and an engine's. vLLM's engine is rollout.gpu_memory_utilization x `memory`
    (its weights inside); asleep (level 1) it holds nothing on the device."""
    t = terms(cfg, shape, trainers, mode)
    vllm = cfg.rollout.engine == "vllm"
    if vllm and memory:  # weights and KV cache inside vLLM's share of the device
        engine = {"engine (gpu_memory_utilization)": cfg.rollout.gpu_memory_utilization * memory}
    elif vllm:  # the device not given: its weights, the KV cache not known
        engine = {"engine weights (+ kv cache to gpu_memory_utilization)": t["engine weights"]}
    else:
        engine = {k: t[k] for k in ("engine weights", "kv cache (hf)", "logits (hf)")}
    train = {k: t[k] for k in ("parameters", "reference", "gradients", "optimizer", "gathered", "activations")}
    if not cfg.cluster.colocate:
        return {"train (trainer device)": train, "generate (engine device)": engine}
    resident = {k: t[k] for k in ("parameters", "reference", "optimizer")}
    return {"generate": {**resident, **engine}, "train": train,
            "sync": {**resident, "engine weights": t["engine weights"], "sync buffers": t["sync buffers"]}}


def knob(phase: str, parts: dict[str, float], cfg, room: float, mode: str) -> str:
    """The key to change when `phase` does not fit: vLLM's share if lowering it could make room
    (`room`: what the trainer's terms leave of the device for the engine), else the largest term's."""
    share = parts.get("engine (gpu_memory_utilization)")
    if share is not None and room > 0:
        return f"lower rollout.gpu_memory_utilization (at most {room / share * cfg.rollout.gpu_memory_utilization:.2f} fits)"
    big = max((k for k in parts if not k.startswith("engine (")), key=parts.get)
    if big == "activations":
        return ("lower train.micro_batch_tokens (or set model.activation_checkpointing = \"full\")"
                if mode != "full"
                else "lower train.micro_batch_tokens")
    if big in ("kv cache (hf)", "logits (hf)"):
        return "lower rollout.prompts_per_step or rollout.max_new_tokens (or use rollout.engine = 'vllm')"
    return "set model.lora_rank > 0 (LoRA), or launch more ranks"


def checkpointing(cfg, trainers: int, config=None) -> tuple[str, str]:
    """model.activation_checkpointing as the trainer runs it ("full" | "selective" | "off") and,
    for "auto", the line that says why ("" otherwise). "auto" is the first of off, selective,
    full (the least recomputation first) whose train phase fits `cluster.device_memory_gib`;
    "full", the safe choice, where the device's memory or the model's shape is not known or
    where none fits (the dry run's plan then names the knob)."""
    value = cfg.model.activation_checkpointing
    if value != "auto":
        return checkpointing_mode(value), ""
    say = 'activation checkpointing: model.activation_checkpointing = "auto" -> '
    shape, memory = shape_of(cfg.model.path, config), cfg.cluster.device_memory_gib * GIB
    if shape is None:
        return "full", say + f'"full" (the shape of {cfg.model.path} is not known: the safe choice)'
    if not memory:
        return "full", say + '"full" (cluster.device_memory_gib not given: the safe choice)'
    tried = []
    for mode in ("off", "selective", "full"):
        plan = phases(cfg, shape, trainers, memory, mode)
        need = sum((plan.get("train") or plan["train (trainer device)"]).values()) / GIB
        if need <= memory / GIB:
            return mode, say + (f'"{mode}": its train phase needs {need:.1f} of {memory / GIB:g} GiB '
                                f"(cluster.device_memory_gib){''.join(tried)}")
        tried.append(f'; "{mode}" would need {need:.1f}')
    return "full", say + (f'"full": no mode\'s train phase fits {memory / GIB:g} GiB '
                          f"(cluster.device_memory_gib){''.join(tried)}")


def plan_lines(cfg, trainers: int, config=None) -> list[str]:
    """The plan's lines for the dry run (with model.activation_checkpointing = "auto", the mode
    it resolves to: :func:`checkpointing`); ConfigError when a phase cannot fit."""
    shape = shape_of(cfg.model.path, config)
    mode, why = checkpointing(cfg, trainers, config)
    if shape is None:
        return [f"memory plan: the shape of {cfg.model.path} is not known before it is downloaded "
                "(no local config.json, not in families.REFERENCE_SHAPES)", *([why] if why else [])]
    memory = cfg.cluster.device_memory_gib * GIB
    layout = ("colocated: each device a trainer and its engine" if cfg.cluster.colocate
              else "static split: trainer devices and engine devices apart")
    lines = [f"memory plan (GiB per device; docs/memory.md): {shape.params / 1e9:.2f}B parameters, "
             f"{trainers} trainer rank(s), {layout}; device "
             + (f"{cfg.cluster.device_memory_gib:g} GiB (cluster.device_memory_gib)" if memory else
                "memory not given (cluster.device_memory_gib = 0: not judged)")]
    plan = phases(cfg, shape, trainers, memory, mode)
    for phase, parts in plan.items():
        lines.append(f"   {phase}: {sum(parts.values()) / GIB:.1f} = " +
                     " + ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items()))
    for phase, parts in plan.items():
        if memory and sum(parts.values()) > memory:
            room = memory - sum(v for k, v in parts.items() if not k.startswith("engine ("))
            weights = shape.params * BYTES[cfg.model.dtype]
            raise ConfigError(f"memory plan: the {phase} phase needs {sum(parts.values()) / GIB:.1f} GiB "
                              f"of a {memory / GIB:g} GiB device; "
                              f"{knob(phase, parts, cfg, room if room > 1.1 * weights else 0, mode)}")
    return lines + ([f"   {why}"] if why else [])
