"""The trainer ranks' side of a step: the policy and its optimizer, and the updates on episodes.

- :class:`Trainer`: the record a trainer rank holds (policy sharded with FSDP2, optional frozen
  reference, AdamW, LR schedule, weight sender); `None` on generation-only ranks. With LoRA
  (`model.lora_rank > 0`) the policy is the frozen base plus adapters (lora.py), AdamW holds
  the adapters only, and the reference is the policy with its adapters disabled.
- :func:`train_step`: advantages -> which responses count (:func:`loss.keep_mask`) -> the
  step's episodes split into `[train] mini_batches` mini-batches, each with its global loss
  denominator (:func:`loss.loss_denominator`) -> for each of `ppo_epochs` epochs, the
  mini-batches in a seeded shuffled order, each one optimizer step (micro-batched
  forward/backward with gradient accumulation -> clip -> step), and the step's training metrics.
- :func:`proximal_logprobs`: with more than one update, the KL in the reward, or the adaptive
  KL coefficient, the "old" logprobs (and the reference's) computed once, without gradient,
  before the advantages and the first update; every update's ratio is taken against them, so
  from the second update on the clip binds, and the KL to the reference enters the reward
  (`loss.kl_in_reward`) or the controller (`loss.kl_target`) before anything is trained.
- :func:`mix_reference`: a reference that moves (`train.ref_update_every`, TRL's sync_ref_model).
- :func:`plan_micro_batches`: fixed-size or token-budget micro-batches, the same count on every
  trainer rank.

Every micro-batch loss is divided by its update's GLOBAL denominator, so the accumulated gradient
equals the full-mini-batch gradient whatever the micro-batching or the number of ranks (tested).
With one mini-batch and one epoch (the default, and no KL in the reward nor adaptive
coefficient) this is exactly the single update of before: no separate proximal pass, old = the
current logprobs detached (ratio 1 in value).

The LR schedule steps once per ROLLOUT step (after its updates), as in verl and EasyR1, so
`warmup_steps` counts the same steps as `run.steps` whatever mini_batches x ppo_epochs is (TRL
steps per optimizer step); `train/lr` is the rate the step's updates used (logged before the
schedule steps, as verl, EasyR1 and TRL log it). `weight_version` still advances by one per
rollout step.
"""
from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist

import inputs as I
import lora
import loss as L
import model as M
import sync as S
from errors import ModelError
from failures import fault_active

# Means over the KEPT response tokens (policy_loss's own means, weighted by its "tokens"): an
# excluded response or micro-batch adds nothing to them.
_SUMMED = ("kl", "clip_frac_low", "clip_frac_high", "clip_frac_dual", "ratio_mean",
           "tis_weight_mean", "approx_kl")


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


def build(model_path: str, world, device: torch.device, mc, tc, lc, sc, total_steps: int,
          channel: S.CommChannel | None = None, full=None, seed: int = 0) -> Trainer:
    """Policy (FSDP2), optional reference, AdamW, LR schedule over `total_steps` rollout steps,
    weight sender, from `[model]` (mc), `[train]` (tc), `[loss]` (lc) and `[sync]` (sc).
    `full`: the model as trainer rank 0 loaded it (CPU, fp32; None on the other trainer ranks),
    whose weights are scattered to every trainer's shards (model.shard_from_rank0). With
    `mc.lora_rank > 0`: adapters from `seed` on the meta skeleton and `full` (wrapped in place)
    before FSDP, no reference copy."""
    from torch.distributed.device_mesh import DeviceMesh

    if full is None and world.trainer_index == 0:  # scripts and tests: load it here
        full = M.load_model(model_path, dtype=torch.float32)
    # Never DeviceMesh(ranks) over a subset: that calls new_group on the whole world.
    mesh = DeviceMesh.from_group(world.train_group, device.type)
    quiet_view_warning()
    policy = M.model_from_config(model_path, meta=True, device_type=device.type)  # skeleton
    if mc.lora_rank:  # the same adapters on both; the first rank's are scattered like the rest
        policy = lora.add_lora(policy, mc, seed)
        full = lora.add_lora(full, mc, seed) if full is not None else None
    # train(): transformers builds in eval mode, where activation checkpointing never runs
    policy = M.shard_from_rank0(policy, full, mesh, device, world.train_group,
                                mixed_precision=mc.mixed_precision,
                                checkpointing=mc.activation_checkpointing).train()
    ref = None
    if lc.kl_coef > 0 and not mc.lora_rank:  # reference, sharded like the policy (mix_reference)
        ref = M.shard_from_rank0(M.model_from_config(model_path, meta=True, device_type=device.type),
                                 full, mesh, device, world.train_group,
                                 mixed_precision=mc.mixed_precision).eval()
        ref.requires_grad_(False)
    # LoRA: the reference is the policy with its adapters disabled (reference_logprobs)
    # foreach: one kernel per group of tensors instead of one per tensor (torch's default on
    # CUDA; on CPU bitwise the same result as the per-tensor loop, and ~15% faster)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=tc.lr,
                            betas=(tc.beta1, tc.beta2), weight_decay=tc.weight_decay, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, tc, total_steps))
    sender = S.Sender(policy, mc.dtype, sc.bucket_mb, group=world.sync_group, src=0,
                      is_root=world.is_root, device=device, channel=channel)
    return Trainer(policy, ref, opt, sched, sender, device,
                   base_ref=bool(mc.lora_rank) and lc.kl_coef > 0)


