"""Environments of multi-turn rollouts, registered by name (`rollout.env`), as rewards/ are.

An environment is a subclass of :class:`Environment`, built once per generation rank from its own
config table (``[rollout.env_args]``: the keys it declares in ``keys``, checked at load) and
called from one thread. Each episode (one sample of a prompt) has a state of its own:

- ``reset(problem, seed) -> (state, prompt)``: the episode's state (any object; the environment
  alone reads it) and the text of the first user message (None: the problem's own, through
  `data.template`). `problem` is the episode's data.Problem; `seed` is the same for the G
  samples of a prompt (they share that prompt: a group faces one task) and differs across a
  step's prompts and across steps.
- ``step(state, conversation) -> (message, reward)``, after each reply the tools did not answer:
  `conversation` is the turns after the prompt (``{"role": "assistant" | "user" | "tool",
  "content": str}``, the last one the model's reply); `message` is the next user message (a
  string, or a ``{"role": "user", "content": ...}`` dict) or None to end the episode; `reward` is
  this reply's reward (a number, or None for none). It is also called after the reply that
  `rollout.max_turns` or the episode's token budget ends the episode on (its message is then
  dropped), so the last move is graded too.

For a VLM a message may show pictures: ``{"role": "user", "content": [{"type": "image"},
{"type": "text", "text": ...}], "images": [PIL images, in order]}``, at most the class's
``images_per_episode`` in one episode (what the engines reserve room for).

The per-turn rewards are kept on the assistant turns (``"reward"``) and make the episode's
environment reward: their sum, or the last one, as the common key ``turn_rewards = "sum" |
"last"`` says (every environment takes it). That reward is the reward part `env`, added to the
reward functions' total; a data.sources entry's own ``env_args`` table overrides the run's keys
for its problems (one instance per such source); an environment that grades (``grades = True``) lets a run configure
no reward function (reward.functions = []). Tool calls (`rollout.tools`, envs.tools) are
answered before the environment is asked. Every module of this package is imported on first use,
so a new environment is a new file here with ``@register("name")`` on its class
(docs/multiturn.md).
"""
from __future__ import annotations

import abc
import importlib
import math
import pkgutil
from types import SimpleNamespace
from typing import Any, Callable

from errors import ConfigError

REGISTRY: dict[str, type] = {}
TURN_REWARDS = ("sum", "last")  # how the per-turn rewards make the episode's (turn_rewards)


class Environment(abc.ABC):
    """The base of every environment: its keys, whether it grades, and defaults for reset; a
    subclass must define :meth:`step` (one without it cannot be built)."""
    keys: dict = {}               # its [rollout.env_args] keys: name -> registry.Key
    grades = False                # True: step returns rewards; a run may have no reward function
    images_per_episode = 0        # the most pictures its messages show in one episode

    def __init__(self, args: SimpleNamespace) -> None:
        self.args = args          # its keys' values (the defaults where not set), and turn_rewards

    def reset(self, problem, seed: int) -> tuple[Any, str | None]:
        return None, None

    @abc.abstractmethod
    def step(self, state, conversation: list[dict]) -> tuple[str | dict | None, float | None]:
        """The environment's answer to the conversation's last reply: (message | None, reward | None)."""


