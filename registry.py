"""Objectives and response filters by name, each with its own `[loss]` keys.

A part is one function registered (:func:`objective`, :func:`response_filter`) with its keys
beside it, in loss.py or a `loss.plugins` module; the config accepts its keys unchecked and
:func:`check` checks each against its owner. Example and rules: docs/loss.md.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

import config as C
import correction
from errors import ConfigError, one_line

NEEDS = ("logprobs", "ref_logprobs")  # what a filter may need beyond the episodes themselves


class Key(NamedTuple):
    """One `[loss]` key of a part: its default (its type is the key's type) and range rule (as
    config.num's: "> 0", "[0, 1)"; None: any value of that type)."""
    default: Any
    rule: str | None = None


@dataclass(frozen=True)
class Part:
    kind: str                            # "objective" | "filter"
    name: str
    fn: Callable
    keys: dict[str, Key] = field(default_factory=dict)
    check: Callable[[Any], str | None] | None = None  # p -> "key must ..." or None
    needs: tuple[str, ...] = ()          # filters: of NEEDS

    def params(self, lc: Any = None, over: dict | None = None) -> SimpleNamespace:
        """This part's keys: `over` > the `[loss]` section `lc` > the defaults."""
        over = over or {}
        return SimpleNamespace(**{k: over[k] if k in over else getattr(lc, k, key.default)
                                  for k, key in self.keys.items()})


OBJECTIVES: dict[str, Part] = {}
FILTERS: dict[str, Part] = {}


def _register(table: dict, part: Part) -> None:
    if part.name in table:
        raise ValueError(f"{part.kind} {part.name!r} registered twice")
    table[part.name] = part


def objective(name: str, keys: dict[str, Key] | None = None,
              check: Callable | None = None) -> Callable:
    """Register ``fn(logprobs, old_logprobs, advantages, mask, p) -> loss.Term`` as `loss.objective
    = name`; `p` holds its `keys` (attribute access)."""
    def add(fn: Callable) -> Callable:
        _register(OBJECTIVES, Part("objective", name, fn, dict(keys or {}), check))
        return fn
    return add


def response_filter(name: str, keys: dict[str, Key] | None = None, needs: tuple = (),
                    check: Callable | None = None) -> Callable:
    """Register ``fn(r, p) -> BoolTensor[N]`` (True: keep) for `loss.filters`. `r`: every response
    of the step, `rewards`, `truncated`, `lengths`, `groups` [N], `engine_logprobs` (a list of
    [T_i]), plus what `needs` asks for ("logprobs": the proximal policy's, "ref_logprobs")."""
    bad = sorted(set(needs) - set(NEEDS))
    if bad:
        raise ValueError(f"filter {name!r}: unknown needs {bad} (known: {', '.join(NEEDS)})")

    def add(fn: Callable) -> Callable:
        _register(FILTERS, Part("filter", name, fn, dict(keys or {}), check, tuple(needs)))
        return fn
    return add


def load_plugins(names: list) -> None:
    """Import each `loss.plugins` entry once (a module name, or a path to a .py file)."""
    for name in names:
        try:
            if str(name).endswith(".py"):
                path = Path(name).expanduser().resolve()
                mod = f"grpo_plugin_{path.stem}"
                if getattr(sys.modules.get(mod), "__file__", None) != str(path):
                    spec = importlib.util.spec_from_file_location(mod, path)
                    module = importlib.util.module_from_spec(spec)
                    sys.modules[mod] = module
                    spec.loader.exec_module(module)
            else:
                if "" not in sys.path and str(Path.cwd()) not in sys.path:
                    sys.path.append(str(Path.cwd()))
                importlib.import_module(name)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure of the user's module: one line
            sys.modules.pop(f"grpo_plugin_{Path(str(name)).stem}", None)
            # sys.exit(n) at import would otherwise end the run with the project's own exit code
            # for n (3: non-finite steps) and no word: named here as the plugin's
            why = (f"it called sys.exit({e.code!r}) at import" if isinstance(e, SystemExit)
                   else one_line(e))
            raise ConfigError(f"loss.plugins: cannot import {name!r} ({why})") from None


def selected(lc) -> list[Part]:
    """The parts `[loss]` (lc) turns on: its objective, then its filters in order."""
    return [OBJECTIVES[lc.objective], *(FILTERS[f] for f in lc.filters)]


def check(lc) -> None:
    """Load `lc.plugins`, check the correction keys (correction.check) and the part names, then
    every part key set in `[loss]` against its owner (type, range, its cross-key check), filling
    in the selected parts' defaults."""
    load_plugins(lc.plugins)
    correction.check(lc)  # loss.correction and its bounds (correction.py)
    if lc.objective not in OBJECTIVES:
        raise ConfigError(f"loss.objective: unknown {lc.objective!r} (known: "
                          f"{', '.join(OBJECTIVES)})")
    for i, f in enumerate(lc.filters):
        if f not in FILTERS:
            raise ConfigError(f"loss.filters[{i}]: unknown filter {f!r} (known: "
                              f"{', '.join(FILTERS) or 'none registered'})")
    parts = selected(lc)
    mine = {k: (p, key) for p in parts for k, key in p.keys.items()}
    for k, value in list(lc.params.items()):
        if k not in mine:
            owners = [f"{p.kind} {p.name!r}" for p in (*OBJECTIVES.values(), *FILTERS.values())
                      if k in p.keys]
            if not owners:
                raise ConfigError(f"unknown config key loss.{k}")
            raise ConfigError(f"loss.{k}: a key of {', '.join(owners)}, not of the selected "
                              f"{' and '.join(f'{p.kind} {p.name!r}' for p in parts)} (remove it)")
        lc.params[k] = C.check_value(f"loss.{k}", value, mine[k][1].default, mine[k][1].rule)
    for k, (_, key) in mine.items():
        lc.params.setdefault(k, key.default)
    for p in parts:
        if "ref_logprobs" in p.needs and not lc.kl_coef > 0:
            raise ConfigError(f"loss.filters: {p.name!r} needs the reference's logprobs, which "
                              "exist with loss.kl_coef > 0")
        problem = p.check(p.params(lc)) if p.check else None
        if problem:
            raise ConfigError(f"loss.{problem}")
