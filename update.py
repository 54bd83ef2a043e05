"""One rollout step's update on the trainer ranks, in named phases over one record (:class:`Step`):

    [trainer-side rewards] -> plan -> proximal pass -> response filters -> denominators
    -> advantages -> updates -> metrics

- `role = "trainer"` reward models (reward_models.score_on_trainers), if any, first add their
  scores to the step's rewards, as the generation side's functions would have.

- :func:`plan`: which responses count (:func:`loss.keep_mask`, on the task reward), this rank's
  share of each of `[train] mini_batches` mini-batches and its micro-batches (the same count on
  every trainer rank: FSDP collectives).
- :func:`proximal_pass`: with more than one update, the KL in the reward, the adaptive KL
  coefficient, or a filter that needs logprobs, the "old" logprobs (and the reference's)
  computed once, without gradient, before anything is trained; every update's ratio is taken
  against them, so from the second update on the clip binds, and the KL to the reference enters
  the reward (`loss.kl_in_reward`) or the controller (`loss.kl_target`).
- :func:`apply_filters`: each `loss.filters` filter (registry.response_filter) on every response
  of the step; a removed response leaves the loss and its denominator.
- :func:`denominators`: each mini-batch's GLOBAL loss denominator (:func:`loss.loss_denominator`).
  Every micro-batch loss is divided by it, so the accumulated gradient equals the
  full-mini-batch gradient whatever the micro-batching or the number of ranks (tested).
- :func:`advantages`; :func:`run_updates`: for each of `ppo_epochs` epochs the mini-batches in a
  seeded shuffled order, each one optimizer step (:func:`accumulate_gradients` -> clip -> step);
  :func:`reduce_metrics`: one all-reduce for the sums, one for the max.

With one mini-batch and one epoch (the default, and no KL in the reward, adaptive coefficient
or filter needing logprobs) there is no separate proximal pass: old = the current logprobs
detached (ratio 1 in value). The LR schedule steps once per ROLLOUT step, after its updates (as
verl and EasyR1), so `warmup_steps` counts the steps of `run.steps`; `train/lr` is the rate the
updates used.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import reduce
from types import SimpleNamespace
from typing import Any, Mapping

import torch
import torch.distributed as dist

import inputs as I
import loss as L
import model as M
import registry
import reward_models
import routing
from config import LossConfig, RolloutConfig, TrainConfig
from failures import fault_active
from multiturn import max_sampled_tokens
from microbatches import agree_plans, rank_shares
from trainer import (Trainer, has_reference, has_teacher, mix_reference, optimizer_step,
                     reference_logprobs, reshard, teacher_logprobs)


@dataclass
class Update:
    """One mini-batch's share on this trainer rank."""
    idx: list[int]                  # this rank's episodes of the mini-batch (positions in the step)
    plan: list[list[int]]           # its micro-batches (positions into idx), agreed by every rank
    denom: float = 1.0              # the mini-batch's global loss denominator (every rank's episodes)
    proximal: list | None = None    # per micro-batch (old [b, L], ref [b, L] | None, mask [b, L], teacher [b, L] | None)


@dataclass
class Step:
    """One rollout step's update on this trainer rank: its inputs (the same `episodes`, sorted by
    group, on every trainer rank) and what each phase adds."""
    tr: Trainer
    world: Any
    procs: I.Processors
    tc: TrainConfig
    lc: LossConfig
    rc: RolloutConfig
    step: int
    seed: int                       # the run seed (mini-batch order)
    episodes: list
    images: Mapping[int, Any]       # images[e.index]: episode e's images
    scores: torch.Tensor | None = None   # [N] float64: each response's task reward
    keep: torch.Tensor | None = None     # [N] bool: the responses the update trains on
    updates: list[Update] = field(default_factory=list)
    kl_coef: float = 0.0                 # the KL coefficient this step uses
    rewards: torch.Tensor | None = None  # [N] float64: what the advantages rank (KL in reward)
    adv: torch.Tensor | None = None      # [N] float32
    # some episode of the step shows an image: a micro-batch without one runs the vision tower on
    # a blank image (inputs.collate), as a peer's with images does (its FSDP collectives)
    vision: bool = False
    metrics: dict = field(default_factory=dict)