def load_checked(world, model_path: str, mc=None):
    """Rank 0 loads the model on the CPU (every weight present, no other: model.load_model) and
    keeps it for the trainers' shards (:func:`build`); every rank learns the verdict, so a folder
    that does not hold the model's weights, or `[model]` (mc) LoRA targets that match none of
    its linear layers (lora.lora_targets), stop the run with one line (ConfigError) before
    anything is built. Collective over `world.ctrl`."""
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
    with torch.no_grad():
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
    """Silence FSDP2's "returned a view tensor" UserWarning for this process.

    Why harmless here: the view tensors it finds are the image encoder's per-image features
    (`image_outputs`, split from one tensor) that transformers 5 returns beside the logits; this
    project reads only `.logits` (not a view: the LM head's output) and never writes to an
    output in place, which is the only way such a view loses FSDP's pre-backward hook. The fix
    at the cause (not returning the features) is transformers' output class, not ours."""
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
    """The LR multiplier at rollout step `step` (0-based; the schedule steps once per rollout
    step): linear warm-up over `tc.warmup_steps` ((step + 1) / warmup), then
    `tc.lr_schedule`: "constant" 1; "linear" from 1
    down to `min_lr_ratio`; "cosine" half a cosine from 1 to `min_lr_ratio`; the decay runs over
    the steps after the warm-up, t = (step - warmup) / (total - warmup), as transformers'
    schedules do. A pure function of (step, config): a resumed run continues it exactly."""
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


def plan_micro_batches(lengths: list[int], max_seqs: int, max_tokens: int = 0,
                       count: int | None = None) -> list[list[int]]:
    """Group sequence indices into micro-batches.

    `max_tokens > 0`: sort by length and fill each micro-batch while (sequences x longest) stays
    within the budget (less padding than fixed-size chunks); else chunks of `max_seqs` in order.
    `count`: split the largest micro-batches until there are `count` of them, because every
    trainer rank must run the same number of forward/backward passes (FSDP collectives).
    """
    if max_tokens > 0:
        mbs: list[list[int]] = [[]]
        for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            if mbs[-1] and (len(mbs[-1]) + 1) * lengths[i] > max_tokens:  # lengths[i] is the longest
                mbs.append([])
            mbs[-1].append(i)
        mbs = [m for m in mbs if m]
    else:
        mbs = [list(range(i, min(i + max_seqs, len(lengths)))) for i in range(0, len(lengths), max_seqs)]
    return _split_to(mbs, count, len(lengths))


def _split_to(mbs: list[list[int]], count: int | None, n: int) -> list[list[int]]:
    """Split the largest micro-batches until there are `count` of them."""
    while count is not None and len(mbs) < count:
        k = max(range(len(mbs)), key=lambda j: len(mbs[j]))
        if len(mbs[k]) < 2:
            raise ValueError(f"cannot make {count} micro-batches from {n} sequences")
        half = len(mbs[k]) // 2
        mbs[k:k + 1] = [mbs[k][:half], mbs[k][half:]]
    return mbs


