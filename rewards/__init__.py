"""Reward functions, registered by name, and the runner that calls them.

A reward function is plain Python, no torch: ``fn(response: str, sample: dict, **params) ->
dict[str, float]``. ``sample`` carries the gold answer (``"answer"``), the problem text
(``"problem"``), the dataset index (``"index"``) and the response length in tokens
(``"response_len"``), ``"truncated"``, ``"max_new_tokens"``, the problem's ``data.sources``
name (``"source"``; "" for the one ``data.source``) and every other column of the dataset's row
(``"columns"``: name -> value; the synthetic sets have none); each call gets its own shallow copy.
The returned dict MUST contain ``"reward"`` (this function's total); every other
key is a part that is logged as ``reward/<part>`` (finite numbers), except ``"info"``: a mapping of
what the function wants to record beside the score (strings, numbers, booleans), kept in the
samples and evaluation records, never summed, averaged or given pass@n. A function
is called from worker threads, several calls at once, so it must be thread-safe.
:class:`RewardRunner` sums the configured ones (docs/data.md, "Reward functions").
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Any, Callable, Mapping

from errors import ConfigError, one_line

log = logging.getLogger("rewards")

RewardFn = Callable[..., dict[str, float]]
REGISTRY: dict[str, RewardFn] = {}
REQUIRES: dict[str, tuple[str, ...]] = {}  # name -> packages it imports when first called


def register(name: str, requires: tuple[str, ...] = ()) -> Callable[[RewardFn], RewardFn]:
    """`requires`: packages the function imports lazily (checked at config load, not imported)."""
    def deco(fn: RewardFn) -> RewardFn:
        if name in REGISTRY:
            raise ValueError(f"reward {name!r} registered twice")
        REGISTRY[name] = fn
        REQUIRES[name] = tuple(requires)
        return fn
    return deco


def get(name: str) -> RewardFn:
    _load_builtin()
    if name not in REGISTRY:
        raise KeyError(f"unknown reward {name!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[name]


def check_functions(key: str, specs: list, models: Mapping[str, str] | tuple[str, ...] = ()) -> None:
    """`reward.functions` / `eval.functions` (`key`) name registered reward functions or the
    run's reward models (`models`: the `[[reward.models]]` entries' names, or name -> role),
    which take no params beside the weight; a `role = "trainer"` model grades training only
    (`reward.functions`: the generation ranks evaluate, and a source's list grades both)."""
    import importlib.util
    for i, spec in enumerate(specs):
        if spec["name"] in models:
            extra = sorted(set(spec) - {"name", "weight"})
            if extra:
                raise ConfigError(f"{key}[{i}]: reward model {spec['name']!r} takes only a weight, "
                                  f"got {', '.join(extra)} (its settings are in its [[reward.models]] entry)")
            if isinstance(models, Mapping) and models[spec["name"]] == "trainer" and key != "reward.functions":
                raise ConfigError(f"{key}[{i}]: reward model {spec['name']!r} has role = 'trainer': it "
                                  "scores training steps only; name it in reward.functions alone, or "
                                  "give it role = 'generation' (docs/reward_models.md)")
            continue
        if spec["name"] not in names():
            raise ConfigError(f"{key}[{i}].name: unknown reward {spec['name']!r} "
                              f"(known: {names() + sorted(models)})")
        missing = [p for p in REQUIRES[spec["name"]] if importlib.util.find_spec(p) is None]
        if missing:
            raise ConfigError(f"{key}[{i}].name: reward {spec['name']!r} needs "
                              f"{', '.join(missing)} (pinned in requirements.txt): not installed")


def names() -> list[str]:
    _load_builtin()
    return sorted(REGISTRY)


def _load_builtin() -> None:
    # every module of this package registers its functions on import (after `register` exists)
    import importlib
    import pkgutil
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


# ============================================================================ the runner
# timeout_s is per call, from the call's own start, not per step (docs/data.md says why)
_PENDING, _RUNNING, _DONE, _CANCELLED = range(4)
_TIMEOUT = object()  # the outcome of a call that ran past timeout_s or could not start


class _Call:
    """One call of one reward function: on one response, or on a batch of them for a batched
    function (a reward model); changed only under its function's lock."""
    __slots__ = ("responses", "samples", "state", "start", "result", "error")

    def __init__(self, responses: list[str], samples: list[dict[str, Any]]) -> None:
        self.responses, self.samples = responses, samples
        self.state, self.start = _PENDING, 0.0
        self.result: Any = None
        self.error: BaseException | None = None


class _Function:
    """One configured reward function: its `workers` daemon threads (started once, never
    replaced: a hung function holds at most that many, ever) and its state across steps.
    `batched`: a reward model (reward_models.py): ``fn(responses, samples) -> [result, ...]``,
    called on up to ``fn.batch_size`` responses at once from one thread (one device); an
    exception in a sample's place of its list is that sample's failure."""

    def __init__(self, spec: dict[str, Any], workers: int, batched: Callable | None = None) -> None:
        self.name: str = spec["name"]
        self.fn = batched or get(self.name)
        self.batch = batched.batch_size if batched else 0  # 0: one response per call
        self.params = {k: v for k, v in spec.items() if k not in ("name", "weight")}
        self.workers = 1 if batched else workers
        self.cond = threading.Condition()
        self.queue: collections.deque[_Call] = collections.deque()
        self.running: set[_Call] = set()   # calls in a worker now, this step's or older ones
        self.threads: list[threading.Thread] = []
        self.closed = False
        self.timeouts_in_row = 0
        self.disabled = False
        self.failure_logged = False
        self.timeout_logged = False

    def submit(self, responses: list[str], samples: list[dict[str, Any]]) -> list[_Call]:
        copies = [dict(s) for s in samples]
        size = self.batch or 1
        calls = [_Call(responses[i:i + size], copies[i:i + size]) for i in range(0, len(copies), size)]
        with self.cond:
            if self.closed:
                raise RuntimeError(f"reward {self.name!r}: called after its runner was closed")
            self.queue.extend(calls)
            while len(self.threads) < self.workers:
                t = threading.Thread(target=self._work, daemon=True,
                                     name=f"reward-{self.name}-{len(self.threads)}")
                t.start()
                self.threads.append(t)
            self.cond.notify_all()
        return calls

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if not self.queue:
                    return
                call = self.queue.popleft()
                if call.state != _PENDING:
                    continue
                call.state, call.start = _RUNNING, time.monotonic()
                self.running.add(call)
                self.cond.notify_all()
            try:
                result, error = (self.fn(call.responses, call.samples, **self.params) if self.batch
                                 else [self.fn(call.responses[0], call.samples[0], **self.params)]), None
            except BaseException as e:  # noqa: BLE001 - user code: reported by the runner
                result, error = None, e
            with self.cond:
                call.result, call.error, call.state = result, error, _DONE
                self.running.discard(call)
                self.cond.notify_all()

    def collect(self, calls: list[_Call], timeout_s: float) -> list[Any]:
        """Wait until each call is done or has run timeout_s; each call's (result, error) or
        _TIMEOUT. Queued calls are given up when every worker holds an overdue call."""
        with self.cond:
            while True:
                now = time.monotonic()
                wake, queued = math.inf, False
                for c in calls:
                    if c.state == _RUNNING and c.start + timeout_s > now:
                        wake = min(wake, c.start + timeout_s)
                    elif c.state == _PENDING:
                        queued = True
                if queued and len(self.running) >= self.workers and all(
                        c.start + timeout_s <= now for c in self.running):
                    for c in calls:
                        if c.state == _PENDING:
                            c.state = _CANCELLED
                    self.queue = collections.deque(c for c in self.queue if c.state == _PENDING)
                    queued = False
                if wake == math.inf and not queued:
                    return [(c.result, c.error) if c.state == _DONE else _TIMEOUT for c in calls]
                # woken early by any start or end of a call
                self.cond.wait(min(wake - now, timeout_s))

    def close(self) -> None:
        """Let idle workers exit; a worker in a hung call exits if the call ever returns."""
        with self.cond:
            self.closed = True
            self.queue.clear()
            self.cond.notify_all()


class RewardRunner:
    """Scores a step's responses with the configured reward functions; lives for the whole run.

    ``functions`` is a list of ``{"name": str, "weight": float, **params}``; each gets
    ``workers_per_function`` threads of its own. ``sources`` (data.sources' own
    ``reward_functions``: source name -> such a list): a sample whose ``"source"`` is there is
    graded by that list alone, any other by ``functions`` (a function configured alike, same name
    and params, in several lists runs once per sample, on the same threads). A call that runs
    past ``timeout_s`` (from its
    own start), raises, or returns anything but a dict of finite numbers with a ``"reward"``
    scores 0 and counts in ``errors`` (the first of each function logged); one that times out
    ``max_consecutive_timeouts`` times in a row (0: never) is switched off for the runner's
    life, scoring 0 and one error per sample. The rules in full: docs/data.md. ``models``: the
    reward models loaded at start (reward_models.load: entry name -> a batched scorer), each
    named in the lists like a function and called on a batch of responses at a time (timeout_s
    per batch).
    """

    def __init__(self, functions: list[dict[str, Any]], timeout_s: float,
                 max_consecutive_timeouts: int = 3, workers_per_function: int = 4,
                 sources: dict[str, list[dict[str, Any]]] | None = None,
                 models: dict[str, Callable] | None = None) -> None:
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
            raise ValueError(f"reward timeout_s must be a number > 0, got {timeout_s!r}")
        if not isinstance(max_consecutive_timeouts, int) or max_consecutive_timeouts < 0:
            raise ValueError("reward max_consecutive_timeouts must be an int >= 0 (0: never switch "
                             f"a function off), got {max_consecutive_timeouts!r}")
        if not isinstance(workers_per_function, int) or workers_per_function < 1:
            raise ValueError(f"workers_per_function must be an int >= 1, got {workers_per_function!r}")
        lists = {None: functions, **(sources or {})}  # None: every sample without a list of its own
        for where, specs in lists.items():
            for i, spec in enumerate(specs):
                if not isinstance(spec, dict) or "name" not in spec:
                    raise ValueError(f"reward function {i}{f' of source {where}' if where else ''}: "
                                     f"expected a dict with a 'name', got {spec!r}")
        self.timeout_s = float(timeout_s)
        self.max_consecutive_timeouts = max_consecutive_timeouts
        self._fns: list[_Function] = []
        self._models = dict(models or {})
        # each list as (function, weight) in its configured order (the order the total is summed in)
        self._lists = {where: self._functions(specs, workers_per_function)
                       for where, specs in lists.items()}
        self._lock = threading.Lock()   # one step at a time: the counts follow sample order

    def _functions(self, specs: list[dict[str, Any]], workers: int) -> list[tuple[_Function, float]]:
        """`specs` as (function, weight): a function configured alike (name, params) in a list
        built before is shared; one listed twice in `specs` is two functions, as configured."""
        out: list[tuple[_Function, float]] = []
        for spec in specs:
            params = {k: v for k, v in spec.items() if k not in ("name", "weight")}
            f = next((f for f in self._fns if f.name == spec["name"] and f.params == params
                      and all(f is not g for g, _ in out)), None)
            if f is None:
                f = _Function(spec, workers, self._models.get(spec["name"]))
                self._fns.append(f)
            out.append((f, float(spec.get("weight", 1.0))))
        return out

    @property
    def switched_off(self) -> list[str]:
        """Names of the functions switched off after timing out too often, in config order."""
        return [f.name for f in self._fns if f.disabled]

    def score(self, responses: list[str], samples: list[dict[str, Any]]) -> list[dict[str, float]]:
        """One dict per response, in order: ``{"reward": total, <part>: value, ..., "errors": n}``
        and ``"info"`` (the functions' info mappings merged) when one returned any.

        The total is the weighted sum of the functions' rewards, in the order they are
        configured; parts of several functions with the same name add up.
        """
        if len(responses) != len(samples):
            raise ValueError(f"{len(responses)} responses for {len(samples)} samples")
        with self._lock:
            return self._score(responses, samples)

    def _score(self, responses: list[str], samples: list[dict[str, Any]]) -> list[dict[str, float]]:
        lists = [self._lists.get(s.get("source"), self._lists[None]) for s in samples]
        mine = {id(f): [i for i, fs in enumerate(lists) if any(g is f for g, _ in fs)]
                for f in self._fns}  # the samples each function grades, in sample order
        calls = {id(f): f.submit([responses[i] for i in mine[id(f)]], [samples[i] for i in mine[id(f)]])
                 for f in self._fns if not f.disabled and mine[id(f)]}
        judged = {id(f): dict(zip(mine[id(f)], self._judge(f, calls[id(f)],
                                                         f.collect(calls[id(f)], self.timeout_s))))
                  for f in self._fns if id(f) in calls}
        out = []
        for i in range(len(responses)):
            d: dict = {"reward": 0.0, "errors": 0.0}
            info: dict = {}
            for f, weight in lists[i]:
                res = judged.get(id(f), {}).get(i)
                if res is None:
                    d["errors"] += 1
                    continue
                total, parts, more = res
                d["reward"] += weight * total
                for k, v in parts:
                    d[k] = d.get(k, 0.0) + v
                info.update(more)
            if info:
                d["info"] = info
            out.append(d)
        return out

    def _judge(self, f: _Function, calls: list[_Call], outcomes: list[Any]
               ) -> list[tuple[float, list[tuple[str, float]], dict] | None]:
        """Validate each call's outcome (a batch's: each of its results), in sample order; update
        f's timeout count (a timed-out batch counts once), log firsts."""
        judged: list[tuple[float, list[tuple[str, float]], dict] | None] = []
        for call, o in zip(calls, outcomes):
            sample = call.samples[0]
            if o is _TIMEOUT:
                judged.extend([None] * len(call.samples))
                if f.disabled:
                    continue
                f.timeouts_in_row += 1
                if not f.timeout_logged:
                    f.timeout_logged = True
                    log.warning(f"reward {f.name!r}: a call ran past timeout_s={self.timeout_s:g} s "
                                f"({_where(sample)}); it scores 0 and counts in reward/errors "
                                "(logged once per function)")
                n = self.max_consecutive_timeouts
                if n and f.timeouts_in_row >= n:
                    f.disabled = True
                    f.close()
                    log.warning(f"reward {f.name!r} timed out {n} times in a row "
                                f"(timeout_s={self.timeout_s:g} s): switched off for the rest of "
                                "the run; it now scores 0 and counts an error for every sample")
                continue
            if not f.disabled:
                f.timeouts_in_row = 0
            results, error = o
            if error is None and (not isinstance(results, list) or len(results) != len(call.samples)):
                error = TypeError(f"returned {type(results).__name__} for a batch of "
                                  f"{len(call.samples)}, expected a list of as many results")
            for sample, result in zip(call.samples, results if error is None else [None] * len(call.samples)):
                bad = result if error is None and isinstance(result, Exception) else error
                if bad is None:  # a batched function's exception in a sample's place: that sample failed
                    try:
                        judged.append(_check(result))
                        continue
                    except Exception as e:  # noqa: BLE001 - a user object's __float__ may raise anything
                        bad = e
                judged.append(None)
                if not f.failure_logged:
                    f.failure_logged = True
                    log.warning(f"reward {f.name!r} failed ({_where(sample)}): {one_line(bad)} "
                                "(first failure, logged once per function; each one scores 0 and "
                                "counts in reward/errors)")
        return judged

    def close(self) -> None:
        """Let the idle worker threads exit (they are daemons: not needed before exit)."""
        with self._lock:
            for f in self._fns:
                f.close()


def _check(result: Any) -> tuple[float, list[tuple[str, float]], dict]:
    """(reward, [(part, value), ...], info) of a valid result, else TypeError / ValueError
    saying why."""
    if not isinstance(result, dict):
        raise TypeError(f"returned {type(result).__name__}, expected a dict with a 'reward'")
    if "reward" not in result:
        raise ValueError(f"returned no 'reward' (keys: {list(result)[:8]})")
    info = result.get("info", {})
    if not isinstance(info, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool)))
            for k, v in info.items()):
        raise TypeError(f"'info' is {info!r:.60}, expected a mapping of names to strings, "
                        "numbers or booleans")
    return _number("reward", result["reward"]), [
        (k, _number(k, v)) for k, v in result.items() if k not in ("reward", "info")], dict(info)


