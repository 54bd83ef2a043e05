"""The tool layer of multi-turn rollouts (envs.tools, envs.calculator): Qwen's <tool_call> JSON
parsed from a reply, the schemas the chat template gets, `rollout.tools` checked, the calculator,
and the runner: a tool that hangs, raises, returns 10 MB or is called badly gives an error turn
(ok False) and the runner goes on."""
from __future__ import annotations

import threading
import time

import pytest

from envs import calculator as C
from envs import tools as T
from errors import ConfigError

RELEASE = threading.Event()  # lets the hung test tool's threads finish when the module is done


@pytest.fixture(scope="module", autouse=True)
def test_tools():
    """Test-only tools, registered for this module and removed after it."""
    none = {"type": "object", "properties": {}}

    @T.tool("_t_sleep", "sleeps", {"type": "object", "properties": {"s": {"type": "number"}},
                                   "required": ["s"]})
    def sleep(s):
        RELEASE.wait(s)
        return f"slept {s}"

    @T.tool("_t_raise", "raises", none)
    def boom():
        raise RuntimeError("boom\nwith a second line")

    @T.tool("_t_big", "returns 10 MB", none)
    def big():
        return "x" * 10_000_000

    @T.tool("_t_int", "returns an int", none)
    def seven():
        return 7

    yield
    RELEASE.set()
    for name in ("_t_sleep", "_t_raise", "_t_big", "_t_int"):
        T.TOOLS.pop(name)


def _calc(expression: str) -> T.Call:
    return T.Call("calculator", {"expression": expression})


# ----------------------------------------------------------------------------- parsing
def test_parse_one_call():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "sqrt(3**2 + 4**2)"}}\n</tool_call>')
    assert T.parse_calls(text) == [_calc("sqrt(3**2 + 4**2)")]


def test_parse_several_calls_in_order_and_json_string_arguments():
    text = ('a <tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'
            '</tool_call> b\n<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>'
            '<tool_call>{"name": "noargs"}</tool_call>')
    assert T.parse_calls(text) == [_calc("1+1"), T.Call("other", {}), T.Call("noargs", {})]


def test_parse_no_call():
    assert T.parse_calls("The answer is 5.") == []
    assert T.parse_calls("") == []
    assert T.parse_calls("a stray </tool_call> closes nothing") == []


@pytest.mark.parametrize("body, name, why", [
    ('{"name": "calculator", "arguments": {"expression": }', "calculator", "not valid JSON"),
    ('{"arguments": {"expression": "1"}}', "", 'no "name"'),
    ('{"name": "", "arguments": {}}', "", 'no "name"'),
    ('[1, 2]', "", "expected a JSON object"),
    ('{"name": "calculator", "arguments": 3}', "calculator", '"arguments" must be a JSON object'),
    ('{"name": "calculator", "arguments": "{oops"}', "calculator", "not valid JSON"),
    ('[' * 100_000, "", "not valid JSON"),   # deeper than json's parser goes: no exception
])
def test_parse_malformed_calls_carry_an_error(body, name, why):
    (call,) = T.parse_calls(f"<tool_call>\n{body}\n</tool_call>")
    assert (call.name, call.arguments) == (name, {}) and why in call.error, call