def train_step(tr: Trainer, episodes: list, images: Mapping[int, Any], *, world,
               procs: I.Processors, tc: TrainConfig, lc: LossConfig, rc: RolloutConfig, step: int,
               seed: int = 0) -> tuple[dict[str, float], list[float]]:
    """`[train] mini_batches x ppo_epochs` optimizer steps on this trainer's share of the step's
    episodes. Returns the step's training metrics (the same on every trainer rank), averaged
    over the updates, and every episode's advantage."""
    s = Step(tr, world, procs, tc, lc, rc, step, seed, episodes, images)
    s.metrics |= reward_models.score_on_trainers(tr, episodes, world)  # role = "trainer" models' rewards
    plan(s)
    missing = routing.fallback(tr.policy, episodes)  # replay on: episodes without the engine's routing
    if missing is not None:
        s.metrics["train/routing_fallback"] = float(missing)
    if needs_proximal(tc, lc):
        proximal_pass(s)
    routed = routing.take_counts(tr.policy)  # MoE: the first pass over each episode (proximal, or the update)
    apply_filters(s)
    denominators(s)
    advantages(s)
    sums, lp_diff, norms, n_skipped = run_updates(s)
    later = routing.take_counts(tr.policy)
    if any(getattr(e, "routing", None) is not None for e in episodes):  # the same on every rank
        sums["routing_same"], sums["routing_pairs"] = map(float, routed if needs_proximal(tc, lc) else later)
    if n_skipped < len(norms):  # once per rollout step (module docstring)
        tr.sched.step()
    if tr.ref is not None:
        if tc.ref_update_every and (step + 1) % tc.ref_update_every == 0:
            mix_reference(tr.ref, tr.policy, tc.ref_mix_alpha)
        reshard(tr.ref)  # its root unit stays unsharded after a no-grad forward otherwise
    if tr.teacher is not None:
        reshard(tr.teacher)
    return reduce_metrics(s, sums, lp_diff, norms, n_skipped), s.adv.tolist()


def needs_proximal(tc: TrainConfig, lc: LossConfig) -> bool:
    """A separate no-grad pass before the updates: several updates per rollout batch (their
    ratios need fixed "old" logprobs), the reference's KL wanted before the advantages (KL in the
    reward) or the coefficient's update (adaptive coefficient), or a filter that needs them."""
    return (tc.mini_batches * tc.ppo_epochs > 1 or lc.kl_in_reward or lc.kl_target > 0
            or any(registry.FILTERS[f].needs for f in lc.filters))


def plan(s: Step) -> None:
    """Which responses count, this rank's share of each mini-batch and its micro-batches, and
    the step's KL coefficient (adaptive: the trainer's, saved in checkpoints)."""
    eps, lc, rc, world = s.episodes, s.lc, s.rc, s.world
    s.scores = s.rewards = torch.tensor([e.reward for e in eps], dtype=torch.float64)  # [N]
    s.vision = any(I.episode_images(s.images, e) for e in eps)  # the same on every trainer rank
    truncated = torch.tensor([e.truncated for e in eps])                              # [N]
    # Decided on the task reward (the generation side refilled on it). Excluded episodes stay in
    # the micro-batches with a zero mask, so every trainer rank runs the same passes.
    s.keep = L.keep_mask(s.scores, rc.group_size, truncated,
                         drop_zero_variance=lc.drop_zero_variance,
                         exclude_truncated=lc.exclude_truncated)                      # [N]
    s.metrics["train/dropped_groups"] = float(
        L.zero_variance_groups(s.scores, rc.group_size).sum() if lc.drop_zero_variance else 0)
    every, imbalance, oversized = rank_shares(eps, s.images, s.procs, s.tc, s.tr.layout, len(world.trainers))
    s.metrics["train/rank_token_imbalance"] = imbalance
    s.metrics["train/oversized_sequences"] = float(oversized)
    shares = [sh[world.trainer_index] for sh in every]          # this rank's, per mini-batch
    plans = agree_plans(shares, eps, s.images, s.procs, s.tc, s.tr.layout, world.train_group)
    s.updates = [Update(sh, p) for sh, p in zip(shares, plans)]
    s.kl_coef = s.tr.kl_coef if lc.kl_target > 0 and s.tr.kl_coef is not None else lc.kl_coef