def shares_prompt(tc, procs: I.Processors) -> bool:
    """One packed row per prompt: `train.share_prompt`, where the model's layers allow it
    exactly (model.packs_exactly; else one row per episode, said at start)."""
    return tc.share_prompt and procs.packs_exactly


def plan_share(episodes: list, idx: list[int], images: Mapping[int, Any], procs: I.Processors,
               tc, count: int | None = None) -> list[list[int]]:
    """This rank's micro-batches over its episodes `idx` (positions into `idx`).

    With `train.share_prompt` and a token budget, the units are the runs of consecutive episodes
    of one prompt (a packed row: prompt once + every response) so the budget counts what is
    really computed; else each episode is a unit (prompt + response). Fixed-size micro-batches
    take the episodes in order, so G-aligned sizes keep each group in one packed row."""
    n_img = [I.image_tokens(procs, images[episodes[i].index]) for i in idx]
    if not (shares_prompt(tc, procs) and tc.micro_batch_tokens > 0):
        lengths = [len(episodes[i].prompt_ids) - 1 + len(episodes[i].response_ids) + n
                   for i, n in zip(idx, n_img)]
        return plan_micro_batches(lengths, tc.micro_batch_size, tc.micro_batch_tokens, count)
    units: list[list[int]] = []
    for j, i in enumerate(idx):
        if units and episodes[idx[units[-1][0]]].group == episodes[i].group:
            units[-1].append(j)
        else:
            units.append([j])
    lengths = [len(episodes[idx[u[0]]].prompt_ids) - 1 + n_img[u[0]]
               + sum(len(episodes[idx[j]].response_ids) for j in u) for u in units]
    mbs = [[j for k in mb for j in units[k]]
           for mb in plan_micro_batches(lengths, len(units), tc.micro_batch_tokens)]
    return _split_to(mbs, count, len(idx))


def agree_plans(shares: list[list[int]], episodes: list, images: Mapping[int, Any],
                procs: I.Processors, tc, train_group) -> list[list[list[int]]]:
    """The micro-batch plan of each mini-batch share (`shares[j]`: this rank's episodes of
    mini-batch j), with the same number of micro-batches per mini-batch on every trainer rank
    (FSDP collectives); one all-reduce for all of them."""
    plans = [plan_share(episodes, sh, images, procs, tc) for sh in shares]
    n = torch.tensor([len(p) for p in plans])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=train_group)
    return [plan_share(episodes, sh, images, procs, tc, count=int(c))
            for sh, c in zip(shares, n.tolist())]


@torch.no_grad()
def proximal_logprobs(tr: Trainer, episodes: list, idx: list[int], plan: list[list[int]],
                      images: Mapping[int, Any], *, procs: I.Processors, lc, tc,
                      temperature: float) -> list[tuple[torch.Tensor, Any, torch.Tensor]]:
    """The proximal ("old") policy's logprobs of this rank's episodes `idx`, the reference's
    when there is one, and the response mask, one `([b, L], [b, L] | None, [b, L])` triple per
    micro-batch of `plan` (the same plan the updates use, so the tensors line up with their
    batches; row r is episode `idx[mb[r]]`). No gradient."""
    tk = procs.tokens
    out = []
    for mb in plan:
        eps = [episodes[idx[j]] for j in mb]
        batch = I.collate(eps, [images[e.index] for e in eps], procs, tr.device,
                          share_prompt=shares_prompt(tc, procs), pixels=tr.pixels)
        lp, _ = M.sequence_logprobs(tr.policy, batch, tk, temperature)
        ref = reference_logprobs(tr, batch, tk, temperature) if has_reference(tr) else None
        out.append((lp, ref, batch["response_mask"]))
    return out


