"""GRPO for vision-language models (Qwen2.5-VL), one torchrun launch, no Ray.

The world is split statically: the first ranks train (FSDP2 over a trainer-only mesh), the last
`cluster.gen_ranks` ranks each own one inference engine. One step:

    generation ranks: problems -> engine.generate(n=G) -> rewards -> Episodes ---+
    trainer ranks:    logprobs (+ reference) -> advantages -> loss -> step  <-----+
    trainer rank 0 -- bucketed broadcast over the sync group --> every engine (version + 1)

A world of 1 plays both roles in one process.

Launch:
    CPU demo:  torchrun --standalone --nproc_per_node 3 train.py --config configs/tiny.toml
    one proc:  python train.py --config configs/tiny.toml
    GPU / NPU: see launch/ (the same command with configs/vl3b.toml)
Overrides: --section.key=value (e.g. --run.steps=5). `--dry-run` prints the rank plan.

Deliberately left out: more than one optimizer step per batch (PPO epochs / mini-batches),
sequence packing across samples, tensor/pipeline parallel trainers, and multi-turn rollouts.
"""
from __future__ import annotations

import datetime
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint as ckpt
import config as C
import data
import device as D
import loss as L
import model as M
import rollout as R
import sync as S


# ----------------------------------------------------------------------------- distributed setup
def setup_distributed(cfg: C.Config, dev: D.Device) -> dict:
    """One world, every group created on every rank in the same order. Returns plain values."""
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    timeout = datetime.timedelta(seconds=cfg.cluster.timeout_s)
    world = int(os.environ["WORLD_SIZE"])
    C.validate_world(cfg, world)  # before any process group exists
    dist.init_process_group(backend=dev.backend, timeout=timeout)
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    n_gen = cfg.cluster.gen_ranks if world > 1 else 1
    trainers = list(range(world - n_gen)) if world > 1 else [0]
    gens = list(range(world - n_gen, world)) if world > 1 else [0]
    # Object exchange (episodes, metrics, checksums) always on gloo: CPU objects.
    ctrl = dist.new_group(backend="gloo", timeout=timeout)
    train_group = dist.new_group(trainers, timeout=timeout) if world > 1 else dist.group.WORLD
    sync_group = dist.new_group([0] + gens, timeout=timeout) if world > 1 else None
    return dict(rank=rank, world=world, local_rank=local_rank, trainers=trainers, gens=gens,
                is_trainer=rank in trainers, is_gen=rank in gens, ctrl=ctrl,
                train_group=train_group, sync_group=sync_group)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Liveness:
    """Heartbeats and phases in the launcher's key-value store, to name the culprit of a failure.

    A daemon thread bumps `hb/<rank>` every 0.5 s; the loop records its phase ("step 3:
    rollout"). When a collective fails or times out, `report()` names the ranks whose heartbeat
    stopped (dead: killed, crashed, lost node) and every rank's last phase (a rank alive but stuck
    in another phase is the hung one). The failing rank then posts an abort notice; every other
    rank's heartbeat thread ends its process within a beat, even when its main thread is stuck
    in a C call (a hung engine) and on nodes whose launcher does not know of the failure.
    """
    INTERVAL = 0.5

    def __init__(self, rank: int, world: int, roles: list[str]):
        self.store = dist.distributed_c10d._get_default_store()
        self.store.set_timeout(datetime.timedelta(seconds=5))  # diagnosis must not hang either
        self.rank, self.world, self.roles = rank, world, roles
        self.ns = f"grpo/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._stop = threading.Event()
        self.failing = False
        threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()

    def _beat(self) -> None:
        while not self._stop.wait(self.INTERVAL):
            try:
                self.store.add(f"{self.ns}/hb/{self.rank}", 1)
                failed = self.store.check([f"{self.ns}/abort"])
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return
            if failed and not self.failing:  # another rank failed: stop now, even if
                # this rank's main thread is stuck in a C call (a hung engine, a collective)
                why = self.store.get(f"{self.ns}/abort").decode()
                print(f"error: rank {self.rank} ({self.roles[self.rank]}) stopping: {why}",
                      file=sys.stderr, flush=True)
                os._exit(5)

    def abort(self, why: str) -> None:
        """Tell every rank to stop (their heartbeat threads exit the process within a beat)."""
        try:
            self.store.set(f"{self.ns}/abort", why)
        except Exception:  # noqa: BLE001
            pass

    def phase(self, what: str) -> None:
        self.store.set(f"{self.ns}/phase/{self.rank}", what)

    def close(self) -> None:
        self._stop.set()
        self.store.set(f"{self.ns}/exit/{self.rank}", "1")

    def report(self) -> str:
        """One line: who is dead, and where every rank was."""
        try:
            count = lambda: [self.store.add(f"{self.ns}/hb/{r}", 0) for r in range(self.world)]
            before = count()
            time.sleep(3 * self.INTERVAL)
            after = count()
            ended = {r for r in range(self.world) if self.store.check([f"{self.ns}/exit/{r}"])}
            dead = [r for r in range(self.world)
                    if r != self.rank and after[r] == before[r] and r not in ended]
            phases = []
            for r in range(self.world):
                k = f"{self.ns}/phase/{r}"
                phases.append(self.store.get(k).decode() if self.store.check([k]) else "?")
        except Exception as e:  # noqa: BLE001
            return f"could not diagnose ({type(e).__name__}: the launcher's store is gone)"
        where = [f"{r}:{p}" for r, p in enumerate(phases)]
        # Alive ranks elsewhere than this one are the likely stuck ones.
        stuck = [r for r in range(self.world) if r not in dead and r not in ended
                 and phases[r] != phases[self.rank]]
        who = (", ".join(f"rank {r} ({self.roles[r]})" for r in dead) + " died (no heartbeat)"
               if dead else "no rank died; " + (", ".join(
                   f"rank {r} ({self.roles[r]}) is stuck in '{phases[r]}'" for r in stuck)
                   or "a rank is stuck (compare phases)"))
        return f"{who}; last phases: " + " | ".join(where)


