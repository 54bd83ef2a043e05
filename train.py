"""GRPO for Qwen vision-language and language models (families.py), one torchrun launch, no Ray.

The world is split statically (world.py, `cluster.layout`): trainers run FSDP2 over a trainer-only
mesh, `cluster.gen_ranks` ranks own one inference engine each. One step:

    1. rollout   generation ranks: problems -> engine.generate(n=G) -> rewards -> Episodes
                 (DAPO dynamic sampling: further prompts until the groups disagree)
    2. exchange  every rank receives every Episode (gloo object exchange)
    3. train     trainer ranks (update.py): plan -> proximal pass -> filters -> denominators
                 -> advantages -> train.mini_batches x train.ppo_epochs optimizer steps
    4. sync      trainer rank 0 -- buckets over the sync group --> every engine (version + 1)
                 (cluster.colocate: every rank's engine sleeps from 2. to 4.: docs/colocate.md)
    5. eval / checkpoint / log

A world of 1 plays both roles in one process. With `rollout.max_staleness = k` the engines run k
versions ahead of the trainers (pipeline.py, docs/async.md).

`python train.py --help` lists the flags (and the launch); every config key is documented in
config.py. Where things live: the update in update.py and loss.py (objectives and filters:
registry.py), the policy in trainer.py, the engines in hf_engine.py and vllm_engine.py (as
episode.py says), the weights' way to them in sync.py and channel.py, failures in failures.py.
"""
from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__":  # a stop while torch imports (seconds): one line, exit 128 + signal
    def _stopped(signum, _frame):  # until failures.on_signals takes over
        sys.stderr.write(f"error: rank {os.environ.get('RANK', '0')} stopped by "
                         f"{signal.Signals(signum).name} during start-up\n")
        os._exit(128 + signum)
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _stopped)

import functools
import json  # (the imports below come after those handlers: torch alone takes seconds)
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint as ckpt
import config
import data
import engines
import episode
import evaluation
import failures
import families
import inputs
import loss  # noqa: F401  (registers the built-in objectives before registry.check)
import microbatches
import model
import multiturn
import pipeline
import registry
import resume_rules
import reward_models
import rewards
import rollout
import sync
import tracking
import trainer
import update
from channel import check_channel, open_engine_channel
from device import Device, manual_seed_all, set_rng_state, torch_device, detect as detect_device
from errors import ConfigError
from world import World, dry_run, launched_size, validate_world
from world import setup as setup_world


# ----------------------------------------------------------------------------- entry point
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(config.USAGE, end="")
        return 0
    failures.on_signals(None)  # a stop during start-up: one line, no traceback
    try:
        configs, flags, overrides = config.split_argv(argv)
        cfg = load_config(configs, overrides)
        if flags.get("--dry-run"):
            peek = model.peek_config(cfg.model.path)
            code = dry_run(cfg, engines.engine_class(cfg.rollout.engine).OWN_CHANNEL, peek)
            for note in filter(None, engines.start_notes(cfg, peek)):  # what the engines decide from the model
                print(note)
            return code
        if flags.get("--eval-only") and not flags.get("--checkpoint"):
            raise ConfigError("--eval-only needs --checkpoint DIR")
        sources = " + ".join(configs) + (f" + {len(overrides)} override(s)" if overrides else "")
        return run(cfg, resume=flags.get("--resume"), eval_checkpoint=flags.get("--checkpoint")
                   if flags.get("--eval-only") else None, sources=sources or "defaults",
                   check=flags.get("--check-channel", False))
    except ConfigError as e:  # also the start-up checks: once (rank 0), exit 2 on every rank
        return failures.exit_bad_input(e)