def reference_kl(proximal: list, shares: list[list[int]], plans: list, n: int, lc,
                 train_group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every episode's summed KL of the proximal policy to the reference and its response token
    count (:func:`loss.sequence_kl`, `[loss] kl_estimator` / `kl_clamp`), `[n]` each, the same
    on every trainer rank (each rank computes its share, one all-reduce)."""
    sums = torch.zeros(2, n, dtype=torch.float64)
    for passes, share, plan in zip(proximal, shares, plans):
        for (old, ref, mask), mb in zip(passes, plan):
            kl, count = L.sequence_kl(old, ref, mask, lc.kl_estimator, lc.kl_clamp)
            rows = torch.tensor([share[j] for j in mb])
            sums[0, rows] = kl.double().cpu()
            sums[1, rows] = count.double().cpu()
    dist.all_reduce(sums, group=train_group)
    return sums[0], sums[1]


@torch.no_grad()
def mix_reference(ref, policy, alpha: float) -> None:
    """TRL's sync_ref_model: `ref <- alpha * policy + (1 - alpha) * ref`, parameter by parameter
    (TRL: `target.mul_(1 - alpha).add_(copy, alpha=alpha)`). Both are sharded by the same
    `apply_fsdp` over the same mesh, so each rank mixes its own local shards elementwise, with
    no communication. Every FSDP unit is resharded first: after a forward without backward the
    root unit holds unsharded copies, which a mix would write into and the next reshard drop."""
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


def accumulate_gradients(tr: Trainer, episodes: list, idx: list[int], adv: torch.Tensor,
                         keep: torch.Tensor, denom: float, images: Mapping[int, Any], *,
                         procs: I.Processors, train_group, n_trainers: int, lc, tc,
                         temperature: float, max_new_tokens: int, step: int | None = None,
                         plan: list[list[int]] | None = None, proximal: list | None = None,
                         kl_coef: float | None = None) -> dict[str, float]:
    """Forward/backward over this rank's episodes `idx` in micro-batches; gradients accumulate.

    `images[e.index]` are episode e's images; `denom` the update's global loss denominator; `plan`
    the agreed micro-batches (None: plan here); `proximal` the old (and reference) logprobs per
    micro-batch from :func:`proximal_logprobs`, or None for the single-update path (old = the
    current logprobs detached, reference computed here); `kl_coef` the coefficient of the KL
    term in the loss this step (None: `loss.kl_coef`; 0 with the KL in the reward). Returns this
    rank's sums for the step's metrics.
    """
    tk = procs.tokens
    if plan is None:
        plan = agree_plans([idx], episodes, images, procs, tc, train_group)[0]
    kl_coef = lc.kl_coef if kl_coef is None else kl_coef
    entropy_grad = lc.entropy_coef > 0  # the entropy keeps its graph only for the bonus
    sums = dict.fromkeys(("loss", "entropy", "tokens", "episode_tokens", "slots", "resp_tokens",
                          "kept_tokens", *_SUMMED), 0.0)
    lp_diff = 0.0
    for k, mb in enumerate(plan):
        chunk = [idx[j] for j in mb]
        eps = [episodes[i] for i in chunk]
        batch = I.collate(eps, [images[e.index] for e in eps], procs, tr.device,
                          share_prompt=shares_prompt(tc, procs), pixels=tr.pixels)
        mask = batch["response_mask"].float() * keep[chunk].float().unsqueeze(1).to(tr.device)
        lp, ent = M.sequence_logprobs(tr.policy, batch, tk, temperature, entropy_grad=entropy_grad)
        if proximal is None:
            # One update per batch: the proximal ("old") policy is the current one, so the ratio
            # is 1 in value with the gradient of the policy gradient; the engine's logprobs enter
            # only through truncated importance sampling (engine/trainer mismatch, staleness).
            old, ref_lp = lp.detach(), None
            if has_reference(tr):
                ref_lp = reference_logprobs(tr, batch, tk, temperature)
        else:
            old, ref_lp, _ = proximal[k]
        behaviour = batch["engine_logprobs"]
        # The whole [loss] section goes to the loss (and its objective, which reads its own
        # keys); only the step's KL coefficient is this step's own.
        loss, m = L.policy_loss(
            lp, old, adv[chunk].to(lp.device), mask, lc, ref_logprobs=ref_lp,
            behaviour_logprobs=behaviour if lc.tis_cap else None,
            entropy=ent if entropy_grad else None, loss_denominator=float(denom),
            max_response_len=max_new_tokens, kl_coef=kl_coef)
        if fault_active("nan_loss", step):  # tests: a non-finite loss
            loss = loss * float("nan")
        # FSDP2 averages gradients over the trainer ranks; the loss is already normalised by the
        # global denominator, so undo the average to get exactly the full-batch gradient.
        (loss * n_trainers).backward()
        rmask = batch["response_mask"].bool()
        ntok = float(rmask.sum())
        sums["loss"] += float(loss.detach())
        for key in _SUMMED:  # policy_loss's means are over the kept tokens: weight by them
            sums[key] += float(m[key]) * m["tokens"]
        sums["kept_tokens"] += m["tokens"]
        sums["entropy"] += float(ent.detach()[rmask].sum())
        sums["tokens"] += float(batch["attention_mask"].sum())
        sums["episode_tokens"] += float(batch["episode_tokens"])
        sums["slots"] += float(batch["attention_mask"].numel())
        sums["resp_tokens"] += ntok
        if rmask.any():  # engine vs the policy before the update (the proximal one)
            lp_diff = max(lp_diff, float((old - behaviour)[rmask].abs().max()))
    sums["micro_batches"] = float(len(plan))
    sums["lp_diff"] = lp_diff
    return sums


def update_order(n_mini_batches: int, seed: int, step: int, epoch: int) -> list[int]:
    """The order of the mini-batches in `epoch` of `step`: shuffled by a seed made of (run seed,
    step, epoch) only, so every trainer rank and a resumed run draw the same order."""
    order = list(range(n_mini_batches))
    random.Random(f"mini-batches:{seed}:{step}:{epoch}").shuffle(order)
    return order


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


def needs_proximal(tc, lc) -> bool:
    """A separate no-grad pass before the updates: several updates per rollout batch (their
    ratios need fixed "old" logprobs), or the reference's KL wanted before the advantages (KL in
    the reward) or before the coefficient's update (adaptive coefficient)."""
    return tc.mini_batches * tc.ppo_epochs > 1 or lc.kl_in_reward or lc.kl_target > 0