def rank_plan(cfg: C.Config, nnodes: int, nproc: int) -> list[dict]:
    """Which global rank trains or generates, and on which node/device (for --dry-run)."""
    world = nnodes * nproc
    C.validate_world(cfg, world)
    n_gen = cfg.cluster.gen_ranks if world > 1 else 1
    plan = []
    for r in range(world):
        role = "trainer" if r < world - n_gen or world == 1 else "generation"
        plan.append({"rank": r, "node": r // nproc, "local_rank": r % nproc, "role": role,
                     "device": f"{{dev}}:{r % nproc}"})
    return plan


# ----------------------------------------------------------------------------- data
def step_problems(problems: list, step: int, per_step: int, seed: int) -> list:
    """The problems of `step`: an endless stream of per-epoch shuffles, seeded."""
    out = []
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(i, len(problems))
        order = list(range(len(problems)))
        random.Random(seed * 100_003 + epoch).shuffle(order)
        out.append(problems[order[pos]])
    return out


# ----------------------------------------------------------------------------- training
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
    while count is not None and len(mbs) < count:
        k = max(range(len(mbs)), key=lambda j: len(mbs[j]))
        if len(mbs[k]) < 2:
            raise ValueError(f"cannot make {count} micro-batches from {len(lengths)} sequences")
        half = len(mbs[k]) // 2
        mbs[k:k + 1] = [mbs[k][:half], mbs[k][half:]]
    return mbs


