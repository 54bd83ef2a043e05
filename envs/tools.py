"""Tools a model may call in a multi-turn rollout (`rollout.tools`): the registry, the parser of
the calls in a reply, and the runner that executes them (docs/multiturn.md, "Tools").

A tool is a plain Python function registered with ``@tool(name, description, parameters)``
(``parameters``: the JSON schema of its keyword arguments, shown to the model through the chat
template's ``tools`` argument, :func:`schemas`). It returns a string (or anything ``str()``
turns into one); ``raise ToolError(message)`` reports ``message`` to the model as it is. Calls
are read from the decoded reply in Qwen's format, ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`` (:func:`parse_calls`). :class:`ToolRunner` runs each call on the reward
runner's worker threads (rewards._Function: a per-call timeout from the call's own start, a
fixed set of daemon threads per tool); whatever goes wrong becomes a one-line ``error: ...``
tool turn, never an exception of the run.
"""
from __future__ import annotations

import collections
import copy
import inspect
import json
import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

import envs
import rewards
from errors import ConfigError, one_line

log = logging.getLogger("envs.tools")


@dataclass(frozen=True)
class Call:
    """One parsed tool call; `error` non-empty: the call's text could not be read (the model is
    told why)."""
    name: str
    arguments: dict
    error: str = ""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]


class ToolError(Exception):
    """Raised by a tool: its message goes to the model as ``error: <tool>: <message>``."""


TOOLS: dict[str, Tool] = {}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # the function names OpenAI-style schemas allow
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


def tool(name: str, description: str, parameters: dict) -> Callable:
    """Register the decorated function as tool `name` (ValueError for a bad registration: a
    name registered twice, a schema that is not an object's, or properties the function does
    not take as keywords)."""
    def deco(fn: Callable) -> Callable:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"tool name {name!r}: expected 1-64 letters, digits, '_' or '-'")
        if name in TOOLS:
            raise ValueError(f"tool {name!r} registered twice")
        if not isinstance(description, str) or not description.strip():
            raise ValueError(f"tool {name!r}: the description must be a non-empty string")
        _check_schema(name, parameters, fn)
        TOOLS[name] = Tool(name, description, copy.deepcopy(parameters), fn)
        return fn
    return deco