def train_step(tr: Trainer, episodes: list, images: Mapping[int, Any], *, world,
               procs: I.Processors, tc, lc, rc, step: int,
               seed: int = 0) -> tuple[dict[str, float], list[float]]:
    """`[train] mini_batches x ppo_epochs` optimizer steps on this trainer's share of the step's
    episodes (every trainer rank calls it with the same `episodes`, sorted by group). `[train]`
    tc, `[loss]` lc, `[rollout]` rc; `seed` the run seed (mini-batch order). Returns the step's
    training metrics (the same on every trainer rank), averaged over the updates, and every
    episode's advantage.

    KL options (loss.py, :func:`loss.sequence_kl`): with `loss.kl_in_reward` each response's
    reward becomes `r - kl_coef * sum_t kl_t` (proximal vs reference) before the advantages, and
    the loss has no KL term; with `loss.kl_target > 0` the coefficient then moves by
    :func:`loss.adaptive_kl_coef` (`tr.kl_coef`, saved in checkpoints); with
    `train.ref_update_every` the reference mixes towards the policy after the updates."""
    scores = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
    truncated = torch.tensor([e.truncated for e in episodes])
    # Which responses count is decided on the task reward (the generation side refilled on it).
    keep = L.keep_mask(scores, rc.group_size, truncated, drop_zero_variance=lc.drop_zero_variance,
                       exclude_truncated=lc.exclude_truncated)
    n_dropped = (int(L.zero_variance_groups(scores, rc.group_size).sum())
                 if lc.drop_zero_variance else 0)
    # Excluded episodes stay in the micro-batches with a zero mask, so every trainer rank runs
    # the same number of forward/backward passes (FSDP collectives); they leave the loss and its
    # denominator (loss.py's convention). With rollout refill (DAPO dynamic sampling) the
    # generation side sends zero-variance groups only when it ran out of refill rounds.
    n_mb, n_tr = tc.mini_batches, len(world.trainers)
    size = len(episodes) // n_mb                 # episodes per mini-batch (all ranks)
    per = size // n_tr                           # ... per trainer rank
    lengths = [len(e.response_ids) for e in episodes]
    shares, denoms = [], []
    for j in range(n_mb):
        lo = j * size + world.trainer_index * per
        shares.append(list(range(lo, lo + per)))
        whole = slice(j * size, (j + 1) * size)
        denoms.append(max(1.0, L.loss_denominator(lengths[whole], keep[whole].tolist(),
                                                  lc.aggregation, rc.max_new_tokens)))
    plans = agree_plans(shares, episodes, images, procs, tc, world.train_group)
    coef = tr.kl_coef if lc.kl_target > 0 and tr.kl_coef is not None else lc.kl_coef
    proximal = [None] * n_mb
    extra: dict[str, float] = {}
    rewards = scores
    if needs_proximal(tc, lc):
        proximal = [proximal_logprobs(tr, episodes, sh, plan, images, procs=procs, lc=lc, tc=tc,
                                      temperature=rc.temperature)
                    for sh, plan in zip(shares, plans)]
        if has_reference(tr) and (lc.kl_in_reward or lc.kl_target > 0):
            kl_sum, kl_count = reference_kl(proximal, shares, plans, len(episodes), lc,
                                            world.train_group)
            current_kl = float((kl_sum / kl_count.clamp(min=1.0)).mean())  # verl's current_kl
            extra["train/kl_seq_mean"] = current_kl
            if lc.kl_in_reward:
                rewards = scores - coef * kl_sum
                extra["train/reward_kl"] = float((coef * kl_sum).mean())
            if lc.kl_target > 0:  # after this step's use, as verl and OpenRLHF update it
                tr.kl_coef = L.adaptive_kl_coef(coef, current_kl, lc.kl_target, lc.kl_horizon,
                                                len(episodes))
    adv = L.group_advantages(rewards, rc.group_size,
                             scale_by_std=lc.scale_by_std if lc.advantage == "grpo" else None,
                             estimator=lc.advantage).float()                    # [N]
    sums: dict[str, float] = {}
    lp_diff, norms, n_skipped = 0.0, [], 0
    lr = tr.opt.param_groups[0]["lr"]  # the rate these updates use (the schedule steps after)
    for epoch in range(tc.ppo_epochs):
        for j in update_order(n_mb, seed, step, epoch):
            got = accumulate_gradients(tr, episodes, shares[j], adv, keep, denoms[j], images,
                                       procs=procs, train_group=world.train_group,
                                       n_trainers=n_tr, lc=lc, tc=tc, temperature=rc.temperature,
                                       max_new_tokens=rc.max_new_tokens, step=step,
                                       plan=plans[j], proximal=proximal[j],
                                       kl_coef=0.0 if lc.kl_in_reward else coef)
            lp_diff = max(lp_diff, got.pop("lp_diff"))
            for key, v in got.items():
                sums[key] = sums.get(key, 0.0) + v
            grad_norm, skipped = optimizer_step(tr, tc)
            norms.append(grad_norm)
            n_skipped += skipped
    n_updates = len(norms)
    if n_skipped < n_updates:  # once per rollout step (module docstring)
        tr.sched.step()
    if tr.ref is not None:
        if tc.ref_update_every and (step + 1) % tc.ref_update_every == 0:
            mix_reference(tr.ref, tr.policy, tc.ref_mix_alpha)
        reshard(tr.ref)  # its root unit stays unsharded after a no-grad forward otherwise
    # One reduction for all sums, one for the max.
    keys = list(sums)
    vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(vec, group=world.train_group)
    tot = dict(zip(keys, vec.tolist()))
    mx = torch.tensor([lp_diff], dtype=torch.float64)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=world.train_group)
    ntok, kept = max(1.0, tot["resp_tokens"]), max(1.0, tot["kept_tokens"])
    out = {"loss": tot["loss"] / n_updates, "grad_norm": sum(norms) / n_updates,
           "kl": tot["kl"] / kept, "entropy": tot["entropy"] / ntok,
           "logprob_diff/max": float(mx[0]),
           "train/skipped": n_skipped / n_updates, "train/dropped_groups": float(n_dropped),
           "train/lr": lr,
           "train/padding_frac": 1.0 - tot["tokens"] / max(1.0, tot["slots"]),
           "train/tokens": tot["episode_tokens"],
           "train/micro_batches": tot["micro_batches"] / n_tr,
           "train/updates": float(n_updates)}
    for k in ("clip_frac_low", "clip_frac_high", "ratio_mean", "tis_weight_mean", "approx_kl"):
        out[f"train/{k}"] = tot[k] / kept
    if lc.clip_dual:
        out["train/clip_frac_dual"] = tot["clip_frac_dual"] / kept
    if has_reference(tr):
        out["train/kl_coef"] = coef
    out.update(extra)
    out["advantage/mean"] = float(adv.mean())
    out["advantage/abs_mean"] = float(adv.abs().mean())
    return out, adv.tolist()