def load_config(paths: str | list[str] | None, overrides: list[str] = ()) -> config.Config:
    """config.load (the tree, its ranges, the cross-key rules), then the checks that need the
    modules config.py does not import: the [loss] parts (after importing loss.plugins), the
    reward functions' names, model.path's family, the engine and data.source; each one line."""
    cfg = config.load(paths, overrides)
    registry.check(cfg.loss)  # the [loss] parts' keys and loss.correction's
    trainer.check(cfg)  # train.master_dtype against the model keys; model.teacher_path's family
    models = reward_models.check(cfg, rewards.names())  # [[reward.models]]: their names
    for key in ("reward", "eval"):
        rewards.check_functions(f"{key}.functions", getattr(cfg, key).functions, models)
    families.check_model_path(cfg.model.path)
    families.check_routing_replay(cfg.model.path, cfg.model.moe_routing_replay)
    engines.check(cfg)  # a known engine, environment and tools (envs/); what the engines need of the rest
    data.check_sources(cfg.data, functools.partial(rewards.check_functions, models=models))  # data.source(s)
    return cfg


def run(cfg: config.Config, resume: str | None = None, eval_checkpoint: str | None = None,
        sources: str = "", check: bool = False) -> int:
    """Set up the world, then train (or evaluate a checkpoint) under the failure guard."""
    dev = detect_device()
    validate_world(cfg, launched_size(), dev.kind)  # before any process group exists
    try:
        own = engines.engine_class(cfg.rollout.engine).OWN_CHANNEL  # asked once; world.own_channel
        c = cfg.cluster
        world = setup_world(c.gen_ranks, c.timeout_s, dev.backend, dev, cfg.rollout.tensor_parallel_size
                            if own else None, check, c.layout, c.colocate)
    except ConfigError:  # too few devices on this node (NodeConfigError): main() prints it, exit 2
        raise
    except Exception as e:  # noqa: BLE001 - an unreachable master, ...: one line, exit 4
        return failures.world_failed(e, cfg.cluster.timeout_s)
    tracking.quiet_other_ranks(world.rank)
    live = failures.Liveness(world.rank, [world.role(r) for r in range(world.size)])
    failures.on_signals(live)
    if check:  # --check-channel: the weight channel alone, then exit (channel.check_channel)
        return failures.guarded(live, lambda: check_channel(world, dev, cfg.sync, cfg.cluster.timeout_s))
    ckpt.claim_run_dir(cfg.run, world, resume, eval_checkpoint)  # one job per run folder; writable
    if eval_checkpoint:
        return failures.guarded(live, lambda: evaluate_checkpoint(cfg, world, dev, live, eval_checkpoint))
    return failures.guarded(live, lambda: train(cfg, world, dev, live, resume, sources))


# ----------------------------------------------------------------------------- set-up
def rank_device(world: World, dev: Device) -> torch.device:
    # A vLLM generation rank never touches the accelerator itself (its engine process does).
    if world.own_channel and world.is_gen and not world.is_trainer:
        return torch.device("cpu")
    return torch_device(dev, world.local_rank)


def prepare_model(cfg: config.Config, world: World, out_dir: Path) -> str:
    """Rank 0 builds the tiny model once (if asked) in the run folder (ckpt.claim_run_dir made
    it); the model path."""
    if world.is_root:
        model.resolve_path(cfg.model.path, out_dir, cfg.run.seed)
    dist.barrier(group=world.ctrl)
    return model.resolve_path(cfg.model.path, out_dir, cfg.run.seed)


def load_problems(cfg: config.Config, split: str, procs: inputs.Processors,
                  limit: int | None = None) -> tuple[list, int]:
    """(problems, skipped) of every source (`limit`: the first of each): bad rows and prompts too
    long once image tokens count are skipped."""
    d = cfg.data
    data.refuse_images(procs.vision, cfg.model.path, d)  # images for a text-only model: ModelError
    try:
        return data.load_sources(d, split, seed=cfg.run.seed, limit=limit, prompt_len=lambda p:
                                 inputs.prompt_len(procs, data.user_text(p, d.template), p.images))
    except ValueError as e:  # no usable rows, a missing split file or column: a data setting
        raise ConfigError(str(e)) from None


