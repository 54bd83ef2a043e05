"""Which inference engine a run uses (`[rollout] engine`): hf_engine.HFEngine or
vllm_engine.VLLMEngine, both episode.Engine; imported on demand (vLLM only where used). Its
start on a generation rank, with the run's turn rule (multiturn.Turns) and one warm-up request
before step 1 (:func:`warm_up`)."""
from __future__ import annotations

import dataclasses
import importlib
import time

import torch.distributed as dist

import correction
import envs
import failures
import multiturn
import rollout
from episode import Engine, Prompt, Sampling
from errors import ConfigError

ENGINES = {"hf": "hf_engine.HFEngine", "vllm": "vllm_engine.VLLMEngine"}


def engine_class(name: str) -> type:
    """The engine class for `[rollout] engine`; a ConfigError for a name that is none of ENGINES."""
    if name not in ENGINES:
        raise ConfigError(f"rollout.engine must be {' or '.join(map(repr, ENGINES))}, got {name!r}")
    module, _, cls = ENGINES[name].rpartition(".")
    return getattr(importlib.import_module(module), cls)


def start_notes(cfg, config) -> list[str]:
    """The start-up summary's lines on the engines: what the engine decided from the model's
    `config` (vLLM: prefix caching) and a correction that cannot work running ahead."""
    return [engine_class(cfg.rollout.engine).start_note(cfg.rollout, config),
            correction.ahead_note(cfg.loss, cfg.rollout.max_staleness)]


def check(cfg) -> None:
    """The engines' rules over the run's config, at load: a known engine, environment and tools;
    an environment that shows images needs one row per episode; what running ahead, tensor
    parallelism and vLLM need of the other sections. ConfigError naming the key."""
    ro, tc, lo = cfg.rollout, cfg.train, cfg.loss

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)
    engine_class(ro.engine)
    envs.check(ro.env, ro.tools, ro.env_args)
    envs.check_sources(ro.env, cfg.data.sources)  # a source's own env_args
    _check_rewarded(cfg, need)
    need(not envs.extra_images(ro.env) or not (tc.share_prompt or tc.packing not in (False, "auto")),
         f"rollout.env={ro.env} shows images in its turns: they need one row per episode "
         "(train.share_prompt = false, train.packing = false)")
    need(not ro.max_staleness or lo.tis_cap > 0 or lo.correction != "none",
         f"rollout.max_staleness={ro.max_staleness} needs a loss.correction (or loss.tis_cap > 0) "
         f"between the trainers' and the engines' logprobs for the stale samples")
    need(not ro.partial or ro.max_staleness >= 1, "rollout.partial needs rollout.max_staleness >= 1 "
         "(synchronous engines never hold a batch across a weight update)")
    need(ro.batches_in_flight == 1 or (ro.partial and ro.batches_in_flight <= ro.max_staleness + 1),
         f"rollout.batches_in_flight={ro.batches_in_flight} needs rollout.partial and at most "
         "rollout.max_staleness + 1 (more batches than the staleness bound lets start)")
    need(ro.batches_in_flight == 1 or engine_class(ro.engine).STEPS_SHARED,
         f"rollout.batches_in_flight={ro.batches_in_flight} needs an engine that shares its decode "
         f"steps among batches (rollout.engine = 'vllm'); the {ro.engine} engine generates one at a time")
    need(not (ro.max_staleness and cfg.sync.verify and ro.engine == "hf"),
         "sync.verify needs rollout.max_staleness = 0: an engine running ahead loads new weights at "
         "its own check points, not at the sync")
    need(ro.tensor_parallel_size == 1 or ro.engine == "vllm",
         "rollout.tensor_parallel_size > 1 needs rollout.engine = 'vllm' (the hf engine runs on "
         "one device)")
    need(not (cfg.cluster.colocate and ro.tensor_parallel_size > 1),
         "rollout.tensor_parallel_size > 1 with cluster.colocate is not built yet (the ranks of "
         "one engine would have to sample the same rows; docs/colocate.md): set 1")
    if ro.engine == "vllm":
        _check_vllm(cfg, need)


def _check_rewarded(cfg, need) -> None:
    """Each reward-function list (training, evaluation, a source's own) holds a function, or the
    environment grades (envs.grades), or reward.functions is empty for reward-free distillation."""
    own = [(f"data.sources[{i}].reward_functions", e["reward_functions"])
           for i, e in enumerate(cfg.data.sources) if isinstance(e, dict) and "reward_functions" in e]
    env = cfg.rollout.env
    for key, specs in (("reward.functions", cfg.reward.functions), ("eval.functions", cfg.eval.functions), *own):
        need(specs != [] or envs.grades(env) or (key == "reward.functions" and cfg.loss.distill_coef > 0),
             f"{key}: at least one reward function is needed"
             + (f" (rollout.env = {env!r} gives no reward)" if env else ""))