def _check_schema(name: str, parameters: Any, fn: Callable) -> None:
    if not isinstance(parameters, dict) or parameters.get("type") != "object" or not isinstance(
            parameters.get("properties", {}), dict):
        raise ValueError(f"tool {name!r}: parameters must be a JSON schema "
                         '{"type": "object", "properties": {...}, "required": [...]}')
    props, required = parameters.get("properties", {}), parameters.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        raise ValueError(f"tool {name!r}: 'required' must list names of 'properties', got {required!r}")
    sig = inspect.signature(fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.values())
    keywords = {k for k, p in sig.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [k for k in props if not takes_any and k not in keywords]
    unshown = [k for k, p in sig.items() if p.default is p.empty and p.kind in (
        p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and k not in required]
    if missing or unshown:
        raise ValueError(f"tool {name!r}: the schema and {fn.__name__}'s signature disagree "
                         f"(properties it does not take: {missing}; arguments without a default "
                         f"not in 'required': {unshown})")


def check_tools(names: list[str]) -> None:
    """`rollout.tools` names registered tools, each once; ConfigError naming the key otherwise."""
    envs.load()  # every module of envs/ registers its tools on import
    for i, n in enumerate(names):
        if not isinstance(n, str):
            raise ConfigError(f"rollout.tools[{i}]: expected a tool name (a string), got {n!r}")
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ConfigError(f"rollout.tools: unknown tool{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(map(repr, unknown))} (known: {', '.join(sorted(TOOLS)) or 'none'})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"rollout.tools: {', '.join(map(repr, twice))} listed more than once")


def schemas(names: list[str]) -> list[dict]:
    """The chat template's `tools` argument for `names`: OpenAI-style function schemas (copies)."""
    check_tools(names)
    return [{"type": "function", "function": {
        "name": n, "description": TOOLS[n].description,
        "parameters": copy.deepcopy(TOOLS[n].parameters)}} for n in names]


# ============================================================================ parsing
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_GUESS_NAME = re.compile(r'"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"')


def parse_calls(text: str) -> list[Call]:
    """Every ``<tool_call>...</tool_call>`` of a decoded reply, in order ([] when there is none);
    one that cannot be read (not JSON, not an object, no name, arguments not an object, no
    closing tag) is ``Call(name or "", {}, error=why)``."""
    calls, pos = [], 0
    while (start := text.find(_OPEN, pos)) >= 0:
        start += len(_OPEN)
        end, again = text.find(_CLOSE, start), text.find(_OPEN, start)
        if end < 0 or 0 <= again < end:   # unclosed: it runs to the next call or the end
            stop = again if again >= 0 else len(text)
            body = text[start:stop]
            calls.append(Call(_guess(body), {}, error=f"a {_OPEN} without its {_CLOSE}"))
            pos = stop
            continue
        calls.append(_read(text[start:end]))
        pos = end + len(_CLOSE)
    return calls


def _guess(body: str) -> str:
    m = _GUESS_NAME.search(body)
    return m.group(1) if m else ""


def _read(body: str) -> Call:
    """One call's JSON: {"name": str, "arguments": object or a JSON string of one}."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return Call(_guess(body), {}, error=f"not valid JSON ({e.msg} at character {e.pos})")
    except (ValueError, RecursionError) as e:  # nesting deeper than json's parser goes
        return Call(_guess(body), {}, error=f"not valid JSON ({one_line(e)})")
    if not isinstance(obj, dict):
        return Call("", {}, error=f'expected a JSON object {{"name": ..., "arguments": {{...}}}}, '
                                  f"got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return Call("", {}, error='no "name" (a non-empty string)')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as e:
            return Call(name, {}, error=f'"arguments" is a string that is not valid JSON ({one_line(e, 80)})')
    if not isinstance(args, dict):
        return Call(name, {}, error=f'"arguments" must be a JSON object, got {type(args).__name__}')
    return Call(name, args)


# ============================================================================ the runner
class _Worker(rewards._Function):
    """One tool on rewards' worker threads: the same submit / collect / close, so the same
    bounds on a call that never returns (see ToolRunner). Only the function differs: a tool
    is not a registered reward, and it takes its arguments as keywords."""

    def __init__(self, t: Tool, workers: int) -> None:
        # not super().__init__: it looks the name up among the rewards; these are the fields
        # that submit / _work / collect / close use
        self.name, self.params, self.workers, self.batch = t.name, {}, workers, 0
        self.fn = lambda arguments, _sample: str(t.fn(**arguments))  # str() under the timeout too
        self.cond = threading.Condition()
        self.queue: collections.deque = collections.deque()
        self.running: set = set()
        self.threads: list[threading.Thread] = []
        self.closed = False


class ToolRunner:
    """Runs parsed calls of the tools `names`, one at a time or from several threads.

    Each tool has `workers_per_tool` daemon threads (rewards' worker threads), started on its
    first call and never replaced. A call that runs past `timeout_s` from its start is answered
    with an error at once, and its thread stays in the call until the function returns (a Python
    thread cannot be killed): it may run on, holding its thread. When every thread of a tool is
    held so, a new call of it is refused at once rather than queued. So a tool that always
    hangs costs `workers_per_tool` calls of `timeout_s` each and `workers_per_tool` threads, ever.
    """

    def __init__(self, names: list[str], timeout_s: float = 5.0, max_output_chars: int = 10_000,
                 workers_per_tool: int = 4) -> None:
        check_tools(list(names))
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
            raise ValueError(f"tool timeout_s must be a number > 0, got {timeout_s!r}")
        for key, v in (("max_output_chars", max_output_chars), ("workers_per_tool", workers_per_tool)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"tool {key} must be an int >= 1, got {v!r}")
        self.timeout_s, self.max_output_chars = float(timeout_s), max_output_chars
        self._workers = {n: _Worker(TOOLS[n], workers_per_tool) for n in names}
        self._logged: set[tuple[str, str]] = set()

    def run(self, call: Call) -> tuple[str, bool]:
        """(the tool turn's content, ok); never raises: anything that goes wrong is
        (``"error: <tool>: <what>"``, False)."""
        try:
            return self._run(call)
        except Exception as e:  # noqa: BLE001 - a rollout never stops for a tool
            return _error(getattr(call, "name", ""), f"the call failed: {one_line(e)}")

    def _run(self, call: Call) -> tuple[str, bool]:
        if call.error:
            return _error(call.name, f"could not read the tool call: {call.error}")
        w = self._workers.get(call.name)
        if w is None:
            return (f"error: unknown tool {call.name[:64]!r} (available: "
                    f"{', '.join(self._workers)})", False)
        bad = _bad_arguments(TOOLS[call.name], call.arguments)
        if bad:
            return _error(call.name, f"bad arguments: {bad}")
        if w.closed:
            return _error(call.name, "not run: the tool runner is closed")
        pending = w.submit([dict(call.arguments)], [{}])
        outcome = w.collect(pending, self.timeout_s)[0]
        if outcome is rewards._TIMEOUT:
            if pending[0].state == rewards._CANCELLED:
                return self._logged_error(call.name, "busy", (
                    f"not run: each of its {w.workers} thread(s) is still in an earlier call that "
                    f"ran past the {self.timeout_s:g} s timeout"))
            return self._logged_error(call.name, "timeout",
                                      f"timed out: no result within {self.timeout_s:g} s")
        result, exc = outcome  # (result of the call's one response: a list of one, exception)
        result = result[0] if exc is None else None
        if isinstance(exc, ToolError):
            return _error(call.name, one_line(exc, typed=False))
        if exc is not None:
            return self._logged_error(call.name, "raised", f"the tool raised {one_line(exc)}")
        if len(result) > self.max_output_chars:
            return self._logged_error(call.name, "too long", (
                f"the result is {len(result):,} characters, over the limit of "
                f"{self.max_output_chars:,}"))
        return result, True

    def _logged_error(self, name: str, kind: str, what: str) -> tuple[str, bool]:
        """A failure that is the tool's (not the model's): logged once per tool and kind."""
        if (name, kind) not in self._logged:
            self._logged.add((name, kind))
            log.warning(f"tool {name!r}: {what} (the model gets an error turn and the run goes "
                        f"on; counted in rollout/tool_errors; logged once per tool)")
        return _error(name, what)

    def close(self) -> None:
        """Let the idle threads exit; a thread in a hung call exits if the call ever returns."""
        for w in self._workers.values():
            w.close()


def _error(name: str, what: str) -> tuple[str, bool]:
    return (f"error: {name[:64]}: {what}" if name else f"error: {what}"), False


def _bad_arguments(t: Tool, arguments: dict) -> str:
    """Why `arguments` do not fit the tool's schema and signature ("" when they do)."""
    props = t.parameters.get("properties", {})
    for k, v in arguments.items():
        want = props.get(k, {}).get("type") if isinstance(props.get(k), dict) else None
        types = [want] if isinstance(want, str) else want if isinstance(want, list) else []
        allowed = tuple(c for ty in types for c in _JSON_TYPES.get(ty, ()))
        if allowed and (not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed)):
            return f"{k!r} must be of JSON type {' or '.join(types)}, got {type(v).__name__} {str(v)[:40]!r}"
    try:
        inspect.signature(t.fn).bind(**arguments)
    except TypeError as e:
        return one_line(e, 200, typed=False)
    return ""