def accumulate_gradients(policy, ref, episodes: list[R.Episode], idx: list[int], adv, keep,
                         denom: float, by_index: dict, ctx: dict, cfg: C.Config) -> dict[str, float]:
    """Forward/backward over this rank's episodes `idx` in micro-batches; gradients accumulate.

    Every micro-batch loss is normalised by the step's GLOBAL denominator, so the accumulated
    gradient equals the full-batch gradient whatever the micro-batching (tested).
    """
    lc, ro, tk = cfg.loss, cfg.rollout, ctx["tokens"]
    ip = ctx["image_processor"]
    lengths = [len(episodes[i].prompt_ids) - 1 + len(episodes[i].response_ids)
               + ip.get_number_of_image_patches(by_index[episodes[i].index].image.height,
                                                by_index[episodes[i].index].image.width, {})
               // ip.merge_size ** 2 for i in idx]
    plan = plan_micro_batches(lengths, cfg.train.micro_batch_size, cfg.train.micro_batch_tokens)
    n = torch.tensor([len(plan)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=ctx["train_group"])
    plan = plan_micro_batches(lengths, cfg.train.micro_batch_size, cfg.train.micro_batch_tokens,
                              count=int(n))
    n_train = len(ctx["trainers"])
    sums = {k: 0.0 for k in ("loss", "kl", "entropy", "clip_frac_low", "clip_frac_high",
                             "ratio_mean", "tis_weight_mean", "approx_kl", "tokens", "slots")}
    lp_diff = 0.0
    for mb in plan:
        chunk = [idx[j] for j in mb]
        eps = [episodes[i] for i in chunk]
        batch = M.collate(eps, [by_index[e.index].image for e in eps], ip, tk, ctx["device"])
        mask = batch["response_mask"].float() * keep[chunk].float().unsqueeze(1).to(ctx["device"])
        lp, ent = M.sequence_logprobs(policy, batch, tk, ro.temperature)
        ref_lp = None
        if lc.kl_coef > 0:
            with torch.no_grad():
                ref_lp, _ = M.sequence_logprobs(ref, batch, tk, ro.temperature)
        behaviour = batch["engine_logprobs"]
        # One update per batch: the proximal ("old") policy is the current one, so the ratio is
        # 1 in value with the gradient of the policy gradient; the engine's logprobs enter only
        # through truncated importance sampling (engine/trainer mismatch, one-step staleness).
        loss, m = L.policy_loss(
            lp, lp.detach(), adv[chunk].to(lp.device), mask, clip_low=lc.clip_low,
            clip_high=lc.clip_high, aggregation=lc.aggregation, kl_coef=lc.kl_coef,
            ref_logprobs=ref_lp, kl_estimator=lc.kl_estimator, max_response_len=ro.max_new_tokens,
            tis_cap=lc.tis_cap or None, behaviour_logprobs=behaviour if lc.tis_cap else None,
            loss_denominator=float(denom))
        if C.fault_active("nan_loss", ctx.get("step")):  # tests: a non-finite loss
            loss = loss * float("nan")
        # FSDP2 averages gradients over the trainer ranks; the loss is already normalised by the
        # global denominator, so undo the average to get exactly the full-batch gradient.
        (loss * n_train).backward()
        rmask = batch["response_mask"].bool()
        ntok = float(rmask.sum())
        sums["loss"] += float(loss.detach())
        for k in ("kl", "clip_frac_low", "clip_frac_high", "ratio_mean", "tis_weight_mean", "approx_kl"):
            sums[k] += float(m[k]) * ntok
        sums["entropy"] += float(ent.detach()[rmask].sum())
        sums["tokens"] += float(batch["attention_mask"].sum())
        sums["slots"] += float(batch["attention_mask"].numel())
        sums["resp_tokens"] = sums.get("resp_tokens", 0.0) + ntok
        if rmask.any():
            lp_diff = max(lp_diff, float((lp.detach() - behaviour)[rmask].abs().max()))
    sums["micro_batches"] = float(len(plan))
    sums["lp_diff"] = lp_diff
    return sums


def train_on(policy, ref, opt, sched, episodes: list[R.Episode], mine: slice, by_index: dict,
             ctx: dict, cfg: C.Config) -> dict[str, float]:
    """One optimizer step on this trainer's share of the step's episodes."""
    lc, ro = cfg.loss, cfg.rollout
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
    adv = L.group_advantages(rewards, ro.group_size, scale_by_std=lc.scale_by_std).float()  # [N]
    keep = torch.ones(len(episodes), dtype=torch.bool)
    n_dropped = 0
    if lc.drop_zero_variance:
        zero = L.zero_variance_groups(rewards, ro.group_size)                              # [N/G]
        n_dropped = int(zero.sum())
        keep &= ~zero.repeat_interleave(ro.group_size)
    if lc.exclude_truncated:
        keep &= torch.tensor([not e.truncated for e in episodes])
    # Dropped episodes stay in the micro-batches with a zero mask, so every trainer rank runs
    # the same number of forward/backward passes (FSDP collectives) and the loss is unchanged;
    # they leave the denominator. (Compute is not saved; the batch is not refilled.)
    n_tokens = sum(len(e.response_ids) for e, k in zip(episodes, keep) if k)
    denom = {"token-mean": n_tokens, "seq-mean-token-mean": int(keep.sum()),
             "seq-mean-token-sum-norm": len(episodes) * ro.max_new_tokens}[lc.aggregation]
    sums = accumulate_gradients(policy, ref, episodes, list(range(len(episodes)))[mine], adv, keep,
                                max(1, denom), by_index, ctx, cfg)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.train.grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    # All trainer ranks see the same global norm, so they agree on skipping a non-finite step.
    skipped = not (grad_norm == grad_norm and abs(grad_norm) != float("inf"))
    if not skipped:
        opt.step()
        sched.step()
    opt.zero_grad(set_to_none=True)
    # One reduction for all sums, one for the max.
    lp_diff = sums.pop("lp_diff")
    keys = list(sums)
    vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(vec, group=ctx["train_group"])
    tot = dict(zip(keys, vec.tolist()))
    mx = torch.tensor([lp_diff], dtype=torch.float64)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=ctx["train_group"])
    ntok = max(1.0, tot["resp_tokens"])
    out = {"loss": tot["loss"], "grad_norm": grad_norm, "kl": tot["kl"] / ntok,
           "entropy": tot["entropy"] / ntok, "logprob_diff/max": float(mx[0]),
           "train/skipped": float(skipped), "train/dropped_groups": float(n_dropped),
           "train/lr": sched.get_last_lr()[0],
           "train/padding_frac": 1.0 - tot["tokens"] / max(1.0, tot["slots"]),
           "train/micro_batches": tot["micro_batches"] / len(ctx["trainers"])}
    for k in ("clip_frac_low", "clip_frac_high", "ratio_mean", "tis_weight_mean", "approx_kl"):
        out[f"train/{k}"] = tot[k] / ntok
    out["advantage/mean"] = float(adv.mean())
    out["advantage/abs_mean"] = float(adv.abs().mean())
    return out


def rollout_metrics(episodes: list[R.Episode], stats: list[dict], version: int) -> dict[str, float]:
    n = max(1, len(episodes))
    out = {"reward/mean": sum(e.reward for e in episodes) / n,
           "response_len/mean": sum(len(e.response_ids) for e in episodes) / n,
           "response/truncated_frac": sum(e.truncated for e in episodes) / n,
           "rollout/staleness": max((version - e.version for e in episodes), default=0),
           # generation ranks run in parallel: the step waits for the slowest
           "time/generate_s": max((s["generate_s"] + s["reward_s"] for s in stats), default=0.0)}
    parts = sorted({k for e in episodes for k in e.parts})
    for k in parts:
        out[f"reward/{k}"] = sum(e.parts.get(k, 0.0) for e in episodes) / n
    out.setdefault("reward/accuracy", 0.0)
    out.setdefault("reward/format", 0.0)
    out["reward/errors"] = sum(e.parts.get("errors", 0.0) for e in episodes)
    return out


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configs, flags, overrides = [], {}, []
    it = iter(argv)
    for a in it:
        key, eq, val = a.partition("=")
        if key == "--config":  # repeatable: a preset after the base config
            configs.append(val if eq else next(it, None))
        elif key in ("--resume", "--checkpoint"):
            flags[key] = val if eq else next(it, None)
        elif a in ("--dry-run", "--eval-only"):
            flags[a] = True
        else:
            overrides.append(a)
    try:
        cfg = C.load(configs, overrides)
        if flags.get("--dry-run"):
            return dry_run(cfg)
        if flags.get("--eval-only") and not flags.get("--checkpoint"):
            raise C.ConfigError("--eval-only needs --checkpoint DIR")
        return run(cfg, resume=flags.get("--resume"), eval_checkpoint=flags.get("--checkpoint")
                   if flags.get("--eval-only") else None)
    except C.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


def dry_run(cfg: C.Config) -> int:
    """The resolved config, one JSON line per rank, and one with every group's members."""
    print(C.dump_toml(cfg))
    dev = os.environ.get("GRPO_DEVICE", "cuda|npu")
    plan = rank_plan(cfg, cfg.cluster.nnodes, cfg.cluster.nproc_per_node)
    for row in plan:
        row["device"] = row["device"].format(dev=dev)
        print(json.dumps(row))
    trainers = [r["rank"] for r in plan if r["role"] == "trainer"]
    gens = [r["rank"] for r in plan if r["role"] == "generation"]
    groups = {"world (gloo objects, control)": [r["rank"] for r in plan],
              "trainers (FSDP2 mesh)": trainers, "sync (trainer 0 + engines)": [0] + gens}
    if cfg.rollout.engine == "vllm":
        groups["vLLM weight channel (outside torch's world)"] = (
            ["trainer rank 0"] + [f"rank {g} worker {w}" for g in gens
                                  for w in range(cfg.rollout.tensor_parallel_size)])
    print(json.dumps({"groups": groups}))
    return 0


def build_trainer(cfg: C.Config, ctx: dict, dev: D.Device, model_path: str, channel=None) -> dict:
    """Policy (FSDP2), optional frozen reference, AdamW, LR schedule, weight sender."""
    policy = M.load_model(model_path, dtype=torch.float32, device=ctx["device"])
    mesh = _mesh(ctx, dev)
    M.apply_fsdp(policy, mesh, mixed_precision=cfg.model.mixed_precision,
                 checkpointing=cfg.model.activation_checkpointing)
    ref = None
    if cfg.loss.kl_coef > 0:  # frozen reference, sharded like the policy; only when used
        ref = M.apply_fsdp(M.load_model(model_path, torch.float32, ctx["device"]).eval(), mesh,
                           mixed_precision=cfg.model.mixed_precision)
        ref.requires_grad_(False)
    tc = cfg.train
    opt = torch.optim.AdamW(policy.parameters(), lr=tc.lr, betas=(tc.beta1, tc.beta2),
                            weight_decay=tc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / tc.warmup_steps) if tc.warmup_steps else 1.0)
    sender = S.Sender(policy, cfg.model.dtype, cfg.sync.bucket_mb, group=ctx["sync_group"],
                      src=0, is_root=ctx["rank"] == 0, device=ctx["device"], channel=channel)
    return dict(policy=policy, ref=ref, opt=opt, sched=sched, sender=sender)