def proximal_pass(s: Step) -> None:
    """The proximal logprobs of every micro-batch; with a reference and the KL in the reward or
    the adaptive coefficient, every response's KL to it (:func:`loss.sequence_kl`): the reward
    becomes `r - kl_coef * sum_t kl_t`, the coefficient moves by :func:`loss.adaptive_kl_coef`
    after this step's use (as verl and OpenRLHF update it)."""
    lc = s.lc
    for u in s.updates:
        u.proximal = proximal_logprobs(s.tr, s.episodes, u.idx, u.plan, s.images, procs=s.procs,
                                       temperature=s.rc.temperature, vision=s.vision)
    if not (has_reference(s.tr) and (lc.kl_in_reward or lc.kl_target > 0)):
        return
    kl_sum, kl_count = reference_kl(s.updates, len(s.episodes), lc, s.world.train_group)  # [N]
    current_kl = float((kl_sum / kl_count.clamp(min=1.0)).mean())  # verl's current_kl
    s.metrics["train/kl_seq_mean"] = current_kl
    if lc.kl_in_reward:
        s.rewards = s.scores - s.kl_coef * kl_sum
        s.metrics["train/reward_kl"] = float((s.kl_coef * kl_sum).mean())
    if lc.kl_target > 0:
        s.tr.kl_coef = L.adaptive_kl_coef(s.kl_coef, current_kl, lc.kl_target, lc.kl_horizon,
                                          len(s.episodes))


@torch.no_grad()
def proximal_logprobs(tr: Trainer, episodes: list, idx: list[int], plan: list[list[int]],
                      images: Mapping[int, Any], *, procs: I.Processors, temperature: float,
                      vision: bool = False) -> list[tuple[torch.Tensor, Any, torch.Tensor]]:
    """The proximal ("old") policy's logprobs of this rank's episodes `idx`, the reference's
    when there is one, the response mask and the distillation teacher's, one `([b, L], [b, L] |
    None, [b, L], [b, L] | None)` tuple per micro-batch of `plan` (the same plan the updates
    use, so the tensors line up with their batches; row r is episode `idx[mb[r]]`; `vision`:
    Step.vision). No gradient."""
    tk = procs.tokens
    out = []
    for mb in plan:
        eps = [episodes[idx[j]] for j in mb]
        batch = I.collate(eps, [I.episode_images(images, e) for e in eps], procs, tr.device,
                          tr.layout, tr.pixels, vision)
        lp, _ = M.sequence_logprobs(tr.policy, batch, tk, temperature)           # [b, L]
        ref = reference_logprobs(tr, batch, tk, temperature) if has_reference(tr) else None
        teacher = teacher_logprobs(tr, batch, tk, temperature) if has_teacher(tr) else None
        out.append((lp, ref, batch.response_mask, teacher))
    return out


