"""The trainer ranks' side: the policy, its reference and optimizer (the update itself: update.py).

:class:`Trainer` is what a trainer rank holds (None on generation-only ranks); :func:`build`
makes it (meta skeleton -> LoRA adapters -> FSDP2 -> rank 0's weights scattered). The LR
schedule steps once per rollout step (docs/loss.md); the moving reference: docs/loss.md.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import attention as A
import families
import device as D
import inputs as I
import lora
import memplan
import model as M
import sharding
import routing
import sync as S
from config import Config, TrainConfig
from errors import ConfigError, ModelError

MASTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # train.master_dtype


@dataclass
class Trainer:
    policy: Any              # the model (with LoRA: a peft model), sharded with FSDP2 over the trainer mesh
    ref: Any                 # reference copy (loss.kl_coef > 0 without LoRA), else None; mix_reference
    opt: torch.optim.Optimizer
    sched: Any               # LR schedule, stepped once per rollout step
    sender: S.Sender         # weight sync to the engines
    device: torch.device
    layout: M.RowLayout      # its micro-batches' rows, decided at start (microbatches.resolve_layout)
    pixels: dict = field(default_factory=dict)  # processed images by id(image), for the run
    kl_coef: float | None = None  # adaptive KL coefficient (loss.kl_target); None: loss.kl_coef
    base_ref: bool = False   # LoRA with loss.kl_coef > 0: the reference is the base (adapters off)
    version: int = 0         # the weight version the policy holds (logprob_diff/max compares its tokens)
    replay_ref: bool = False  # model.moe_routing_replay_ref: the reference's forward replays the engine's routing
    teacher: Any = None      # on-policy distillation's teacher (model.teacher_path), frozen, sharded like ref
    base_teacher: bool = False  # model.teacher_path = "base" (LoRA): the policy with its adapters off
    rewards: Any = None      # role = "trainer" reward models (reward_models.TrainerScorer), set at start
    checkpointing: str = "off"  # model.activation_checkpointing as the policy runs it ("auto": resolve_checkpointing)


def build(model_path: str, world, device: torch.device, cfg: Config, layout: M.RowLayout,
          channel: S.CommChannel | None = None, full=None, teacher_full=None,
          checkpointing: str | None = None) -> Trainer:
    """The :class:`Trainer` from the run's config; `full` (`teacher_full`): the model (the
    distillation teacher) as trainer rank 0 loaded it (CPU, fp32; None elsewhere), scattered to
    every trainer's shards; `layout`: its micro-batches' rows (microbatches.resolve_layout);
    `checkpointing`: the mode :func:`resolve_checkpointing` decided at start (None: decided here).
    With LoRA: adapters from `run.seed` on the skeleton and `full` before FSDP, and no
    reference copy."""
    from torch.distributed.device_mesh import DeviceMesh

    mc, tc, lc, total_steps = cfg.model, cfg.train, cfg.loss, cfg.run.steps
    checkpointing = checkpointing or resolve_checkpointing(cfg, world, model_path)[0]
    if full is None and world.trainer_index == 0:  # scripts and tests: load it here
        full = M.load_model(model_path, dtype=torch.float32)
    # Never DeviceMesh(ranks) over a subset: that calls new_group on the whole world.
    mesh = DeviceMesh.from_group(world.train_group, device.type)
    quiet_view_warning()
    # packed rows: one row per micro-batch, for attention.py's kernel ("segments") or
    # flash_attention_2's varlen path ("varlen")
    attention = M.attention_for(layout.packed)
    policy = fewer_launches(M.model_from_config(model_path, meta=True, device_type=device.type,
                                                attention=attention))  # skeleton
    if mc.lora_rank:  # the same adapters on both; the first rank's are scattered like the rest
        policy = lora.add_lora(policy, mc, cfg.run.seed)
        full = lora.add_lora(full, mc, cfg.run.seed) if full is not None else None
    # train.master_dtype = "bfloat16": the parameters themselves bf16 (AdamW's state follows
    # them), gradients reduced in fp32 and kept bf16, as AReaL's FSDP engine (its
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over bf16 parameters)
    dtype, bf16 = MASTER_DTYPES[tc.master_dtype], tc.master_dtype == "bfloat16"
    # train(): transformers builds in eval mode, where activation checkpointing never runs
    policy = sharding.shard_from_rank0(params_to(policy, dtype), full, mesh, device, world.train_group,
                                mixed_precision=mc.mixed_precision or bf16,
                                checkpointing=checkpointing, compile=mc.compile).train()
    ref = None
    if lc.kl_coef > 0 and not mc.lora_rank:  # reference, sharded like the policy (mix_reference)
        skeleton = fewer_launches(M.model_from_config(model_path, meta=True, device_type=device.type,
                                                      attention=attention))
        ref = sharding.shard_from_rank0(params_to(skeleton, dtype), full, mesh, device, world.train_group,
                                 mixed_precision=mc.mixed_precision or bf16, compile=mc.compile).eval()
        ref.requires_grad_(False)
        routing.attach(ref, mc.moe_routing_replay)
    teacher, folder = None, teacher_folder(cfg, model_path)
    if folder:  # frozen like the reference; routed its own way (no replay hooks on it)
        if teacher_full is None and world.trainer_index == 0:
            teacher_full = M.load_model(folder, dtype=torch.float32)
        skeleton = fewer_launches(M.model_from_config(folder, meta=True, device_type=device.type,
                                                      attention=attention))
        teacher = sharding.shard_from_rank0(params_to(skeleton, dtype), teacher_full, mesh, device,
                                     world.train_group, mixed_precision=mc.mixed_precision or bf16,
                                     compile=mc.compile).eval()
        teacher.requires_grad_(False)
    if not routing.attach(policy, mc.moe_routing_replay) and mc.moe_routing_replay:  # MoE: replay, or compare
        raise ModelError(f"model.moe_routing_replay: {model_path} has no MoE router (a dense model)")
    # LoRA: the reference is the policy with its adapters disabled (reference_logprobs)
    # fused where the device has the kernel, else foreach (device.adamw_options; on CPU bitwise
    # the per-tensor result)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=tc.lr,
                            betas=(tc.beta1, tc.beta2), weight_decay=tc.weight_decay,
                            **D.adamw_options(device.type))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, tc, total_steps))
    sender = S.Sender(policy, mc.dtype, cfg.sync.bucket_mb, group=world.sync_group, src=0,
                      is_root=world.is_root or world.colocated, device=device, channel=channel)
    return Trainer(policy, ref, opt, sched, sender, device, layout,
                   base_ref=bool(mc.lora_rank) and lc.kl_coef > 0, replay_ref=mc.moe_routing_replay_ref,
                   teacher=teacher, base_teacher=mc.teacher_path == "base", checkpointing=checkpointing)


def resolve_checkpointing(cfg: Config, world, model_path: str) -> tuple[str, str]:
    """model.activation_checkpointing as the run's trainers run it ("full" | "selective" |
    "off") and the start-up line that says why ("" unless "auto"): memplan.checkpointing over
    the model's own config. Decided once at start (train.set_up), held by the :class:`Trainer`."""
    config = M.load_config(model_path) if cfg.model.activation_checkpointing == "auto" else None
    return memplan.checkpointing(cfg, len(world.trainers), config)


