"""Reward functions, registered by name.

A reward function is plain Python, no torch: ``fn(response: str, sample: dict, **params) ->
dict[str, float]``. ``sample`` carries the gold answer (``"answer"``), the dataset index
(``"index"``) and the response length in tokens (``"response_len"``), ``"truncated"`` and
``"max_new_tokens"``. The returned dict MUST contain ``"reward"`` (this function's total); every
other key is a part that is logged as ``reward/<part>``.

The configured rewards (``[reward] functions``) are summed with their weights by
:func:`score`, which also turns a raising or hanging reward function into reward 0 and an error
count, so one bad sample never stops a run.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Callable

RewardFn = Callable[..., dict[str, float]]
REGISTRY: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        if name in REGISTRY:
            raise ValueError(f"reward {name!r} registered twice")
        REGISTRY[name] = fn
        return fn
    return deco


def get(name: str) -> RewardFn:
    _load_builtin()
    if name not in REGISTRY:
        raise KeyError(f"unknown reward {name!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[name]


def names() -> list[str]:
    _load_builtin()
    return sorted(REGISTRY)


def _load_builtin() -> None:
    # Every module in this package registers its functions on import; imported here, not at
    # module top, so that `register` exists before they use it. A fork adds a reward by adding
    # a file.
    import importlib
    import pkgutil
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


_POOL: cf.ThreadPoolExecutor | None = None


def score(response: str, sample: dict[str, Any], functions: list[dict[str, Any]],
          timeout_s: float = 5.0) -> dict[str, float]:
    """Weighted sum of the configured reward functions for one response.

    ``functions`` is a list of ``{"name": str, "weight": float, **params}``. Returns
    ``{"reward": total, <part>: value, ..., "errors": n}``. A function that raises, returns
    something without ``"reward"``, or runs past ``timeout_s`` contributes 0 and counts as an
    error (a thread cannot be killed, so a runaway function keeps one pool thread busy; the
    geometry verifier bounds its own work, so this is the last line of defence).
    """
    global _POOL
    if _POOL is None:
        _POOL = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")
    out: dict[str, float] = {"reward": 0.0, "errors": 0.0}
    for spec in functions:
        params = {k: v for k, v in spec.items() if k not in ("name", "weight")}
        fn = get(spec["name"])
        try:
            parts = _POOL.submit(fn, response, sample, **params).result(timeout=timeout_s)
            total = float(parts["reward"])
        except Exception:  # noqa: BLE001 - any failure of user code is counted, never raised
            out["errors"] += 1
            continue
        out["reward"] += float(spec.get("weight", 1.0)) * total
        for k, v in parts.items():
            if k != "reward":
                out[k] = out.get(k, 0.0) + float(v)
    return out
