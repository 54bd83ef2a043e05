"""How the trainer ranks hold a model: FSDP2's units (each decoder layer, the vision tower whole),
activation checkpointing's modes (model.activation_checkpointing: full | selective | off), each
decoder layer compiled (model.compile), and a model sharded from the one copy the first trainer
rank loaded."""
from __future__ import annotations

import functools
import logging

import torch

import families as F


def fsdp_units(model) -> list:
    """The modules FSDP2 shards one at a time, children before parents: every decoder layer (an
    instance of the model's `_no_split_modules`) and the vision tower whole (families.vision_tower:
    one all-gather and one reduce-scatter for its blocks, not one per block). Found by class, its
    bases included: the same modules once FSDP2 has wrapped them (it subclasses each unit)."""
    tower = F.vision_tower(model)
    names = set(getattr(model, "_no_split_modules", None) or ())
    inside = set(tower.modules()) if tower is not None else set()
    layers = [m for m in model.modules() if m not in inside
              and any(c.__name__ in names for c in type(m).__mro__)]
    return ([tower] if tower is not None else []) + layers


def decoder_layers(model) -> list:
    """The decoder layers among :func:`fsdp_units` (every unit but the vision tower)."""
    tower = F.vision_tower(model)
    return [u for u in fsdp_units(model) if u is not tower]


# what "selective" checkpointing keeps from the forward: the matmuls' and attention kernels'
# outputs (the compute); the elementwise ops between them (norms, rotary, activations) run again
_SAVED = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _keep_compute(_ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: keep the matmuls' and attention kernels' outputs (SDPA's
    kernels, NPU's fusion attention), recompute the rest. At module level: one function object
    wherever the options are built (torch.compile reads a checkpoint's context_fn, a partial of
    it, as a constant and guards on it)."""
    from torch.utils.checkpoint import CheckpointPolicy
    name = op.name()
    keep = name in _SAVED or "attention" in name
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointing_mode(value: bool | str) -> str:
    """model.activation_checkpointing as a mode: true = "full", false = "off"; "auto" is the
    memory plan's to decide (memplan.checkpointing) before anything reaches here."""
    if value == "auto":
        raise ValueError('model.activation_checkpointing = "auto" reached the sharding unresolved: '
                         "pass the mode memplan.checkpointing chose (trainer.build does)")
    return {True: "full", False: "off"}.get(value, value) if isinstance(value, bool) else value


def checkpointing_options(value: bool | str) -> dict | None:
    """transformers' gradient_checkpointing_kwargs for model.activation_checkpointing's mode:
    "full" recomputes every decoder layer in the backward, "selective" only what is not a matmul
    or attention output (torch's selective checkpointing policy), "off" (None) nothing."""
    mode = checkpointing_mode(value)
    if mode == "off":
        return None
    options = {"use_reentrant": False}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_compute)
    return options


def _checkpointed(layer, forward, options: dict):
    """`layer`'s forward under torch.utils.checkpoint (non-reentrant, `options` from
    :func:`checkpointing_options`) in train mode, plain in eval mode, as transformers' own
    checkpointing acts."""
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        if not layer.training:
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, **options, **kwargs)
    return run


class RecompileLimitWarning(logging.Filter):
    """model.compile's one line when torch.compile gives up on a decoder layer: past dynamo's
    recompile limit (torch._dynamo.config.recompile_limit, 8) a frame runs eagerly, for the rest
    of the run, for every input its compiled versions do not fit. Left at 8 on purpose: a layer
    compiled over and over is a bug to fix (what recompiles it: dynamo's own warning, printed
    just before, names the last guard that failed), not a limit to raise; the packed "segments"
    layout compiles each layer at most twice whatever its plans (attention._op). The filter
    keeps dynamo's warning and adds the line, once per process."""

    LOGGER = "torch._dynamo.convert_frame"  # where dynamo warns (torch 2.10 to 2.13)
    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not RecompileLimitWarning.said and str(record.msg).startswith("torch._dynamo hit config."):
            RecompileLimitWarning.said = True
            print("warning: model.compile: torch.compile hit its recompile limit in a decoder layer "
                  "(dynamo's warning above says why); that layer now runs uncompiled for inputs "
                  "unlike those it compiled for", flush=True)
        return True

    @classmethod
    def install(cls) -> None:
        log = logging.getLogger(cls.LOGGER)
        if not any(isinstance(f, cls) for f in log.filters):
            log.addFilter(cls())


def apply_fsdp(model, mesh, *, mixed_precision: bool = False, checkpointing: bool | str = False,
               compile: bool = False):
    """Shard the policy with FSDP2 over `mesh` (the trainer-only mesh): :func:`fsdp_units` first,
    then the root (embeddings, norms, lm_head). `checkpointing`: model.activation_checkpointing
    (:func:`checkpointing_options`: the decoder layers only; the tower recomputes nothing);
    `compile`: model.compile, each decoder layer under torch.compile (its first forward compiles,
    a new shape once more, dynamic; packed "segments" plans recompile nothing: attention._op); a
    layer past dynamo's recompile limit says so (:class:`RecompileLimitWarning`). In torchtitan's
    order: checkpoint, then compile, then FSDP2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = checkpointing_options(checkpointing)
    if compile:
        # the checkpoint goes inside each compiled layer, where torch.compile traces it (a
        # selective policy included) and its backward recomputes compiled code; transformers'
        # checkpointing calls the layer from outside, and the compiled layer then ran eagerly
        RecompileLimitWarning.install()
        for layer in decoder_layers(model):
            if options is not None:
                layer.forward = _checkpointed(layer, layer.forward, options)
            layer.compile()
    elif options is not None:  # acts only in train mode (transformers checks `self.training`)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        F.vision_checkpointing_off(model)
    kw = {"mesh": mesh}
    if mixed_precision:  # bf16 compute, fp32 master weights and gradient reduction
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for block in fsdp_units(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


@torch.no_grad()
def shard_from_rank0(model, full, mesh, device: torch.device, group, *,
                     mixed_precision: bool = False, checkpointing: bool | str = False,
                     compile: bool = False):
    """`model` sharded with FSDP2 over `mesh`, its weights those of `full` (the model loaded on
    the first trainer rank, None on the others). `model`: the architecture on the meta device
    (:func:`model_from_config`), with the same LoRA adapters as `full` if any; the first rank
    scatters each weight and broadcasts the buffers (rotary tables are in no state dict), so a
    trainer node holds one host copy of the model. Collective over `group` (the trainer ranks)."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    apply_fsdp(model, mesh, mixed_precision=mixed_precision, checkpointing=checkpointing, compile=compile)
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