def _number(key: Any, v: Any) -> float:
    if not isinstance(key, str):
        raise TypeError(f"returned the key {key!r} ({type(key).__name__}), expected str")
    if isinstance(v, (str, bytes, bytearray)):
        raise TypeError(f"{key!r} is {v!r:.40}, expected a number")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{key!r} is a {type(v).__name__}, expected a number") from None
    if not math.isfinite(x):
        raise ValueError(f"{key!r} is {x}, not finite")
    return x


def _where(sample: dict[str, Any]) -> str:
    return f"dataset index {sample['index']}" if "index" in sample else "a sample without index"


_RUNNERS: dict[tuple[str, float], RewardRunner] = {}
_RUNNERS_LOCK = threading.Lock()


def score(response: str, sample: dict[str, Any], functions: list[dict[str, Any]],
          timeout_s: float = 5.0) -> dict[str, float]:
    """One response scored as by :meth:`RewardRunner.score`, for one-off use and tests; one
    runner per distinct ``(functions, timeout_s)`` is kept for the process's life."""
    key = (repr(functions), float(timeout_s))
    with _RUNNERS_LOCK:
        runner = _RUNNERS.get(key)
        if runner is None:
            runner = _RUNNERS[key] = RewardRunner(functions, timeout_s)
    return runner.score([response], [sample])[0]
