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


def check(rc, tc) -> None:
    """`[rollout]`'s names: a known engine, environment and tools; an environment that shows
    images needs one row per episode (`[train]` tc); ConfigError naming the key."""
    engine_class(rc.engine)
    envs.check(rc.env, rc.tools)
    if envs.extra_images(rc.env) and (tc.share_prompt or tc.packing not in (False, "auto")):
        raise ConfigError(f"rollout.env={rc.env} shows images in its turns: they need one row per "
                          "episode (train.share_prompt = false, train.packing = false)")


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