def fewer_launches(model):
    """`model` as the trainer runs it: its vision blocks' windows in one attention call each
    (attention.one_call_vision); `model.compile` compiles each decoder layer where it is
    sharded (sharding.apply_fsdp)."""
    A.one_call_vision(model)
    return model


def params_to(model, dtype: torch.dtype):
    """`model` with its floating-point parameters (not its buffers: rotary tables stay float32,
    as transformers' own bf16 loading keeps them) in `dtype`; tied parameters stay tied."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def check(cfg: Config) -> None:
    """The trainers' keys that need more than config.py knows, at load: model.teacher_path's
    family (families.check_model_path), train.master_dtype against the model keys; one
    ConfigError naming the keys."""
    tc, mc = cfg.train, cfg.model
    if mc.teacher_path not in ("", "base", mc.path):
        families.check_model_path(mc.teacher_path, "model.teacher_path")

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)
    need(tc.master_dtype in MASTER_DTYPES, f"train.master_dtype: unknown {tc.master_dtype!r} "
         f"(known: {', '.join(MASTER_DTYPES)})")
    if tc.master_dtype == "bfloat16":
        need(not mc.mixed_precision, "train.master_dtype = \"bfloat16\" with model.mixed_precision = "
             "true: that asks for fp32 master weights, this for bf16 ones; set one of them")
        need(mc.dtype == "bfloat16", "train.master_dtype = \"bfloat16\" needs model.dtype = "
             "\"bfloat16\" (the engines would run float32 copies of bf16 weights)")
        need(not mc.lora_rank, "train.master_dtype = \"bfloat16\" with LoRA (model.lora_rank > 0): the "
             "adapters train over a frozen base; keep train.master_dtype = \"float32\"")


def teacher_folder(cfg: Config, model_path: str) -> str | None:
    """The distillation teacher's folder: None without one or for LoRA's base (no copy);
    model.path's own value: `model_path`, the policy's initial weights; a tiny name: that tiny
    model, built under the run folder like model.path's (model.resolve_path)."""
    t = cfg.model.teacher_path
    if not t or t == "base":
        return None
    if t == cfg.model.path:
        return model_path
    return M.resolve_path(t, Path(cfg.run.out_dir), cfg.run.seed)