def build_engine(cfg: C.Config, ctx: dict, dev: D.Device, model_path: str):
    if cfg.rollout.engine == "hf":
        return R.HFEngine(model_path, S.DTYPES[cfg.model.dtype], ctx["tokens"],
                          ctx["image_processor"], ctx["device"])
    # vLLM runs in processes it spawns, which must see only this rank's device.
    D.narrow_visible(dev, ctx["local_rank"])
    return R.VLLMEngine(model_path, cfg.model.dtype, ctx["tokens"], cfg.rollout,
                        cfg.model.min_pixels, cfg.model.max_pixels,
                        seed=cfg.run.seed + ctx["gens"].index(ctx["rank"]),
                        timeout_s=cfg.cluster.timeout_s)


def open_vllm_channel(cfg: C.Config, ctx: dict, dev: D.Device, engine):
    """Trainer rank 0 and every vLLM worker join one communicator (gloo / NCCL / HCCL by
    device), once. Returns trainer rank 0's end (None elsewhere)."""
    tp = cfg.rollout.tensor_parallel_size
    world = 1 + len(ctx["gens"]) * tp
    addr = [os.environ.get("MASTER_ADDR", "127.0.0.1"), _free_port()] if ctx["rank"] == 0 else [None, None]
    dist.broadcast_object_list(addr, 0, group=ctx["ctrl"])
    host, port = addr
    if ctx["world"] == 1:  # both ends in this process: the engine joins from a thread
        t = threading.Thread(target=engine.init_weight_sync, args=(host, port, 1, world))
        t.start()
        chan = S.open_channel(dev.comm, host, port, 0, world, ctx["device"])
        t.join()
        return chan
    if ctx["is_gen"]:
        engine.init_weight_sync(host, port, 1 + ctx["gens"].index(ctx["rank"]) * tp, world)
        return None
    return S.open_channel(dev.comm, host, port, 0, world, ctx["device"]) if ctx["rank"] == 0 else None


