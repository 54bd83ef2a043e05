"""LoRA through the peft library (docs/lora.md): which layers get adapters (:func:`add_lora`),
what the engines get (:func:`engine_tensors`: adapted weights merged) and the exports
(:func:`merged_state_dict`, :func:`write_adapter`). The language model is `get_decoder()`, the
vision tower the rest, the output head `get_output_embeddings()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import device as D

from config import ModelConfig
from errors import ConfigError
from families import is_vlm

ALL_LINEAR = "all-linear"   # `[model] lora_target_modules`: every linear layer of the language model
ADAPTER = "default"         # peft's name for the one adapter
_PEFT_PREFIX = "base_model.model."


def linear_layers(model) -> dict[str, str]:
    """Every linear layer LoRA can adapt, by full module name, in model order: "language" (under
    the language model, `model.get_decoder()`), "head" (the output head) or "vision" (the rest: a
    VLM's vision tower and its merger)."""
    head = model.get_output_embeddings()
    language = {id(m) for m in model.get_decoder().modules()}
    return {name: "head" if m is head else "language" if id(m) in language else "vision"
            for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def lora_targets(model, mc: ModelConfig) -> list[str]:
    """The full names of the linear layers `[model]` (mc) puts adapters on (the rules of
    docs/lora.md, "What gets adapters"). ConfigError naming the key for a target that matches
    no linear layer (listing them), a tied output head, and `lora_vision` on a text-only model."""
    layers = linear_layers(model)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if mc.lora_vision and not is_vlm(model.config):
        raise ConfigError(f"model.lora_vision=true: model.path={mc.path} is a text-only model "
                         "(no vision tower to adapt)")
    allowed = [n for n, part in layers.items() if part != "vision" or mc.lora_vision]
    wanted = mc.lora_target_modules
    wanted = [wanted] if isinstance(wanted, str) else wanted
    chosen = {n for n in allowed if layers[n] != "head"} if ALL_LINEAR in wanted else set()
    for t in wanted:
        if t == ALL_LINEAR:
            continue
        hit = {n for n in allowed if n == t or n.endswith("." + t)}
        if not hit:
            raise ConfigError(f"model.lora_target_modules: {t!r} matches no linear layer of "
                             f"{'the model' if mc.lora_vision else 'the language model'}; "
                             f"{_linear_names(layers, mc.lora_vision)}")
        if tied and any(layers[n] == "head" for n in hit):
            raise ConfigError(f"model.lora_target_modules: {t!r} is the output head, which "
                             f"model.path={mc.path} ties to its input embeddings (an adapter "
                             "merged into it would change them too); leave it out")
        chosen |= hit
    targets = [n for n in allowed if n in chosen]
    if targets and mc.lora_rank:
        dims = {n: min(model.get_submodule(n).in_features, model.get_submodule(n).out_features)
                for n in targets}
        small = min(dims, key=dims.get)
        if mc.lora_rank > dims[small]:
            raise ConfigError(f"model.lora_rank={mc.lora_rank} is above the smallest adapted "
                              f"dimension, {dims[small]} ({small}): an adapter cannot have a higher "
                              f"rank than its layer; use model.lora_rank <= {dims[small]}")
    return targets


def _linear_names(layers: dict[str, str], vision: bool) -> str:
    """The distinct `parent.leaf` names of the linear layers, by part, for an error message."""
    def names(part):
        leaves = (".".join(n.split(".")[-2:]) for n, p in layers.items() if p == part)
        return ", ".join(dict.fromkeys(leaves))
    text = f"its linear layers: {names('language')} (or \"{ALL_LINEAR}\"), the head {names('head')}"
    if "vision" in layers.values():
        text += (f"; the vision tower's: {names('vision')}" +
                 ("" if vision else " (adapted only with model.lora_vision = true)"))
    return text


def add_lora(model, mc: ModelConfig, seed: int = 0):
    """`model` with LoRA adapters (peft) on :func:`lora_targets`, as a peft model: the base
    weights frozen, adapters of rank `mc.lora_rank` scaled by `lora_alpha / lora_rank`, no
    dropout, peft's initialisation (A Kaiming-uniform from `seed`, B zero: the adapted model
    starts equal to the base). Wraps `model` in place (works on the meta device too)."""
    import warnings

    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=mc.lora_rank, lora_alpha=mc.lora_alpha, lora_dropout=0.0, bias="none",
                        target_modules=lora_targets(model, mc))
    # the adapters are made on the CPU (or meta) model, before it moves: the CPU generator only
    with D.fork_rng(torch.device("cpu")), warnings.catch_warnings():
        torch.manual_seed(seed)
        # peft asks transformers' deprecated `is_gradient_checkpointing` (transformers 5.24)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        return get_peft_model(model, config)


def lora_layers(model) -> list[tuple[str, Any]]:
    """(name, peft LoRA layer) of every adapted module of `model` ([] for a plain model)."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def has_lora(model) -> bool:
    return bool(lora_layers(model))


def plain_model(model):
    """The transformers model inside a peft model (its own config, tied keys, conversions)."""
    return model.get_base_model() if has_lora(model) else model


def plain_name(name: str) -> str:
    """A parameter's name in the model without adapters (peft's `base_model.model.` prefix and
    `.base_layer` removed)."""
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """An adapted linear layer's weight as one matrix: W + scale * (B A), in one fused kernel
    (`addmm`: no [out, in] temporaries; within float rounding of peft's own merge, tested)."""
    return torch.addmm(weight, b, a, alpha=scale)


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every trainer rank (a collective for FSDP2's DTensor shards)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


@dataclass(frozen=True)
class EngineTensor:
    """One tensor of the model the engines hold, as the trainer makes it from its parameters."""
    name: str                   # the plain model's parameter name
    shape: tuple[int, ...]
    parts: tuple                # the trainer's parameters: (p,) or, merged, (W, A, B)
    scale: float = 0.0          # merged: W + (B A) * scale
    changes: bool = True        # changes in training (else only the first sync sends it)

    def gather(self) -> torch.Tensor:
        """The whole tensor on every trainer rank: a collective over them (FSDP2 all-gathers each
        part), so every trainer rank must gather the same tensors in the same order."""
        if len(self.parts) == 1:
            return full_tensor(self.parts[0])
        w, a, b = (full_tensor(p) for p in self.parts)
        return merge(w, a, b, self.scale)


def engine_tensors(model) -> list[EngineTensor]:
    """The engines' model as the trainer holds it, in the plain model's parameter order: every
    parameter, or with adapters the base model's with each adapted weight merged (:func:`merge`).
    Marked as changing: the adapted linear layers and their siblings under the same parent,
    which vLLM fuses with them (qkv_proj, gate_up_proj) and reloads only whole."""
    layers = dict(lora_layers(model))
    if not layers:
        return [EngineTensor(n, tuple(p.shape), (p,)) for n, p in model.named_parameters()]
    adapted = {f"{n}.base_layer.weight": m for n, m in layers.items()}
    parents = {n.rpartition(".")[0] for n in layers}
    linear = {n for n, m in model.named_modules() if n in layers or (
        isinstance(m, torch.nn.Linear) and ".lora_" not in n and not n.endswith(".base_layer"))}
    out = []
    for n, p in model.named_parameters():
        if ".lora_" in n:
            continue
        module = n.rpartition(".")[0].removesuffix(".base_layer")
        changes = module in linear and module.rpartition(".")[0] in parents
        m = adapted.get(n)
        parts = (p,) if m is None else (p, m.lora_A[ADAPTER].weight, m.lora_B[ADAPTER].weight)
        out.append(EngineTensor(plain_name(n), tuple(p.shape), parts,
                                0.0 if m is None else float(m.scaling[ADAPTER]), changes))
    return out


def merged_state_dict(model, state: dict) -> dict:
    """A full state dict of `model` (`get_model_state_dict`) under the plain model's names, each
    adapted weight merged (:func:`merge`, as the engines get it), the adapters left out; `state`
    itself for a model without adapters."""
    layers = lora_layers(model)
    if not layers:
        return state
    out = {plain_name(k): v for k, v in state.items() if ".lora_" not in k}
    for n, m in layers:
        out[plain_name(f"{n}.base_layer.weight")] = merge(
            state[f"{n}.base_layer.weight"], state[f"{n}.lora_A.{ADAPTER}.weight"],
            state[f"{n}.lora_B.{ADAPTER}.weight"], float(m.scaling[ADAPTER]))
    return out


def write_adapter(folder: Path, model, state: dict, base: str) -> None:
    """The adapters of `model` in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`:
    `PeftModel.from_pretrained(base model, folder)` loads them), from its full state dict."""
    import copy

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER,
                                        save_embedding_layers=False)
    save_file({k: v.contiguous() for k, v in weights.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.peft_config[ADAPTER])
    config.base_model_name_or_path = base
    config.inference_mode = True
    config.save_pretrained(str(folder))