def restore(cfg: config.Config, world: World, s: "Setup", dev: Device, plan: dict) -> None:
    """Trainers load the checkpoint's state (optimizer keys as configured now, said on the
    console); the engines then receive the resumed weights."""
    tr, progress = s.trainer, plan["progress"]
    if tr is not None:
        rng = ckpt.load(Path(plan["path"]), (tr.policy, tr.opt, tr.sched), world.train_group,
                        world.is_root, world.trainer_index, ref=tr.ref, changes=plan["meaning_changes"])
        tr.kl_coef = progress.kl_coef
        if rng is not None:
            set_rng_state(dev, rng)
        trainer.apply_optimizer_config(tr, cfg.train, cfg.run.steps)
        if world.is_root and plan["optimizer_changes"]:
            print("resumed with changed optimizer keys, applied to the restored optimizer and "
                  "schedule: " + "; ".join(f"{k} {a!r} -> {b!r}" for k, a, b in
                                           plan["optimizer_changes"])
                  + f" (learning rate now {tr.sched.get_last_lr()[0]:.3g})", flush=True)
    if cfg.sync.enabled:  # the engines start from the resumed weights
        sync.sync_weights(world, tr and tr.sender, s.receiver, s.engine, progress.version)


# ----------------------------------------------------------------------------- the loop
@dataclass
class Setup:
    """What the loop works with, built once by :func:`set_up`; None where a rank has no use."""
    procs: inputs.Processors            # tokenizer, token ids, image processor (engines = trainer)
    problems: list                 # the training split
    images: dict                   # problem index -> image (the trainer's batches)
    n_skipped: int                 # dataset rows skipped
    eval_set: list | None          # evaluation problems, when run.eval_every > 0
    engine: episode.Engine | None        # generation ranks
    scorer: rewards.RewardRunner | None       # generation ranks: [reward] functions
    eval_scorer: rewards.RewardRunner | None  # generation ranks: [eval] functions
    receiver: sync.Receiver | None    # generation ranks of a world > 1: the sync's receiving end
    trainer: trainer.Trainer | None      # trainer ranks
    model_path: str = ""           # the model folder (a built tiny model's, when one was asked for)
    mixture: data.Mixture | None = None  # the prompt stream (data.sources: a quota of each per step)
    notes: tuple = ()              # start-up lines: what the start decided (train.packing's layout), the engines' warm-up
    eval_skipped: int = 0          # evaluation rows skipped (eval/skipped_rows)
    turns: multiturn.Turns | None = None  # generation ranks of a multi-turn run: what follows a reply


def set_up(cfg: config.Config, world: World, dev: Device, live: failures.Liveness) -> Setup:
    device, ro = rank_device(world, dev), cfg.rollout
    model_path = prepare_model(cfg, world, Path(cfg.run.out_dir))
    manual_seed_all(cfg.run.seed)
    procs = inputs.processors(model_path, cfg.model, cfg.data, cfg.rollout)  # a bad folder: a config error
    problems, n_skipped = load_problems(cfg, "train", procs)
    eval_set, eval_skipped = (load_problems(cfg, cfg.eval.split, procs, cfg.run.eval_size)
                              if cfg.run.eval_every or cfg.eval.before_start else (None, 0))
    full, teacher = trainer.load_checked(world, model_path, cfg)  # rank 0: every weight there, or nothing
    # the trainer's row layout (train.packing's "auto" decided); refused: ConfigError
    layout, notes = microbatches.resolve_layout(cfg.train, procs, model_path, device, ro.env)
    checkpointing, line = trainer.resolve_checkpointing(cfg, world, model_path)  # "auto": the memory plan's
    notes += [pipeline.staging_memory_line(cfg, world, dev, device, model_path), line]  # refused: ConfigError
    engine, turns, warmed = engines.start(cfg, world, dev, device, live, model_path, procs,
                                          problems + (eval_set or []), rollout.sampling(ro))
    channel = None
    if world.own_channel and cfg.sync.enabled:
        live.phase(None, "start: opening the engines' weight channel")
        channel = open_engine_channel(world, dev.comm, engine, ro.tensor_parallel_size, device,
                                         port=cfg.sync.channel_port, timeout_s=cfg.cluster.timeout_s,
                                         verbose=cfg.run.verbose)
    tr = trainer.build(model_path, world, device, cfg, layout, channel, full, teacher,
                       checkpointing) if world.is_trainer else None
    del full, teacher  # the trainers hold their shards now
    receiver = sync.Receiver(world.sync_group, 0, device) if world.is_gen and world.sync_group is not None else None
    scorer, eval_scorer = reward_models.runners(cfg, world, dev, live, (cfg.reward.functions, cfg.eval.functions), tr)
    return Setup(procs, problems, {p.index: p.images for p in problems}, n_skipped, eval_set, engine,
                 scorer, eval_scorer, receiver, tr, model_path,
                 data.Mixture(problems, cfg.data, ro.prompts_per_step, cfg.run.seed), (*notes, warmed),
                 eval_skipped, turns)