def load_data(cfg: C.Config, split: str, tokenizer, ctx: dict) -> tuple[list, int]:
    """(problems, skipped): bad rows and prompts too long once image tokens count are skipped."""
    rows, skipped = data.load_split(cfg.data.source, split, seed=cfg.run.seed,
                                    n_synthetic=cfg.data.n_synthetic, image_size=cfg.data.image_size)
    ip, tk = ctx["image_processor"], ctx["tokens"]

    def too_long(p) -> bool:  # never truncate a prompt: image tokens would be cut
        n_img = ip.get_number_of_image_patches(p.image.height, p.image.width, {}) // ip.merge_size ** 2
        text = M.prompt_ids(tokenizer, data.user_text(p, cfg.data.template), 1, tk)
        return len(text) - 1 + n_img > cfg.data.max_prompt_len

    rows, more = data.skip_bad_rows(rows, is_too_long=too_long)
    if not rows:
        raise C.ConfigError(f"data.source: no usable rows in split {split!r} of {cfg.data.source} "
                            f"({len(skipped) + len(more)} skipped; see data.max_prompt_len)")
    return rows, len(skipped) + len(more)


def run(cfg: C.Config, resume: str | None = None, eval_checkpoint: str | None = None) -> int:
    """Set up the world, then run; any failure ends THIS rank at once with a line naming the
    culprit (torchrun then stops the others, which print their own view)."""
    dev = D.detect()
    ctx = setup_distributed(cfg, dev)
    rank = ctx["rank"]
    roles = ["trainer+generation" if ctx["world"] == 1 else
             "trainer" if r in ctx["trainers"] else "generation" for r in range(ctx["world"])]
    live = ctx["live"] = Liveness(rank, ctx["world"], roles)

    def on_sigterm(signum, frame):  # torchrun stops the survivors of a failed rank this way
        print(f"error: rank {rank} ({roles[rank]}) stopped by the launcher; {live.report()}",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        code = _run(cfg, ctx, dev, resume, eval_checkpoint)
        live.close()
        return code
    except C.ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - report, then exit without a hanging teardown
        live.failing = True  # this rank reports its own failure; keep beating meanwhile
        report = live.report()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: rank {rank} ({roles[rank]}) failed: {type(e).__name__}: {msg[:300]}; "
              f"{report}", file=sys.stderr, flush=True)
        live.abort(f"rank {rank} ({roles[rank]}) failed ({type(e).__name__}); {report}")
        if "died" not in report:
            import traceback
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(4)