def register(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        if name in REGISTRY:
            raise ValueError(f"environment {name!r} registered twice")
        if not issubclass(cls, Environment):
            raise ValueError(f"environment {name!r}: {cls.__name__} must subclass envs.Environment")
        REGISTRY[name] = cls
        return cls
    return deco


def load() -> None:
    """Import every module of the package (each registers its environments and tools)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def names() -> list[str]:
    load()
    return sorted(REGISTRY)


def check(env: str, tools: list, args: dict) -> None:
    """`rollout.env` names a registered environment ("" = none), `rollout.env_args` its keys (each
    declared, of its type and range; the defaults filled in, in place), `rollout.tools`
    registered tools; ConfigError naming the key otherwise."""
    if env and env not in names():
        raise ConfigError(f"rollout.env: unknown environment {env!r} (known: {', '.join(names())})")
    _check_args(env, args, fill=True)
    if tools:  # envs.tools loads the package (its tools register on import)
        from envs import tools as T
        T.check_tools(list(tools))


def _check_args(env: str, args: dict, where: str = "rollout.env_args", fill: bool = False) -> None:
    """`args` (the table at `where`) holds keys of environment `env`, each of its type and range
    (converted in place); `fill`: the defaults of the others added. ConfigError naming the key."""
    import config as C
    if not isinstance(args, dict):
        raise ConfigError(f"{where}: expected a table of the environment's keys, got {args!r}")
    if args and not env:
        raise ConfigError(f"{where} ({', '.join(args)}) set without rollout.env")
    if not env:
        return
    keys = REGISTRY[env].keys
    for k, v in list(args.items()):
        if k == "turn_rewards":
            if v not in TURN_REWARDS:
                raise ConfigError(f"{where}.turn_rewards: unknown {v!r} (known: {', '.join(TURN_REWARDS)})")
            continue
        if k not in keys:
            raise ConfigError(f"{where}.{k}: not a key of environment {env!r} (known: "
                              f"{', '.join([*keys, 'turn_rewards'])})")
        args[k] = C.check_value(f"{where}.{k}", v, keys[k].default, keys[k].rule)
    for k, key in keys.items() if fill else ():
        args.setdefault(k, key.default)
    if fill:
        args.setdefault("turn_rewards", "sum")


def check_sources(env: str, sources: list) -> None:
    """Each data.sources entry's own `env_args` (its keys over `[rollout.env_args]`' for its
    problems): keys of environment `env`; ConfigError naming the key otherwise."""
    for i, e in enumerate(sources):
        if isinstance(e, dict) and "env_args" in e:
            _check_args(env, e["env_args"], f"data.sources[{i}].env_args")


def schemas(tools: list) -> tuple:
    """The chat template's `tools` argument for `rollout.tools` (() for none)."""
    if not tools:
        return ()
    from envs import tools as T
    return tuple(T.schemas(list(tools)))


def extra_images(name: str) -> int:
    """The most images environment `name` adds to one episode (0 for none, or no environment)."""
    return int(getattr(REGISTRY[name], "images_per_episode", 0)) if name and name in names() else 0


def grades(name: str) -> bool:
    """Whether environment `name` returns rewards (False for none, or no environment)."""
    return bool(name) and name in names() and bool(REGISTRY[name].grades)


def get(name: str, args: dict | None = None) -> Environment:
    """A new instance of environment `name` with its keys `args` (checked; defaults for the rest)."""
    load()
    args = dict(args or {})
    _check_args(name, args, fill=True)
    return REGISTRY[name](SimpleNamespace(**args))


def episode_reward(rewards: list[float], how: str) -> float | None:
    """The episode's environment reward from its per-turn ones (None when there is none)."""
    if not rewards:
        return None
    return sum(rewards) if how == "sum" else rewards[-1]


def turn_reward(env: str, value: Any) -> float:
    """A step's reward as a finite float; ValueError naming the environment otherwise."""
    try:
        r = float(value)
    except (TypeError, ValueError):
        r = math.nan
    if not math.isfinite(r):
        raise ValueError(f"environment {env!r}: step returned the reward {value!r} (expected a finite number or None)")
    return r


@register("recheck")
class Recheck(Environment):
    """The smallest two-turn environment: after the first reply the user says "Check your
    answer." once; the second reply is the one graded (by the reward functions)."""
    message = "Check your answer."

    def step(self, state, conversation: list[dict]) -> tuple[str | None, None]:
        replies = sum(t["role"] == "assistant" for t in conversation)
        return (self.message if replies == 1 else None), None


@register("recheck_all")
class RecheckAll(Recheck):
    """"Check your answer." after every reply: the episode runs to `rollout.max_turns` (long
    multi-turn batches; docs/multiturn.md)."""

    def step(self, state, conversation: list[dict]) -> tuple[str, None]:
        return self.message, None