def start(cfg: config.Config, world: World, dev: Device, live: failures.Liveness,
          resume: str | None, sources: str) -> tuple[Setup, ckpt.Progress, tracking.Recorder | None] | None:
    """Everything before the first step: where the run starts, the records, the models and
    engines, the resumed state, the start-up summary. None when the run is already finished."""
    out_dir = Path(cfg.run.out_dir)
    plan = ckpt.plan(cfg, world, out_dir, resume)
    progress = plan["progress"]
    if plan["finished"]:
        if world.is_root:
            print(f"run already finished: {plan['path']} holds step {progress.step} of "
                  f"run.steps = {cfg.run.steps}; nothing to do (raise --run.steps to train on, or "
                  f"use another run.out_dir)", flush=True)
        return None
    rec = tracking.Recorder.open(cfg, out_dir, progress.step) if world.is_root else None  # a tracker: Fatal
    s = set_up(cfg, world, dev, live)
    resume_rules.check_base(cfg, world, s.model_path, progress, plan["path"])
    if plan["path"]:
        restore(cfg, world, s, dev, plan)
    if rec:
        roles = [world.role(r) for r in range(world.size)]
        rec.say(tracking.startup_summary(cfg, roles, detect_device().kind, trainer.parameter_counts(s.trainer),
                                         len(s.problems), s.n_skipped, len(s.eval_set or []), plan,
                                         sources))
        if s.eval_skipped:
            rec.say(f"   note: {s.eval_skipped} rows of the {cfg.eval.split} split skipped for "
                    "evaluation (prompts over data.max_prompt_len or bad rows; eval/skipped_rows)")
        epochs = data.epoch_line(len(s.problems), cfg.rollout.prompts_per_step, len(world.trainers),
                                 cfg.run.steps)
        for line in filter(None, (*engines.start_notes(cfg, model.load_config(s.model_path)), *s.notes, epochs)):
            rec.say(f"   {line}")
    if cfg.eval.before_start and progress.step == 0:
        run_eval(cfg, world, s, rec, after=0, version=progress.version)
    return s, progress, rec


def train(cfg: config.Config, world: World, dev: Device, live: failures.Liveness,
          resume: str | None, sources: str) -> int:
    out_dir, t_start = Path(cfg.run.out_dir), time.perf_counter()
    started = start(cfg, world, dev, live, resume, sources)
    if started is None:
        dist.destroy_process_group()
        return 0
    s, progress, rec = started
    first, by_index = progress.step, {p.index: p for p in s.problems}
    gen = pipeline.Generation(s.engine, cfg, world, progress, functools.partial(generate, s, cfg, world))
    dist.barrier(group=world.ctrl)  # start-up skew must not count as step 0's time
    rec and rec.begin()
    for step in range(progress.step, cfg.run.steps):
        t_step = time.perf_counter()
        # 1. rollout on the generation ranks (ahead of time with rollout.max_staleness >= 1)
        live.phase(step, "rollout")
        failures.inject(step, live)  # tests: a rank that dies, hangs or raises here
        local = gen.episodes(step, progress.version) if world.is_gen else ([], {})
        # 2. episodes to every rank (gloo object exchange)
        live.phase(step, "exchange")
        episodes, stats, t_wait = exchange(world, local, progress)
        gen.after_exchange(step, progress.version, live)  # colocated: the engine sleeps
        metrics = {"step": step, "weight_version": min((e.version for e in episodes),
                                                       default=progress.version),
                   "data/skipped": s.n_skipped,
                   **rollout.episode_metrics(episodes, stats, progress.version, s.mixture.names)}
        # 3. train
        live.phase(step, "train")
        trained, advantages = train_phase(cfg, world, s, episodes, progress, step)
        metrics.update(trained)
        # 4. weight sync: trainers -> every engine
        live.phase(step, "sync")
        metrics.update(sync_phase(cfg, world, s, progress, gen.loader()))
        metrics["time/step_s"] = time.perf_counter() - t_step
        metrics["time/trainer_wait_frac"] = t_wait / max(1e-9, metrics["time/step_s"])
        # 5. evaluation, checkpoint, log
        live.phase(step, "eval/checkpoint")
        progress.step = step + 1
        if cfg.run.eval_every and (progress.step % cfg.run.eval_every == 0
                                   or progress.step == cfg.run.steps):
            with gen.paused():
                metrics.update(run_eval(cfg, world, s, rec, progress.step, progress.version))
        if rec:  # the records first: a kill before the commit below re-runs (and re-logs) the step
            rec.step(metrics, episodes, advantages, by_index)
        ckpt.save_progress(cfg, world, s.trainer, s.procs, s.model_path, dev, out_dir, progress)
        if trainer.too_many_skipped(cfg.train, world, progress.skipped_in_row):
            gen.close()
            rec and rec.close(failed=True)
            dist.destroy_process_group()
            return 3
    gen.close()
    dist.barrier(group=world.ctrl)
    if rec:
        rec.say(rec.summary(time.perf_counter() - t_start, cfg.run.steps - first,
                            str(ckpt.latest(out_dir) or "") or None))
        rec.close()
    if s.engine is not None:
        s.engine.shutdown()
        s.turns and s.turns.close()
    dist.destroy_process_group()
    return 0