def test_parse_an_unclosed_call_is_an_error_and_the_next_is_still_read():
    calls = T.parse_calls('<tool_call>{"name": "calculator", "arguments": {}}\n'
                          '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert calls[0].name == "calculator" and "without its </tool_call>" in calls[0].error
    assert calls[1] == T.Call("b", {})


# ----------------------------------------------------------------------------- registry
def test_schemas_shape_and_copies():
    (s,) = T.schemas(["calculator"])
    assert s["type"] == "function" and set(s["function"]) == {"name", "description", "parameters"}
    assert s["function"]["name"] == "calculator" and "radians" in s["function"]["description"]
    assert s["function"]["parameters"] == {
        "type": "object", "required": ["expression"],
        "properties": {"expression": {"type": "string", "description": "e.g. sqrt(3**2 + 4**2) or 180 - 2*35"}}}
    s["function"]["parameters"]["required"].append("x")   # the caller's copy, not the registry
    assert T.TOOLS["calculator"].parameters["required"] == ["expression"]
    assert [x["function"]["name"] for x in T.schemas(["_t_int", "calculator"])] == ["_t_int", "calculator"]


def test_check_tools_names_the_key_the_unknown_and_the_known():
    T.check_tools(["calculator"])
    with pytest.raises(ConfigError) as e:
        T.check_tools(["calculator", "abacus", "slide_rule"])
    msg = str(e.value)
    assert msg.startswith("rollout.tools:") and "'abacus', 'slide_rule'" in msg and "calculator" in msg.split("known:")[1]
    with pytest.raises(ConfigError, match=r"rollout.tools: 'calculator' listed more than once"):
        T.check_tools(["calculator", "calculator"])
    with pytest.raises(ConfigError, match=r"rollout.tools\[1\]: expected a tool name"):
        T.check_tools(["calculator", 3])
    with pytest.raises(ConfigError, match="rollout.tools: unknown tool 'nope'"):
        T.ToolRunner(["nope"])


def test_registration_mistakes_are_refused():
    obj = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    with pytest.raises(ValueError, match="registered twice"):
        T.tool("calculator", "again", obj)(lambda x: x)
    with pytest.raises(ValueError, match="JSON schema"):
        T.tool("_t_bad", "d", {"type": "string"})(lambda x: x)
    with pytest.raises(ValueError, match="disagree"):
        T.tool("_t_bad", "d", obj)(lambda y: y)           # x is not an argument of the function
    with pytest.raises(ValueError, match="disagree"):
        T.tool("_t_bad", "d", {"type": "object", "properties": {"x": {}}})(lambda x: x)  # x not required
    with pytest.raises(ValueError, match="letters, digits"):
        T.tool("has space", "d", obj)(lambda x: x)
    assert "_t_bad" not in T.TOOLS


# ----------------------------------------------------------------------------- the calculator
@pytest.mark.parametrize("expression, value", [
    ("sqrt(3**2 + 4**2)", "5"), ("180 - 2*35", "110"), ("0.5*8*6*sin(radians(30))", "12"),
    ("degrees(atan(1))", "45"), ("1/3", "0.3333333333"), ("2**-1", "0.5"), ("-(2 + 3) * 4", "-20"),
    ("7 // 2 + 7 % 3", "4"), ("log(8, 2)", "3"), ("exp(0) + log(e)", "2"), ("round(pi, 3)", "3.142"),
    ("abs(-2.5) + max(1, 2) - min(3, 4)", "1.5"), ("cos(radians(60)) * 10", "5"),
    ("acos(0.5) * 180 / pi", "60"), ("tan(radians(45))", "1"),
    ("2**1000 // 2**999", "2"), ("0.1 + 0.2", "0.3"), ("-0.0", "0"),
])
def test_calculator_examples(expression, value):
    assert C.evaluate(expression) == value
    assert C.calculator(expression=expression) == value


@pytest.mark.parametrize("expression, why", [
    ("x + 1", "unknown name 'x'"), ("__import__('os').system('true')", "is not a known function"),
    ("__import__('os')", "'__import__' is not a known function"),
    ("().__class__", "attributes"), ("open('f')", "not a known function"),
    ("'a' * 3", "'a' is not a number"), ("sqrt", "is a function"), ("2^3", "write a**b"),
    ("9**9**9", "power is too large"), ("10**400", "power is too large"), ("2.0**5000", "too large"),
    ("2**1024 - 1 + 0.5", "over 1024 bits"), ("1" * 400, "over 1024 bits"), ("1e308 * 10", "not a finite"),
    ("1/0", "division by zero"), ("log(0)", "log: math domain error"), ("exp(1000)", "too large"),
    ("(-8)**(1/3)", "not a real number"), ("round(10, -10**9)", "round(x, n)"), ("1 < 2", "comparisons"),
    ("[1, 2]", "not allowed"), ("lambda: 1", "not allowed: lambda"), ("abs(x=1)", "plain arguments"),
    ("sin(1, 2)", "sin:"), ("min()", "min:"), ("1 +", "not an arithmetic expression"), ("", "empty"),
    ("1" * 501, "over the limit of 500"), ("-" * 300 + "1", "nested more than"), ("1j", "not a number"),
])
def test_calculator_refusals_are_tool_errors(expression, why):
    t = time.thread_time()  # this thread's CPU time: what the refusal costs, not the machine's load
    with pytest.raises(T.ToolError) as e:
        C.evaluate(expression)
    assert why in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert time.thread_time() - t < 0.5      # refused before any large work (9**9**9 would take hours)


def test_calculator_refusals_reach_the_model_as_error_turns():
    runner = T.ToolRunner(["calculator"])
    try:
        assert runner.run(_calc("__import__('os')"))[1] is False
        content, ok = runner.run(_calc("9**9**9"))
        assert not ok and content.startswith("error: calculator: the power is too large")
        assert runner.run(_calc("sqrt(3**2 + 4**2)")) == ("5", True)
    finally:
        runner.close()


# ----------------------------------------------------------------------------- the runner
@pytest.fixture
def runner():
    r = T.ToolRunner(["calculator", "_t_sleep", "_t_raise", "_t_big", "_t_int"], timeout_s=0.5)
    yield r
    r.close()


def _still_works(runner: T.ToolRunner) -> None:
    assert runner.run(_calc("180 - 2*35")) == ("110", True)


def test_a_tool_that_sleeps_past_its_timeout_is_an_error_soon_after_it(runner):
    t = time.monotonic()
    content, ok = runner.run(T.Call("_t_sleep", {"s": 120}))
    took = time.monotonic() - t
    assert not ok and content == "error: _t_sleep: timed out: no result within 0.5 s", content
    # at least the timeout (counted from the call's start in its thread), and far from the tool's
    # 120 s: the bound leaves a loaded machine 20 s
    assert 0.5 - 1e-6 <= took < 0.5 + 20, took
    _still_works(runner)
    assert runner.run(T.Call("_t_sleep", {"s": 0})) == ("slept 0", True)  # a spare thread


@pytest.mark.parametrize("call, expected", [
    (T.Call("_t_raise", {}), "error: _t_raise: the tool raised RuntimeError: boom with a second line"),
    (T.Call("_t_big", {}), "error: _t_big: the result is 10,000,000 characters, over the limit of 10,000"),
    (T.Call("abacus", {}), "error: unknown tool 'abacus' (available: calculator, _t_sleep, _t_raise, _t_big, _t_int)"),
    (T.Call("calculator", {}), "error: calculator: bad arguments: missing a required argument: 'expression'"),
    (T.Call("calculator", {"expression": "1", "x": 2}),
     "error: calculator: bad arguments: got an unexpected keyword argument 'x'"),
    (T.Call("calculator", {"expression": 12}),
     "error: calculator: bad arguments: 'expression' must be of JSON type string, got int '12'"),
    (T.Call("calculator", {}, error="not valid JSON (Expecting value at character 3)"),
     "error: calculator: could not read the tool call: not valid JSON (Expecting value at character 3)"),
    (T.Call("", {}, error='no "name" (a non-empty string)'),
     'error: could not read the tool call: no "name" (a non-empty string)'),
    (T.Call("calculator", None), "error: calculator: the call failed: AttributeError"),
])
def test_failures_are_one_line_error_turns_and_the_runner_goes_on(runner, call, expected):
    content, ok = runner.run(call)
    assert ok is False and content.startswith(expected) and "\n" not in content, content
    _still_works(runner)


def test_a_result_is_str_of_what_the_tool_returns(runner):
    assert runner.run(T.Call("_t_int", {})) == ("7", True)


def test_hung_calls_hold_a_bounded_set_of_threads_and_then_are_refused_at_once():
    r = T.ToolRunner(["_t_sleep", "calculator"], timeout_s=0.2, workers_per_tool=2)
    try:
        before = threading.active_count()
        for _ in range(2):
            assert "timed out" in r.run(T.Call("_t_sleep", {"s": 30}))[0]
        cond, waits = r._workers["_t_sleep"].cond, []
        cond.wait = lambda *a, _wait=cond.wait: waits.append(a) or _wait(*a)  # counts the runner's waits
        for _ in range(20):   # both threads are in hung calls: no new thread, no wait
            content, ok = r.run(T.Call("_t_sleep", {"s": 0}))
            assert not ok and "not run: each of its 2 thread(s) is still in an earlier call" in content
        assert waits == []    # each refused before any wait (not after a timeout of its own)
        assert threading.active_count() <= before + 2
        assert r.run(_calc("1+1")) == ("2", True)   # other tools have threads of their own
    finally:
        r.close()


def test_after_close_a_call_is_an_error_not_an_exception():
    r = T.ToolRunner(["calculator"])
    assert r.run(_calc("2*3")) == ("6", True)
    r.close()
    content, ok = r.run(_calc("2*3"))
    assert not ok and content == "error: calculator: not run: the tool runner is closed"


def test_runner_arguments_are_checked():
    with pytest.raises(ValueError, match="timeout_s"):
        T.ToolRunner(["calculator"], timeout_s=0)
    with pytest.raises(ValueError, match="max_output_chars"):
        T.ToolRunner(["calculator"], max_output_chars=0)