def _run(cfg: C.Config, ctx: dict, dev: D.Device, resume: str | None,
         eval_checkpoint: str | None) -> int:
    rank, is_root = ctx["rank"], ctx["rank"] == 0
    live = ctx["live"]
    # A vLLM generation rank never touches the accelerator itself (its engine process does).
    vllm_gen = cfg.rollout.engine == "vllm" and ctx["is_gen"] and not ctx["is_trainer"]
    ctx["device"] = torch.device("cpu") if vllm_gen else D.torch_device(dev, ctx["local_rank"])
    out_dir = Path(cfg.run.out_dir)
    if is_root:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.toml").write_text(C.dump_toml(cfg))
        M.resolve_path(cfg.model.path, out_dir, cfg.run.seed)  # builds the tiny model once
    dist.barrier(group=ctx["ctrl"])
    model_path = M.resolve_path(cfg.model.path, out_dir, cfg.run.seed)
    if eval_checkpoint:  # evaluate a saved HF export with the engines, nothing else
        hf = Path(eval_checkpoint) / "hf"
        model_path = str(hf if hf.is_dir() else eval_checkpoint)
    D.manual_seed_all(cfg.run.seed)
    tokenizer = M.load_tokenizer(model_path)
    ctx["image_processor"] = M.load_image_processor(model_path, cfg.model.min_pixels,
                                                    cfg.model.max_pixels)
    ctx["tokens"] = M.Tokens.of(tokenizer, M.vocab_size(model_path))
    ro = cfg.rollout
    eval_set = None
    if cfg.run.eval_every or eval_checkpoint:
        eval_set = load_data(cfg, "validation", tokenizer, ctx)[0][:cfg.run.eval_size]
    engine = build_engine(cfg, ctx, dev, model_path) if ctx["is_gen"] else None
    if eval_checkpoint:
        m = evaluate(ctx, engine, eval_set, tokenizer, cfg, version=-1)
        if is_root:
            print(json.dumps(m))
            with open(out_dir / "eval.jsonl", "a") as f:
                f.write(json.dumps({"checkpoint": str(eval_checkpoint), **m}) + "\n")
        dist.destroy_process_group()
        return 0

    problems, n_skipped = load_data(cfg, "train", tokenizer, ctx)
    by_index = {p.index: p for p in problems}
    channel = None
    if cfg.rollout.engine == "vllm" and cfg.sync.enabled:
        live.phase("start: opening the vLLM weight channel")
        channel = open_vllm_channel(cfg, ctx, dev, engine)
    tr = build_trainer(cfg, ctx, dev, model_path, channel) if ctx["is_trainer"] else {}
    receiver = (S.Receiver(ctx["sync_group"], src=0, device=ctx["device"])
                if ctx["is_gen"] and ctx["world"] > 1 else None)

    # Resume: rank 0 picks the checkpoint, every rank learns the step and version.
    start, version, skipped_in_row, skipped_total = 0, 0, 0, 0.0
    pick = [None]
    if is_root:
        ck = Path(resume) if resume else ckpt.latest(out_dir)
        pick = [str(ck) if ck else None]
    dist.broadcast_object_list(pick, 0, group=ctx["ctrl"])
    if pick[0]:
        if ctx["is_trainer"]:
            meta = ckpt.load(Path(pick[0]), policy=tr["policy"], opt=tr["opt"], sched=tr["sched"],
                             train_group=ctx["train_group"],
                             rank_in_group=ctx["trainers"].index(rank))
            D.set_rng_state(dev, meta["rng"])
        meta_obj = [ckpt.read_meta(Path(pick[0])) if is_root else None]
        dist.broadcast_object_list(meta_obj, 0, group=ctx["ctrl"])
        start, version = meta_obj[0]["step"], meta_obj[0]["version"]
        skipped_in_row, skipped_total = meta_obj[0]["skipped_in_row"], meta_obj[0]["skipped_total"]
        if cfg.sync.enabled:  # the engines start from the resumed weights
            sync_weights(ctx, tr.get("sender"), receiver, engine, version)
        if is_root:
            print(f"resumed from {pick[0]} at step {start} (weight version {version})", flush=True)

    n_gen = len(ctx["gens"])
    per_gen = ro.prompts_per_step // n_gen
    gen_index = ctx["gens"].index(rank) if ctx["is_gen"] else -1
    per_trainer = ro.prompts_per_step * ro.group_size // len(ctx["trainers"])
    t_index = ctx["trainers"].index(rank) if ctx["is_trainer"] else -1
    sampling = R.Sampling(n=ro.group_size, temperature=ro.temperature, top_p=ro.top_p,
                          top_k=ro.top_k, max_new_tokens=ro.max_new_tokens)
    logger = Logger(out_dir, cfg.run.log_samples, start) if is_root else None

    def generate(step: int) -> tuple[list[R.Episode], dict]:
        mine = step_problems(problems, step, ro.prompts_per_step, cfg.run.seed)
        mine = mine[gen_index * per_gen:(gen_index + 1) * per_gen]
        return R.rollout(engine, mine, tokenizer, ctx["tokens"], sampling, cfg.data.template,
                         cfg.reward.functions, cfg.reward.timeout_s, version,
                         group_offset=gen_index * per_gen,
                         seed=cfg.run.seed * 1_000_003 + step * 1009 + gen_index)
    pending = None
    dist.barrier(group=ctx["ctrl"])  # start-up skew must not count as step 0's time
    for step in range(start, cfg.run.steps):
        t_step = time.perf_counter()
        if C.fault_active("die", step):      # tests: a rank killed mid-run
            os.kill(os.getpid(), signal.SIGKILL)
        if C.fault_active("hang", step):     # tests: a rank alive but stuck
            live.phase(f"step {step}: hung")
            time.sleep(10 ** 6)
        # 1. rollout on the generation ranks (with overlap: produced during the last step)
        live.phase(f"step {step}: rollout")
        local: tuple[list, dict] = ([], {})
        if ctx["is_gen"]:
            local, pending = pending or generate(step), None
        # 2. episodes to every rank (gloo object exchange)
        live.phase(f"step {step}: exchange")
        gathered: list = [None] * ctx["world"]
        dist.all_gather_object(gathered, local, group=ctx["ctrl"])
        if ctx["is_gen"] and ro.max_staleness and step + 1 < cfg.run.steps:
            # One-step overlap: the engines produce step+1's batch with the current weights
            # while the trainers train on this one; the sync below waits for both.
            live.phase(f"step {step}: rollout of step {step + 1} (overlap)")
            pending = generate(step + 1)
        episodes = sorted((e for eps, _ in gathered for e in eps), key=lambda e: e.group)
        stats = [s for eps, s in gathered if s]
        gen_version = min((e.version for e in episodes), default=version)
        metrics: dict[str, float] = {"step": step, "weight_version": gen_version,
                                     "data/skipped": n_skipped}
        metrics.update(rollout_metrics(episodes, stats, version))
        # 3. train
        live.phase(f"step {step}: train")
        t0 = time.perf_counter()
        if ctx["is_trainer"]:
            ctx["step"] = step
            mine_slice = slice(t_index * per_trainer, (t_index + 1) * per_trainer)
            metrics.update(train_on(tr["policy"], tr["ref"], tr["opt"], tr["sched"], episodes,
                                    mine_slice, by_index, ctx, cfg))
            skipped_in_row = skipped_in_row + 1 if metrics["train/skipped"] else 0
            metrics["train/skipped_steps"] = skipped_total = skipped_total + metrics["train/skipped"]
        metrics["time/train_s"] = time.perf_counter() - t0
        # 4. weight sync: trainers -> every engine
        live.phase(f"step {step}: sync")
        t0 = time.perf_counter()
        metrics["sync/bytes"] = 0.0
        if cfg.sync.enabled:
            metrics["sync/bytes"] = float(sync_weights(ctx, tr.get("sender"), receiver, engine,
                                                       version + 1))
            version += 1
        metrics["time/sync_s"] = time.perf_counter() - t0
        if cfg.sync.enabled and cfg.sync.verify:
            metrics["sync/checksum_ok"] = float(verify_sync(ctx, tr.get("policy"), engine,
                                                            cfg.model.dtype))
        metrics["time/step_s"] = time.perf_counter() - t_step
        done = step + 1
        # 5. evaluation and checkpoint
        live.phase(f"step {step}: eval/checkpoint")
        if eval_set and (done % max(1, cfg.run.eval_every) == 0 or done == cfg.run.steps):
            metrics.update(evaluate(ctx, engine, eval_set, tokenizer, cfg, version))
        if cfg.run.keep_last > 0 and ((cfg.run.save_every and done % cfg.run.save_every == 0)
                                      or done == cfg.run.steps):
            if ctx["is_trainer"]:
                ckpt.save(out_dir / "checkpoints" / f"step_{done:06d}", policy=tr["policy"],
                          opt=tr["opt"], sched=tr["sched"], rng=D.rng_state(dev),
                          meta={"step": done, "version": version, "skipped_in_row": skipped_in_row,
                                "skipped_total": skipped_total},
                          tokenizer=tokenizer, image_processor=ctx["image_processor"],
                          dtype=S.DTYPES[cfg.model.dtype], train_group=ctx["train_group"],
                          is_root=is_root, keep_last=cfg.run.keep_last)
        if logger:
            logger.log(metrics, episodes)
        stop = torch.tensor([skipped_in_row >= cfg.train.max_skipped_steps], dtype=torch.int64)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=ctx["ctrl"])
        if stop.item():
            if is_root:
                print(f"error: {cfg.train.max_skipped_steps} consecutive steps had a non-finite "
                      f"loss or gradient norm (train.max_skipped_steps); stopping", file=sys.stderr)
            dist.destroy_process_group()
            return 3
    dist.barrier(group=ctx["ctrl"])
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()
    dist.destroy_process_group()
    return 0