def generate(s: Setup, cfg: config.Config, world: World, step: int, version: int,
             check: episode.Check | None = None) -> tuple[list[episode.Episode], dict]:
    """This generation rank's share of `step`'s problems, sampled with weight `version` (or as
    `check`, pipeline.Producer's, says), scored."""
    ro, per_gen = cfg.rollout, cfg.rollout.prompts_per_step // len(world.gens)
    mine = s.mixture.step_problems(step)  # the seeded stream (data.sources: a quota of each per step)
    mine = mine[world.gen_index * per_gen:(world.gen_index + 1) * per_gen]
    sampling = rollout.sampling(ro)
    roll = functools.partial(rollout.rollout, s.engine, procs=s.procs, sp=sampling, template=cfg.data.template,
                             scorer=s.scorer, version=check or version, group_offset=0, turns=s.turns)
    return rollout.rollout_refilled(roll, mine, sampling.n,
                                    cfg.run.seed * 1_000_003 + step * 1009 + world.gen_index,
                                    rollout.Refill(s.problems, cfg.loss.drop_zero_variance
                                                   and ro.max_refill_rounds),
                                    group_offset=world.gen_index * per_gen)


def exchange(world: World, local: tuple[list, dict],
             progress: ckpt.Progress) -> tuple[list[episode.Episode], list[dict], float]:
    """Every rank gets every generation rank's episodes (sorted by group) and stats, and the
    seconds it waited for them; running-ahead engines' stream positions go to `progress`."""
    t0, gathered = time.perf_counter(), [None] * world.size
    dist.all_gather_object(gathered, local, group=world.ctrl)
    episodes = sorted((e for eps, _ in gathered for e in eps), key=lambda e: e.group)
    stats = [s for _, s in gathered if s]
    progress.stream = [st["position"] for st in stats if "position" in st]
    return episodes, stats, time.perf_counter() - t0


def train_phase(cfg: config.Config, world: World, s: Setup, episodes: list[episode.Episode],
                progress: ckpt.Progress, step: int) -> tuple[dict[str, float], list[float]]:
    """The rollout step's optimizer steps on the trainer ranks; counts non-finite (skipped) ones.
    Returns the metrics and every episode's advantage (empty on generation-only ranks)."""
    out, adv, t0 = {}, [], time.perf_counter()
    if s.trainer is not None:
        s.trainer.version = progress.version
        out, adv = update.train_step(s.trainer, episodes, s.images, world=world, procs=s.procs, step=step,
                                tc=cfg.train, lc=cfg.loss, rc=cfg.rollout, seed=cfg.run.seed)
        progress.skipped_in_row = progress.skipped_in_row + 1 if out["train/skipped"] else 0
        progress.skipped_total += out["train/skipped"]
        progress.optimizer_steps += round(out["train/updates"] * (1 - out["train/skipped"]))
        progress.kl_coef = s.trainer.kl_coef
        out["train/skipped_steps"] = progress.skipped_total
        out["train/optimizer_steps"] = float(progress.optimizer_steps)
    out["time/train_s"] = time.perf_counter() - t0
    if "train/tokens" in out:
        out["time/train_tokens_per_s"] = out["train/tokens"] / max(1e-9, out["time/train_s"])
    return out, adv


