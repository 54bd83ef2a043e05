"""The trainer ranks' side: the policy, its reference and optimizer (the update itself: update.py).

:class:`Trainer` is what a trainer rank holds (None on generation-only ranks); :func:`build`
makes it (meta skeleton -> LoRA adapters -> FSDP2 -> rank 0's weights scattered). The LR
schedule steps once per rollout step (docs/loss.md); the moving reference: docs/loss.md.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import device as D
import inputs as I
import lora
from microbatches import packing
import model as M
import routing as R
import sync as S
from errors import ModelError


@dataclass
class Trainer:
    policy: Any              # the model (with LoRA: a peft model), sharded with FSDP2 over the trainer mesh
    ref: Any                 # reference copy (loss.kl_coef > 0 without LoRA), else None; mix_reference
    opt: torch.optim.Optimizer
    sched: Any               # LR schedule, stepped once per rollout step
    sender: S.Sender         # weight sync to the engines
    device: torch.device
    pixels: dict = field(default_factory=dict)  # processed images by id(image), for the run
    kl_coef: float | None = None  # adaptive KL coefficient (loss.kl_target); None: loss.kl_coef
    base_ref: bool = False   # LoRA with loss.kl_coef > 0: the reference is the base (adapters off)
    version: int = 0         # the weight version the policy holds (logprob_diff/max compares its tokens)


def build(model_path: str, world, device: torch.device, cfg, channel: S.CommChannel | None = None,
          full=None) -> Trainer:
    """The :class:`Trainer` from the run's config; `full`: the model as trainer rank 0 loaded it
    (CPU, fp32; None elsewhere), scattered to every trainer's shards. With LoRA: adapters from
    `run.seed` on the skeleton and `full` before FSDP, and no reference copy."""
    from torch.distributed.device_mesh import DeviceMesh

    mc, tc, lc, total_steps = cfg.model, cfg.train, cfg.loss, cfg.run.steps
    if full is None and world.trainer_index == 0:  # scripts and tests: load it here
        full = M.load_model(model_path, dtype=torch.float32)
    # Never DeviceMesh(ranks) over a subset: that calls new_group on the whole world.
    mesh = DeviceMesh.from_group(world.train_group, device.type)
    quiet_view_warning()
    # train.packing: one row per micro-batch, for attention.py's kernel ("segments") or
    # flash_attention_2's varlen path ("varlen")
    attention = M.attention_for(packing(tc, device))
    policy = M.model_from_config(model_path, meta=True, device_type=device.type,
                                 attention=attention)  # skeleton
    if mc.lora_rank:  # the same adapters on both; the first rank's are scattered like the rest
        policy = lora.add_lora(policy, mc, cfg.run.seed)
        full = lora.add_lora(full, mc, cfg.run.seed) if full is not None else None
    # train(): transformers builds in eval mode, where activation checkpointing never runs
    policy = M.shard_from_rank0(policy, full, mesh, device, world.train_group,
                                mixed_precision=mc.mixed_precision,
                                checkpointing=mc.activation_checkpointing).train()
    ref = None
    if lc.kl_coef > 0 and not mc.lora_rank:  # reference, sharded like the policy (mix_reference)
        ref = M.shard_from_rank0(M.model_from_config(model_path, meta=True, device_type=device.type,
                                                     attention=attention),
                                 full, mesh, device, world.train_group,
                                 mixed_precision=mc.mixed_precision).eval()
        ref.requires_grad_(False)
        R.attach(ref, mc.moe_routing_replay)
    if not R.attach(policy, mc.moe_routing_replay) and mc.moe_routing_replay:  # MoE: replay, or compare
        raise ModelError(f"model.moe_routing_replay: {model_path} has no MoE router (a dense model)")
    # LoRA: the reference is the policy with its adapters disabled (reference_logprobs)
    # fused where the device has the kernel, else foreach (device.adamw_options; on CPU bitwise
    # the per-tensor result)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=tc.lr,
                            betas=(tc.beta1, tc.beta2), weight_decay=tc.weight_decay,
                            **D.adamw_options(device.type))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, tc, total_steps))
    sender = S.Sender(policy, mc.dtype, cfg.sync.bucket_mb, group=world.sync_group, src=0,
                      is_root=world.is_root, device=device, channel=channel)
    return Trainer(policy, ref, opt, sched, sender, device,
                   base_ref=bool(mc.lora_rank) and lc.kl_coef > 0)


def load_checked(world, model_path: str, mc=None):
    """Rank 0 loads the model on the CPU (kept for :func:`build`) and checks `mc`'s LoRA targets;
    collective over `world.ctrl`: every rank raises the same ModelError for a folder without the
    model's weights or targets matching no linear layer."""
    full, problem = None, None
    if world.is_root:
        try:
            full = M.load_model(model_path, dtype=torch.float32)
            if mc is not None and mc.lora_rank:
                import lora
                lora.lora_targets(full, mc)
        except ModelError as e:
            problem = str(e)
    box = [problem]
    dist.broadcast_object_list(box, 0, group=world.ctrl)
    if box[0]:
        raise ModelError(box[0])
    return full


def has_reference(tr: Trainer) -> bool:
    """A reference policy to compare with: its own copy, or with LoRA the base (adapters off)."""
    return tr.ref is not None or tr.base_ref


def reference_logprobs(tr: Trainer, batch: dict, tokens: I.Tokens, temperature: float) -> torch.Tensor:
    """The reference policy's logprobs of `batch` (no gradient): the frozen copy, or with LoRA the
    policy itself with its adapters disabled (peft's `disable_adapter()`: the frozen base)."""
    with torch.no_grad(), R.not_counted(tr.policy):  # routing_agreement: the policy's own
        if tr.ref is not None:
            return M.sequence_logprobs(tr.ref, batch, tokens, temperature)[0]
        with tr.policy.disable_adapter():
            return M.sequence_logprobs(tr.policy, batch, tokens, temperature)[0]


