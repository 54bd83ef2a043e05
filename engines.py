"""Which inference engine a run uses (`[rollout] engine`): hf_engine.HFEngine or
vllm_engine.VLLMEngine, both episode.Engine; imported on demand (vLLM only where used). Its
start on a generation rank, with the run's turn rule (multiturn.Turns)."""
from __future__ import annotations

import importlib

import envs
import failures
import multiturn
from errors import ConfigError

ENGINES = {"hf": "hf_engine.HFEngine", "vllm": "vllm_engine.VLLMEngine"}


def engine_class(name: str) -> type:
    """The engine class for `[rollout] engine`; a ConfigError for a name that is none of ENGINES."""
    if name not in ENGINES:
        raise ConfigError(f"rollout.engine must be {' or '.join(map(repr, ENGINES))}, got {name!r}")
    module, _, cls = ENGINES[name].rpartition(".")
    return getattr(importlib.import_module(module), cls)


def check(cfg) -> None:
    """The engines' rules over the run's config, at load: a known engine, environment and tools;
    an environment that shows images needs one row per episode; what running ahead, tensor
    parallelism and vLLM need of the other sections. ConfigError naming the key."""
    ro, tc, lo = cfg.rollout, cfg.train, cfg.loss

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)
    engine_class(ro.engine)
    envs.check(ro.env, ro.tools)
    need(not envs.extra_images(ro.env) or not (tc.share_prompt or tc.packing not in (False, "auto")),
         f"rollout.env={ro.env} shows images in its turns: they need one row per episode "
         "(train.share_prompt = false, train.packing = false)")
    need(not ro.max_staleness or lo.tis_cap > 0 or lo.correction != "none",
         f"rollout.max_staleness={ro.max_staleness} needs a loss.correction (or loss.tis_cap > 0) "
         f"between the trainers' and the engines' logprobs for the stale samples")
    need(not ro.partial or ro.max_staleness >= 1, "rollout.partial needs rollout.max_staleness >= 1 "
         "(synchronous engines never hold a batch across a weight update)")
    need(not (ro.max_staleness and cfg.sync.verify and ro.engine == "hf"),
         "sync.verify needs rollout.max_staleness = 0: an engine running ahead loads new weights at "
         "its own check points, not at the sync")
    need(ro.tensor_parallel_size == 1 or ro.engine == "vllm",
         "rollout.tensor_parallel_size > 1 needs rollout.engine = 'vllm' (the hf engine runs on "
         "one device)")
    need(not (cfg.cluster.colocate and ro.engine == "vllm"),
         "cluster.colocate with rollout.engine = 'vllm' is not built yet (its sleep/wake and "
         "in-process weight load; docs/colocate.md): use rollout.engine = 'hf'")
    if ro.engine == "vllm":
        _check_vllm(cfg, need)


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
          problems: list) -> tuple:
    """A generation rank's engine and turn rule (None elsewhere; the engine sized for the most
    images one of `problems` holds); then every rank waits until every engine has started, for
    `rollout.start_timeout_s`: vLLM's start-up outlasts any collective timeout."""
    engine = turns = None
    if world.is_gen:
        live.phase(None, f"start: starting the {cfg.rollout.engine} engine")
        failures.inject_start(cfg.cluster.timeout_s)
        engine = build_engine(cfg, model_path, procs, dev=dev, device=device,
                              seed=cfg.run.seed + world.gen_index,
                              max_images=max((len(p.images) for p in problems), default=0))
        turns = multiturn.turns(cfg.rollout, procs)  # None for single-turn episodes
    live.phase(None, "start: waiting for every engine to start")
    failures.start_barrier(live, cfg.rollout.start_timeout_s, "rollout.start_timeout_s")
    live.phase(None, "start-up")
    return engine, turns