def reference_kl(updates: list[Update], n: int, lc: LossConfig,
                 train_group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every episode's summed KL of the proximal policy to the reference and its response token
    count (`[loss] kl_estimator` / `kl_clamp`), `[n]` each, the same on every trainer rank (each
    rank computes its share, one all-reduce)."""
    sums = torch.zeros(2, n, dtype=torch.float64)
    for u in updates:
        for (old, ref, mask, _), mb in zip(u.proximal, u.plan):
            kl, count = L.sequence_kl(old, ref, mask, lc.kl_estimator, lc.kl_clamp)   # [b]
            rows = torch.tensor([u.idx[j] for j in mb])
            sums[0, rows] = kl.double().cpu()
            sums[1, rows] = count.double().cpu()
    dist.all_reduce(sums, group=train_group)
    return sums[0], sums[1]


def apply_filters(s: Step) -> None:
    """Each `loss.filters` filter in order, on every response of the step (:func:`responses`):
    the ones it does not keep leave the loss; `train/filtered/<name>` is the share of the step's
    responses it removed."""
    if not s.lc.filters:
        return
    r = responses(s)
    for name in s.lc.filters:
        part = registry.FILTERS[name]
        kept = torch.as_tensor(part.fn(r, part.params(s.lc))).bool().reshape(-1)   # [N]
        if kept.shape != s.keep.shape:
            raise ValueError(f"filter {name!r} returned {tuple(kept.shape)} flags for "
                             f"{len(s.episodes)} responses")
        s.metrics[f"train/filtered/{name}"] = float((~kept).double().mean())
        s.keep &= kept


def responses(s: Step) -> SimpleNamespace:
    """What a filter sees: every response of the step, in order, with the per-token logprobs it
    needs gathered from every trainer rank's proximal pass."""
    eps = s.episodes
    r = SimpleNamespace(rewards=s.scores, truncated=torch.tensor([e.truncated for e in eps]),
                        lengths=[I.sampled_tokens(e) for e in eps],
                        groups=[e.group for e in eps],
                        engine_logprobs=[torch.tensor(e.logprobs)[torch.tensor(I.loss_mask(e), dtype=torch.bool)]
                                         for e in eps])  # the sampled tokens (multi-turn: not inserted ones)
    needs = {n for f in s.lc.filters for n in registry.FILTERS[f].needs}
    if not needs:
        return r
    mine = {}
    for u in s.updates:
        for (old, ref, mask, _), mb in zip(u.proximal, u.plan):
            for row, j in enumerate(mb):
                m = mask[row].bool()
                mine[u.idx[j]] = (old[row][m].cpu(), None if ref is None else ref[row][m].cpu())
    every = [None] * len(s.world.trainers)
    dist.all_gather_object(every, mine, group=s.world.train_group)
    got = {i: v for part in every for i, v in part.items()}
    r.logprobs = [got[i][0] for i in range(len(eps))]
    if "ref_logprobs" in needs:
        r.ref_logprobs = [got[i][1] for i in range(len(eps))]
    return r


def denominators(s: Step) -> None:
    """Each mini-batch's global loss denominator over its kept responses (never below 1)."""
    size = len(s.episodes) // len(s.updates)
    lengths = [I.sampled_tokens(e) for e in s.episodes]  # multi-turn: inserted tokens never count
    for j, u in enumerate(s.updates):
        whole = slice(j * size, (j + 1) * size)
        u.denom = max(1.0, L.loss_denominator(lengths[whole], s.keep[whole].tolist(),
                                              s.lc.aggregation, max_sampled_tokens(s.rc)))


def advantages(s: Step) -> None:
    """The group step, then with `loss.advantage_norm = "batch"` the step's token-weighted one
    over every response (its sampled tokens; excluded responses count, as in AReaL, where the
    normalisation precedes any filtering)."""
    lc = s.lc
    adv = L.group_advantages(s.rewards, s.rc.group_size,
                             scale_by_std=lc.scale_by_std if lc.advantage == "grpo" else None,
                             estimator=lc.advantage)                               # [N] float64
    if lc.advantage_norm == "batch":
        adv = L.batch_normalize(adv, torch.tensor([I.sampled_tokens(e) for e in s.episodes]))
    s.adv = adv.float()


def run_updates(s: Step) -> tuple[dict[str, float], float, list[float], int]:
    """`ppo_epochs` passes over the mini-batches in a seeded order, one optimizer step each:
    (this rank's metric sums, the largest engine/trainer logprob gap, grad norms, skipped)."""
    sums: dict[str, float] = {}
    lp_diff, norms, n_skipped = 0.0, [], 0
    s.metrics["train/lr"] = s.tr.opt.param_groups[0]["lr"]  # the rate the updates use
    for epoch in range(s.tc.ppo_epochs):
        for j in update_order(len(s.updates), s.seed, s.step, epoch):
            got = accumulate_gradients(s, s.updates[j])
            lp_diff = max(lp_diff, got.pop("lp_diff"))
            for key, v in got.items():
                sums[key] = sums.get(key, 0.0) + v
            grad_norm, skipped = optimizer_step(s.tr, s.tc)
            norms.append(grad_norm)
            n_skipped += skipped
    return sums, lp_diff, norms, n_skipped


def update_order(n_mini_batches: int, seed: int, step: int, epoch: int) -> list[int]:
    """The order of the mini-batches in `epoch` of `step`: shuffled by a seed made of (run seed,
    step, epoch) only, so every trainer rank and a resumed run draw the same order."""
    order = list(range(n_mini_batches))
    random.Random(f"mini-batches:{seed}:{step}:{epoch}").shuffle(order)
    return order


def accumulate_gradients(s: Step, u: Update) -> dict[str, float]:
    """Forward/backward over the micro-batches of `u` (one mini-batch's share on this rank);
    gradients accumulate. Without a proximal pass old = the current logprobs detached (ratio 1
    in value) and the reference's are computed here. Returns this rank's sums for the metrics."""
    tr, lc, tk = s.tr, s.lc, s.procs.tokens
    kl_coef = 0.0 if lc.kl_in_reward else s.kl_coef   # with the KL in the reward: no KL term
    entropy_grad = lc.entropy_coef > 0  # the entropy keeps its graph only for the bonus
    sums = dict.fromkeys(("loss", "entropy", "tokens", "episode_tokens", "slots", "resp_tokens",
                          "kept_tokens", "pairs", "episode_pairs", "fresh_tokens"), 0.0)
    on_device = []  # per micro-batch its device-side values, read once after the last (_read_sums)
    for k, mb in enumerate(u.plan):
        chunk = [u.idx[j] for j in mb]
        eps = [s.episodes[i] for i in chunk]
        batch = I.collate(eps, [I.episode_images(s.images, e) for e in eps], s.procs, tr.device,
                          tr.layout, tr.pixels, s.vision)
        mask = batch.response_mask.float() * s.keep[chunk].float().unsqueeze(1).to(tr.device)
        lp, ent = M.sequence_logprobs(tr.policy, batch, tk, s.rc.temperature,
                                      entropy_grad=entropy_grad)                     # [b, L]
        if u.proximal is None:
            old = lp.detach()
            ref_lp = reference_logprobs(tr, batch, tk, s.rc.temperature) if has_reference(tr) else None
            teacher = teacher_logprobs(tr, batch, tk, s.rc.temperature) if has_teacher(tr) else None
        else:
            old, ref_lp, _, teacher = u.proximal[k]
        adv = s.adv[chunk].to(lp.device)                                              # [b]
        extra = {}
        if teacher is not None:  # on-policy distillation: one advantage per token [b, L]
            adv = L.distill_advantages(adv, old, teacher, lc.distill_coef)
            extra["distill_kl"] = ((old - teacher) * mask).sum()
        loss, m = L.policy_loss(
            lp, old, adv, mask, lc, ref_logprobs=ref_lp,
            behaviour_logprobs=batch.engine_logprobs,                                 # [b, L]
            entropy=ent if entropy_grad else None, loss_denominator=float(u.denom),
            max_response_len=max_sampled_tokens(s.rc), kl_coef=kl_coef)
        if fault_active("nan_loss", s.step):  # tests: a non-finite loss
            loss = loss * float("nan")
        # FSDP2 averages gradients over the trainer ranks; the loss is already normalised by the
        # global denominator, so undo the average to get exactly the full-batch gradient.
        (loss * len(s.world.trainers)).backward()
        on_device.append(_add_sums(sums, loss, m, batch, ent * mask, old, tr.version) | extra)
    sums["lp_diff"] = _read_sums(sums, on_device)
    sums["micro_batches"] = float(len(u.plan))
    return sums


def _add_sums(sums: dict, loss: torch.Tensor, m: dict, batch: M.MicroBatch, ent: torch.Tensor,
              old: torch.Tensor, version: int) -> dict[str, torch.Tensor]:
    """One micro-batch's share of the metric sums (`ent`: each kept token's entropy, 0 elsewhere):
    its counts, from the record as collated (on the host: MicroBatch.host), added to `sums`; what
    the device computed returned as 0-d tensors, for :func:`_read_sums`: the loss, the entropy,
    policy_loss's metrics (`m:<name>`), and the largest engine/proximal gap over the tokens
    sampled with the policy's own `version` (`lp_diff`; 0 when none is)."""
    with torch.profiler.record_function(M.HOST_SCOPE):
        h = batch.host if batch.host is not None else batch
        rmask = h.response_mask.bool()                                                # [b, L]
        sums["fresh_tokens"] += float((rmask & (h.token_versions == version)).sum())
        sums["tokens"] += float(h.attention_mask.sum())
        sums["episode_tokens"] += float(h.episode_tokens)
        sums["slots"] += float(h.attention_mask.numel())
        sums["pairs"] += float(h.attention_pairs)
        sums["episode_pairs"] += float(h.episode_pairs)
        sums["resp_tokens"] += float(rmask.sum())
    fresh = batch.response_mask.bool() & (batch.token_versions == version)          # [b, L]
    gap = torch.where(fresh, (old - batch.engine_logprobs).abs(), 0.0)            # engine vs proximal
    return {"loss": loss.detach(), "entropy": ent.detach().sum(), "lp_diff": gap.max(),
            **{f"m:{k}": v for k, v in m.items()}}


# profiler scope of the one read of a step's device-side metrics (bench/step.py counts it a sync)
READ_SCOPE = "grpo::read_metrics"


def _read_sums(sums: dict, on_device: list[dict[str, torch.Tensor]]) -> float:
    """The micro-batches' device-side values (:func:`_add_sums`) added to `sums`, in micro-batch
    order (the floats of reading each value at once): one stacked tensor, one read to the host.
    policy_loss's means are over the kept tokens: weighted by them. Returns the largest lp_diff."""
    if not on_device:
        return 0.0
    keys = list(on_device[0])
    # float64 values (tests) stay exact
    dtype = reduce(torch.promote_types, [v.dtype for v in on_device[0].values()], torch.float32)
    with torch.profiler.record_function(READ_SCOPE):
        rows = torch.stack([torch.stack([d[k].to(dtype) for k in keys]) for d in on_device]).tolist()
    lp_diff = 0.0
    for row in rows:
        v = dict(zip(keys, row))
        lp_diff = max(lp_diff, v["lp_diff"])
        for key in keys:
            if key in ("loss", "entropy", "distill_kl"):  # the entropy: masked to the kept tokens
                sums[key] = sums.get(key, 0.0) + v[key]
            elif key.startswith("m:") and key != "m:tokens":
                sums[f"mean:{key[2:]}"] = sums.get(f"mean:{key[2:]}", 0.0) + v[key] * v["m:tokens"]
        sums["kept_tokens"] += v["m:tokens"]
    return lp_diff


def reduce_metrics(s: Step, sums: dict[str, float], lp_diff: float, norms: list[float],
                   n_skipped: int) -> dict[str, float]:
    """The step's metrics, the same on every trainer rank: one all-reduce for the sums, one for
    the max; the loss's own metrics (whatever its terms return) as loss.log_name says."""
    keys = sorted(sums)  # the same order on every trainer rank
    vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(vec, group=s.world.train_group)
    tot = dict(zip(keys, vec.tolist()))
    mx = torch.tensor([lp_diff], dtype=torch.float64)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=s.world.train_group)
    n_updates, n_tr = len(norms), len(s.world.trainers)
    kept = max(1.0, tot["kept_tokens"])
    out = {"loss": tot["loss"] / n_updates, "grad_norm": sum(norms) / n_updates,
           "entropy": tot["entropy"] / kept,  # the kept tokens
           "logprob_diff/tokens": int(tot["fresh_tokens"]),
           "train/skipped": n_skipped / n_updates,
           "train/padding_frac": 1.0 - tot["tokens"] / max(1.0, tot["slots"]),
           # query-key pairs the kernel computes (a dense one: rows x W^2; packed rows on the CPU:
           # attention.pairs) over one unpadded row per episode
           "train/attention_frac": tot["pairs"] / max(1.0, tot["episode_pairs"]),
           "train/tokens": tot["episode_tokens"],
           "train/micro_batches": tot["micro_batches"] / n_tr,
           "train/updates": float(n_updates)}
    if tot["fresh_tokens"] > 0:  # every token stale: nothing measured, no value (not 0.0)
        out["logprob_diff/max"] = float(mx[0])
    out |= {L.log_name(k[5:]): tot[k] / kept for k in keys if k.startswith("mean:")}
    if has_reference(s.tr):
        out["train/kl_coef"] = s.kl_coef
    if "distill_kl" in tot:  # log pi_old - log pi_teacher on the sampled tokens, per kept token
        out["train/distill_kl"] = tot["distill_kl"] / kept
    if "routing_pairs" in tot:  # top-k sets equal, over the token-layer pairs the engine routed
        out["train/routing_agreement"] = tot["routing_same"] / max(1.0, tot["routing_pairs"])
    out |= s.metrics
    out["advantage/mean"] = float(s.adv.mean())
    out["advantage/abs_mean"] = float(s.adv.abs().mean())
    return out