def parameter_counts(tr: Trainer) -> dict[str, int]:
    """What the trainers hold, whole-model numbers (FSDP2 shards them over the trainer ranks):
    `total` policy parameters, `trainable` ones, `held` parameters of every model built (policy
    + reference copy), and `optimizer_bytes`: AdamW's two moments per trainable parameter."""
    params = list(tr.policy.parameters())
    trainable = [p for p in params if p.requires_grad]
    ref = sum(p.numel() for p in tr.ref.parameters()) if tr.ref is not None else 0
    total = sum(p.numel() for p in params)
    return {"total": total, "trainable": sum(p.numel() for p in trainable), "held": total + ref,
            "optimizer_bytes": sum(2 * p.numel() * p.element_size() for p in trainable)}


def quiet_view_warning() -> None:
    """Silence FSDP2's "returned a view tensor" UserWarning for this process (harmless here:
    docs/metrics.md, "Console")."""
    import warnings
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor",
                            category=UserWarning)


def too_many_skipped(tc, world, skipped_in_row: int) -> bool:
    """Every rank agrees whether `train.max_skipped_steps` non-finite steps came in a row
    (`[train]` tc; collective over the world)."""
    stop = torch.tensor([skipped_in_row >= tc.max_skipped_steps], dtype=torch.int64)
    dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=world.ctrl)
    if stop.item() and world.is_root:
        print(f"error: {tc.max_skipped_steps} consecutive steps had a non-finite loss or "
              f"gradient norm (train.max_skipped_steps); stopping", file=sys.stderr)
    return bool(stop.item())


def lr_factor(step: int, tc, total_steps: int) -> float:
    """The LR multiplier at rollout step `step` (0-based): linear warm-up, then `tc.lr_schedule`
    from 1 to `min_lr_ratio` over the steps after the warm-up, as transformers' schedules do. A
    pure function of (step, config): a resumed run continues it exactly."""
    w = tc.warmup_steps
    if w and step < w:
        return (step + 1) / w
    if tc.lr_schedule == "constant":
        return 1.0
    t = min(1.0, max(0.0, (step - w) / max(1, total_steps - w)))
    low = tc.min_lr_ratio
    if tc.lr_schedule == "linear":
        return 1.0 - (1.0 - low) * t
    return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * t))


def apply_optimizer_config(tr: Trainer, tc, total_steps: int) -> dict[str, tuple]:
    """After a resume: make the restored optimizer and schedule follow `[train]` as configured
    now (lr, betas, weight decay, schedule, warm-up; grad_clip is read every step anyway). The
    schedule keeps its position. Returns {key: (restored, now)} for what changed."""
    changed: dict[str, tuple] = {}
    for g in tr.opt.param_groups:
        for key, new in (("betas", (tc.beta1, tc.beta2)), ("weight_decay", tc.weight_decay),
                         ("initial_lr", tc.lr)):
            old = tuple(g[key]) if key == "betas" else g[key]
            if old != new:
                changed[{"initial_lr": "lr"}.get(key, key)] = (old, new)
            g[key] = new
    sched = tr.sched
    old_lr = sched.get_last_lr()[0]
    sched.base_lrs = [tc.lr for _ in sched.base_lrs]
    sched.lr_lambdas = [lambda s: lr_factor(s, tc, total_steps) for _ in sched.lr_lambdas]
    lrs = [base * lr_factor(sched.last_epoch, tc, total_steps) for base in sched.base_lrs]
    for g, lr in zip(tr.opt.param_groups, lrs):
        g["lr"] = lr
    sched._last_lr = lrs
    if lrs[0] != old_lr:
        changed["current lr"] = (old_lr, lrs[0])
    return changed


@torch.no_grad()
def mix_reference(ref, policy, alpha: float) -> None:
    """TRL's sync_ref_model: `ref <- alpha * policy + (1 - alpha) * ref` on each rank's local
    shards (sharded alike: no communication). Every FSDP unit is resharded first: after a
    forward without backward the root holds unsharded copies, which the next reshard drops."""
    reshard(ref)
    reshard(policy)
    pairs = zip(ref.named_parameters(), policy.named_parameters(), strict=True)
    for (name, r), (other, p) in pairs:
        rl, pl = _local(r), _local(p)
        if name != other or rl.shape != pl.shape:
            raise RuntimeError(f"reference and policy are not sharded alike: {name} "
                               f"{tuple(rl.shape)} vs {other} {tuple(pl.shape)}")
        rl.mul_(1.0 - alpha).add_(pl, alpha=alpha)


def reshard(module) -> None:
    """Every FSDP2 unit of `module` back to its sharded parameters (a no-op for plain modules)."""
    from torch.distributed.fsdp import FSDPModule
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer_step(tr: Trainer, tc) -> tuple[float, bool]:
    """Clip, then step unless the global gradient norm is non-finite; gradients cleared.
    Returns (norm before clipping, skipped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(tr.policy.parameters(), tc.grad_clip)
    grad_norm = float(S.full_tensor(grad_norm))
    # All trainer ranks see the same global norm, so they agree on skipping a non-finite step.
    skipped = not (grad_norm == grad_norm and abs(grad_norm) != float("inf"))
    if not skipped:
        tr.opt.step()
    tr.opt.zero_grad(set_to_none=True)
    return grad_norm, skipped