def _check_vllm(cfg, need) -> None:
    """:func:`check`'s rules for the vLLM engine."""
    ro = cfg.rollout
    need(ro.top_p == 1.0 and ro.top_k == 0,
         "rollout.top_p/top_k: the vllm engine reports logprobs after top-p/top-k truncation, "
         "which the trainer does not reproduce; keep top_p = 1 and top_k = 0")
    need(not cfg.sync.verify, "sync.verify compares weights bitwise and needs rollout.engine = "
         "'hf' (vLLM repacks weights); logprob_diff/max checks the vLLM path every step")
    need(not cfg.model.moe_routing_replay or (ro.max_staleness <= 1 and not ro.partial and ro.stale == "wait"),
         "model.moe_routing_replay with vLLM running ahead (max_staleness > 1, partial or drop): its "
         "stepped path returns no routing yet; use rollout.engine = 'hf' or k <= 1")
    room = ro.max_model_len - cfg.data.max_prompt_len
    need(not (ro.env or ro.tools) or multiturn.episode_budget(ro) <= room,
         f"multi-turn with vLLM: the episode's token budget ({multiturn.episode_budget(ro)}: "
         f"rollout.max_episode_tokens, or derived from rollout.max_turns when 0) must be at most "
         f"rollout.max_model_len - data.max_prompt_len ({room}): a continued conversation is a "
         "prompt vLLM must hold")


def build_engine(cfg, path: str, procs, *, dev, device, seed: int, max_images: int = 1):
    """This generation rank's engine (episode.Engine), from the run's config (`[rollout]`,
    `[model]`, cluster.timeout_s, run.verbose); `max_images`: the most images one prompt holds."""
    max_images += envs.extra_images(cfg.rollout.env)  # pictures an environment shows in its turns
    return engine_class(cfg.rollout.engine).from_config(cfg, path, procs, dev=dev, device=device,
                                                        seed=seed, max_images=max_images)


def start(cfg, world, dev, device, live: failures.Liveness, model_path: str, procs,
          problems: list, sp: Sampling) -> tuple:
    """A generation rank's engine and turn rule (None elsewhere; the engine sized for the most
    images one of `problems` holds), warmed up with one request of the run's sampling `sp`
    (:func:`warm_up`); then every rank waits until every engine has started, for
    `rollout.start_timeout_s`: vLLM's start-up, and a first request that compiles operators,
    outlast any collective timeout. Returns (engine, turns, the warm-up's start-up line)."""
    engine = turns = seconds = None
    # the warm-up's prompt, built as the run's are: the first of `problems` with an image (a
    # vision model then runs its vision tower too), else the first
    prompt = rollout.engine_prompts([next((p for p in problems if p.images), problems[0])], procs,
                                    cfg.data.template)[0]
    short = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, WARM_UP_TOKENS))
    if world.is_gen:
        live.phase(None, f"start: starting the {cfg.rollout.engine} engine")
        failures.inject_start(cfg.cluster.timeout_s)
        engine = build_engine(cfg, model_path, procs, dev=dev, device=device,
                              seed=cfg.run.seed + world.gen_index,
                              max_images=max((len(p.images) for p in problems), default=0))
        own = {e["name"]: e["env_args"] for e in cfg.data.sources if "env_args" in e}  # a source's env keys
        turns = multiturn.turns(cfg.rollout, procs, own)  # None for single-turn episodes
        live.phase(None, "start: the engine's warm-up request")
        seconds = warm_up(engine, short, prompt, seed=cfg.run.seed)
    live.phase(None, "start: waiting for every engine to start")
    failures.start_barrier(live, cfg.rollout.start_timeout_s, "rollout.start_timeout_s")
    live.phase(None, "start-up")
    return engine, turns, warm_up_line(world, seconds, short, prompt)


WARM_UP_TOKENS = 4  # new tokens of the warm-up request: its prefill and a few decode steps


def warm_up(engine: Engine, sp: Sampling, prompt: Prompt, seed: int) -> float:
    """One short request (`sp`: the run's sampling, its samples per prompt, temperature, top_p,
    top_k, greedy, for at most WARM_UP_TOKENS new tokens) through the engine's own `generate`
    before step 1 (or an --eval-only evaluation): what a first request costs once (operators
    compiled on an NPU, vLLM's first scheduling and buffers, lazy allocations) is paid here, so
    step 1's time is the step's.
    Nothing of it reaches a metric or a random stream of the run: an engine seeds each call's
    samples from its `seed` alone (hf_engine: a forked generator; vLLM: per-request seeds).
    Returns its seconds."""
    t0 = time.perf_counter()
    engine.generate([prompt], sp, seed)
    return time.perf_counter() - t0


def warm_up_line(world, seconds: float | None, sp: Sampling, prompt: Prompt) -> str:
    """The start-up line of the engines' warm-up (`seconds`: this rank's, None on a rank without
    an engine): the slowest engine's time, gathered over every rank (world.ctrl)."""
    times = [seconds]
    if world.size > 1:
        times = [None] * world.size
        dist.all_gather_object(times, seconds, group=world.ctrl)
    times = [t for t in times if t is not None]
    n_images = len(prompt[1])
    how = ("greedy" if sp.greedy else
           f"{sp.n} samples at temperature {sp.temperature:g}, top_p {sp.top_p:g}, top_k {sp.top_k}")
    return (f"engine warm-up: {max(times):.2f} s (one request: a prompt "
            f"with {n_images} image{'' if n_images == 1 else 's'}, {how}, {sp.max_new_tokens} new "
            f"tokens; the slowest of {len(times)} engine{'' if len(times) == 1 else 's'})")
