"""Environments of multi-turn rollouts, registered by name (`rollout.env`), as rewards/ are.

An environment is a class with ``step(problem, conversation) -> message | None``: `problem` is
the episode's data.Problem (its text, gold answer, columns), `conversation` the turns after the
prompt so far (``{"role": "assistant" | "user" | "tool", "content": str}``, the last one the
model's reply); it returns the next user message (a string, or a ``{"role": "user", "content":
...}`` dict) or None to end the episode; for a VLM a message may show pictures: ``{"role":
"user", "content": [{"type": "image"}, {"type": "text", "text": ...}], "images": [PIL images, in
order]}``, at most the class's ``images_per_episode`` in one episode (what the engines reserve
room for). An environment may also grade the whole conversation: ``reward(problem,
conversation) -> float``, logged as the reward part `env` and added to the reward functions'
total. It is built once per generation rank (``cls()``) and called from one thread. The last reply is graded by the reward functions.
Tool calls (`rollout.tools`, envs.tools) are answered before the environment is asked. Every
module of this package is imported on first use, so a new environment is a new file here with
``@register("name")`` on its class (docs/multiturn.md).
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable

from errors import ConfigError

REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        if name in REGISTRY:
            raise ValueError(f"environment {name!r} registered twice")
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


def check(env: str, tools: list) -> None:
    """`rollout.env` names a registered environment ("" = none), `rollout.tools` registered
    tools; ConfigError naming the key otherwise."""
    if env and env not in names():
        raise ConfigError(f"rollout.env: unknown environment {env!r} (known: {', '.join(names())})")
    if tools:
        load()
        from envs import tools as T
        T.check_tools(list(tools))


def schemas(tools: list) -> tuple:
    """The chat template's `tools` argument for `rollout.tools` (() for none)."""
    if not tools:
        return ()
    load()
    from envs import tools as T
    return tuple(T.schemas(list(tools)))


def extra_images(name: str) -> int:
    """The most images environment `name` adds to one episode (0 for none, or no environment)."""
    return int(getattr(REGISTRY[name], "images_per_episode", 0)) if name and name in names() else 0


def get(name: str) -> Any:
    """A new instance of environment `name`."""
    load()
    return REGISTRY[name]()


@register("recheck")
class Recheck:
    """The smallest two-turn environment: after the first reply the user says "Check your
    answer." once; the second reply is the one graded."""
    message = "Check your answer."

    def step(self, problem, conversation: list[dict]) -> str | None:
        replies = sum(t["role"] == "assistant" for t in conversation)
        return self.message if replies == 1 else None


@register("recheck_all")
class RecheckAll(Recheck):
    """"Check your answer." after every reply: the episode runs to `rollout.max_turns` (long
    multi-turn batches; docs/multiturn.md)."""

    def step(self, problem, conversation: list[dict]) -> str | None:
        return self.message