def check_teacher(cfg: Config, model_path: str) -> None:
    """model.teacher_path fits the policy (at start, before any model loads): a family in the
    table, the policy's tokenizer (the same vocabulary: its logprobs are of the same tokens) and,
    for a vision-language policy, a vision-language teacher (it sees the prompt's images); else
    a ConfigError naming the key."""
    folder = teacher_folder(cfg, model_path)
    if folder is None or folder == model_path:
        return
    try:
        vl = [I.load_tokenizer(p).get_vocab() for p in (model_path, folder)]
        kinds = [families.is_vlm(M.load_config(p)) for p in (model_path, folder)]
    except (ModelError, OSError, ValueError) as e:
        raise ConfigError(f"model.teacher_path={cfg.model.teacher_path}: {e}") from None
    if vl[0] != vl[1]:
        raise ConfigError(f"model.teacher_path={cfg.model.teacher_path}: its tokenizer differs from "
                          f"model.path's ({len(vl[1])} vs {len(vl[0])} tokens); distillation compares "
                          "the logprobs of the same token ids")
    if kinds[0] and not kinds[1]:
        raise ConfigError(f"model.teacher_path={cfg.model.teacher_path}: a text-only teacher for a "
                          "vision-language policy would not see the prompts' images")


def load_checked(world, model_path: str, cfg: Config | None = None):
    """Rank 0 loads the model (and the distillation teacher's, after :func:`check_teacher` on
    every rank) on the CPU, kept for :func:`build`, and checks the LoRA targets; collective over
    `world.ctrl`: every rank raises the same ModelError for a folder without the model's weights
    or targets matching no linear layer. Returns (model, teacher), None on the other ranks."""
    mc = cfg.model if cfg is not None else None
    teacher = None
    if cfg is not None:
        check_teacher(cfg, model_path)
        teacher = teacher_folder(cfg, model_path)
    full, teacher_full, problem = None, None, None
    if world.is_root:
        try:
            full = M.load_model(model_path, dtype=torch.float32)
            if mc is not None and mc.lora_rank:
                import lora
                lora.lora_targets(full, mc)
            if teacher:
                teacher_full = M.load_model(teacher, dtype=torch.float32)
        except ModelError as e:
            problem = str(e) if not teacher or full is None or teacher_full is not None else \
                f"model.teacher_path: {e}"
    box = [problem]
    dist.broadcast_object_list(box, 0, group=world.ctrl)
    if box[0]:
        raise ModelError(box[0])
    return full, teacher_full


def has_teacher(tr: Trainer) -> bool:
    return tr.teacher is not None or tr.base_teacher


def teacher_logprobs(tr: Trainer, batch: dict, tokens: I.Tokens, temperature: float) -> torch.Tensor:
    """The distillation teacher's logprobs of `batch` (no gradient), at the policy's sampling
    temperature: its own copy, or with LoRA's "base" the policy with its adapters disabled
    (routed its own way)."""
    with torch.no_grad():
        if tr.teacher is not None:
            return M.sequence_logprobs(tr.teacher, batch, tokens, temperature)[0]
        with routing.as_reference(tr.policy, False), tr.policy.disable_adapter():
            return M.sequence_logprobs(tr.policy, batch, tokens, temperature)[0]


def has_reference(tr: Trainer) -> bool:
    """A reference policy to compare with: its own copy, or with LoRA the base (adapters off)."""
    return tr.ref is not None or tr.base_ref


def reference_logprobs(tr: Trainer, batch: M.MicroBatch, tokens: I.Tokens,
                       temperature: float) -> torch.Tensor:
    """The reference policy's logprobs of `batch` (no gradient): the frozen copy, or with LoRA the
    policy itself with its adapters disabled (peft's `disable_adapter()`: the frozen base)."""
    model = tr.ref if tr.ref is not None else tr.policy
    with torch.no_grad(), routing.as_reference(model, tr.replay_ref):  # routing_agreement: the policy's own
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
    ref = sum(p.numel() for m in (tr.ref, tr.teacher) if m is not None for p in m.parameters())
    total = sum(p.numel() for p in params)
    return {"total": total, "trainable": sum(p.numel() for p in trainable), "held": total + ref,
            "optimizer_bytes": sum(2 * p.numel() * p.element_size() for p in trainable)}


def quiet_view_warning() -> None:
    """Silence FSDP2's "returned a view tensor" UserWarning for this process (harmless here:
    docs/metrics.md, "Console")."""
    import warnings
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor",
                            category=UserWarning)


def too_many_skipped(tc: TrainConfig, world, skipped_in_row: int) -> bool:
    """Every rank agrees whether `train.max_skipped_steps` non-finite steps came in a row
    (`[train]` tc; collective over the world)."""
    stop = torch.tensor([skipped_in_row >= tc.max_skipped_steps], dtype=torch.int64)
    dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=world.ctrl)
    if stop.item() and world.is_root:
        print(f"error: {tc.max_skipped_steps} consecutive steps had a non-finite loss or "
              f"gradient norm (train.max_skipped_steps); stopping", file=sys.stderr)
    return bool(stop.item())


def lr_factor(step: int, tc: TrainConfig, total_steps: int) -> float:
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


def apply_optimizer_config(tr: Trainer, tc: TrainConfig, total_steps: int) -> dict[str, tuple]:
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


def optimizer_step(tr: Trainer, tc: TrainConfig) -> tuple[float, bool]:
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