def evaluate(ctx: dict, engine, problems: list, tokenizer, cfg: C.Config, version: int) -> dict:
    """Greedy decoding of the evaluation split on the generation ranks, geometry-graded."""
    ro = cfg.rollout
    local = ([], {})
    if ctx["is_gen"]:
        n_gen, j = len(ctx["gens"]), ctx["gens"].index(ctx["rank"])
        sp = R.Sampling(n=1, greedy=True, max_new_tokens=ro.max_new_tokens)
        local = R.rollout(engine, problems[j::n_gen], tokenizer, ctx["tokens"], sp,
                          cfg.data.template, [{"name": "geometry", "weight": 1.0}],
                          cfg.reward.timeout_s, version, group_offset=0, seed=0)
    got: list = [None] * ctx["world"]
    dist.all_gather_object(got, local, group=ctx["ctrl"])
    eps = [e for g, _ in got for e in g]
    n = max(1, len(eps))
    return {"eval/accuracy": sum(e.parts.get("accuracy", 0.0) for e in eps) / n,
            "eval/format": sum(e.parts.get("format", 0.0) for e in eps) / n,
            "eval/response_len": sum(len(e.response_ids) for e in eps) / n,
            "eval/n": len(eps)}


def _mesh(ctx: dict, dev: D.Device):
    from torch.distributed.device_mesh import DeviceMesh
    # Never DeviceMesh(ranks) over a subset: that calls new_group on the whole world.
    return DeviceMesh.from_group(ctx["train_group"], dev.kind)