def sync_phase(cfg: config.Config, world: World, s: Setup, progress: ckpt.Progress,
               loader) -> dict[str, float]:
    """Send the new weights to every engine (version + 1; `loader`: the engine, or where a
    running-ahead engine picks them up) and, if asked, verify them bitwise."""
    tr = s.trainer
    out = {"sync/bytes": 0.0}
    t0 = time.perf_counter()
    if cfg.sync.enabled:
        out["sync/bytes"] = float(sync.sync_weights(world, tr and tr.sender, s.receiver, loader,
                                                 progress.version + 1))
        progress.version += 1
    elif world.colocated:
        s.engine.wake_up()
    out["time/sync_s"] = time.perf_counter() - t0
    if cfg.sync.enabled and cfg.sync.verify:
        out["sync/checksum_ok"] = float(sync.verify(world, tr and tr.policy, s.engine, cfg.model.dtype))
    return out


# ----------------------------------------------------------------------------- evaluation
def run_eval(cfg: config.Config, world: World, s: "Setup", rec: tracking.Recorder | None,
             after: int, version: int) -> dict[str, float]:
    """Evaluate after `after` rollout steps; rank 0 records it (eval.jsonl, eval/step_N.jsonl)."""
    metrics, eps = evaluation.evaluate(world, s.engine, s.eval_scorer, s.eval_set, s.procs, cfg, version,
                                       seed=cfg.run.seed * 7919 + after, skipped=s.eval_skipped, turns=s.turns)
    if rec:
        rec.evaluation(after, version, metrics, evaluation.eval_rows(eps, s.eval_set),
                       evaluation.settings(cfg.eval, cfg.rollout))
    return metrics


def evaluate_checkpoint(cfg: config.Config, world: World, dev: Device, live: failures.Liveness,
                        checkpoint: str) -> int:
    """`--eval-only`: the engines evaluate a saved HF export with the [eval] keys; the metrics go
    to eval.jsonl, the generations to eval/<checkpoint folder>.jsonl."""
    out_dir = Path(cfg.run.out_dir)
    hf = Path(checkpoint) / "hf"
    model_path = str(hf if hf.is_dir() else checkpoint)
    manual_seed_all(cfg.run.seed)
    procs = inputs.processors(model_path, cfg.model, cfg.data, cfg.rollout)  # a bad folder: a config error
    eval_set, skipped = load_problems(cfg, cfg.eval.split, procs, cfg.run.eval_size)
    if world.is_root and skipped:
        print(f"note: {skipped} rows of split {cfg.eval.split!r} skipped (prompts over "
              "data.max_prompt_len or bad rows; eval/skipped_rows)", flush=True)
    engine, turns, warmed = engines.start(cfg, world, dev, rank_device(world, dev), live, model_path,
                                          procs, eval_set, evaluation.sampling(cfg.eval, cfg.rollout))
    world.is_root and print(warmed, flush=True)  # (no start-up summary here)
    (scorer,) = reward_models.runners(cfg, world, dev, live, (cfg.eval.functions,))
    step = ckpt.eval_step(checkpoint)  # plain data only, checked at start (ckpt.claim_run_dir)
    m, eps = evaluation.evaluate(world, engine, scorer, eval_set, procs, cfg, version=step,
                                 seed=cfg.run.seed * 7919 + max(step, 0), skipped=skipped, turns=turns)
    if world.is_root:
        print(json.dumps(m))
        path = tracking.write_evaluation(out_dir, step, step, m, evaluation.eval_rows(eps, eval_set),
                                         checkpoint, evaluation.settings(cfg.eval, cfg.rollout))
        print(f"generations: {path}", flush=True)
    if engine is not None:
        engine.shutdown()
        turns and turns.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