def sync_weights(ctx: dict, sender, receiver, engine, version: int) -> int:
    """Trainers send, engines receive. Returns the bytes sent (root)."""
    vllm = isinstance(engine, R.VLLMEngine)
    if ctx["world"] == 1:
        if not vllm:
            return sender.send(version, sink=engine.load_weights)
        import concurrent.futures as cf  # both ends here: send from a thread, receive in vLLM
        with cf.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(sender.send, version)
            engine.receive_weights(version, sender.plan)
            return sent.result()
    if ctx["is_trainer"]:
        return sender.send(version)
    if vllm:
        got, plan = receiver.receive_control()
        _check_version(ctx, version, got)
        engine.receive_weights(got, plan)
        return 0
    got, buckets = receiver.receive()
    _check_version(ctx, version, got)
    for named in buckets:
        engine.load_weights(named, adopt=True)
    return 0


def _check_version(ctx: dict, want: int, got: int) -> None:
    if got != want:
        raise RuntimeError(f"weight sync: rank {ctx['rank']} expected version {want}, got {got}")


def verify_sync(ctx: dict, policy, engine, dtype: str) -> bool:
    """Bitwise: every engine's weights == the trainer's full weights cast to the sync dtype."""
    ref = None
    if ctx["is_trainer"]:
        full = [(n, S.full_tensor(p).detach().to(S.DTYPES[dtype])) for n, p in policy.named_parameters()]
        ref = S.checksum(full) if ctx["rank"] == 0 else None
    mine = S.checksum(list(engine.named_parameters())) if ctx["is_gen"] else None
    got: list = [None] * ctx["world"]
    dist.all_gather_object(got, (ref, mine), group=ctx["ctrl"])
    ref = got[0][0]
    return all(g[1] == ref for g in got if g[1] is not None)


class Logger:
    """metrics.jsonl (one object per step), samples.jsonl, one readable stdout line per step."""

    def __init__(self, out_dir: Path, n_samples: int, start: int):
        # A resumed run drops what a crashed run logged after its last checkpoint.
        for name in ("metrics.jsonl", "samples.jsonl"):
            p = out_dir / name
            if p.exists():
                keep = [ln for ln in p.read_text().splitlines() if json.loads(ln)["step"] < start]
                p.write_text("".join(ln + "\n" for ln in keep))
        self.metrics = open(out_dir / "metrics.jsonl", "a")
        self.samples = open(out_dir / "samples.jsonl", "a")
        self.n_samples = n_samples

    def log(self, m: dict, episodes: list[R.Episode]) -> None:
        self.metrics.write(json.dumps(m) + "\n")
        self.metrics.flush()
        for e in episodes[:self.n_samples]:
            self.samples.write(json.dumps({"step": m["step"], "index": e.index, "reward": e.reward,
                                           "parts": e.parts, "response": e.text}) + "\n")
        self.samples.flush()
        print(f"step {m['step']:4d} | v{m['weight_version']} | reward {m['reward/mean']:.3f} "
              f"acc {m['reward/accuracy']:.3f} fmt {m['reward/format']:.3f} | "
              f"len {m['response_len/mean']:.1f} | loss {m.get('loss', 0):+.4f} "
              f"gnorm {m.get('grad_norm', 0):.3f} ent {m.get('entropy', 0):.2f} "
              f"lpdiff {m.get('logprob_diff/max', 0):.1e} | gen {m['time/generate_s']:.2f}s "
              f"train {m['time/train_s']:.2f}s sync {m['time/sync_s']:.2f}s "
              f"step {m['time/step_s']:.2f}s"
              + (f" | eval acc {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
