"""rewards/areal_geometry3k.py: AReaL's Geometry3K reward (examples/vlm_npu/geometry3k_grpo.py at
inclusionAI/AReaL 524d1d90f) equals that rule computed here by mathruler's own functions."""
from __future__ import annotations

import itertools
import random
import re
import time

import pytest

import rewards
from errors import ConfigError
from rewards.areal_geometry3k import _format_ok

mathruler_grader = pytest.importorskip("mathruler.grader")

# AReaL 524d1d90f examples/vlm_npu/geometry3k_grpo.py lines 15-33, restated with mathruler's functions
AREAL_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def areal_reward(completion: str, answer: str) -> tuple[float, float, float]:
    fmt = 1.0 if re.fullmatch(AREAL_FORMAT, completion) else 0.0
    acc = 1.0 if mathruler_grader.grade_answer(
        mathruler_grader.extract_boxed_content(completion), answer) else 0.0
    return (1.0 - 0.1) * acc + 0.1 * fmt, acc, fmt


# Geometry3K-style golds, each with answers written the ways a policy writes them (right and wrong)
GOLDS = {
    "5": ["5", "5.0", "x = 5", "6", "5^\\circ"],
    "\\frac { 40 } { 3 }": ["\\frac{40}{3}", "\\dfrac{40}{3}", "13.33", "40/3", "\\frac{80}{6}"],
    "4 \\sqrt { 3 }": ["4\\sqrt{3}", "\\sqrt{48}", "4 \\sqrt 3", "6.93", "4\\sqrt{2}"],
    "10 \\pi": ["10\\pi", "31.4", "10 \\pi", "\\pi \\cdot 10", "20\\pi"],
    "18.8": ["18.8", "18.80", "19", "4\\sqrt{22}", "\\text{18.8}"],
}
# response shapes: @A the answer content, @W a wrong one
SHAPES = [
    "<think>Let me compute.</think> The answer is \\boxed{@A}.",        # boxed outside think
    "<think>So it is \\boxed{@A}.</think> Done.",                      # boxed inside think only
    "<think>First \\boxed{@W}</think> so \\boxed{@A}",              # several boxes, last right
    "<think>r</think> \\boxed{@A} or maybe \\boxed{@W}",            # several boxes, last wrong
    "\\boxed{@A}",                                                     # no think
    "The answer is \\boxed{@A",                                        # unclosed last box
    "<think>x</think> \\boxed{@W} then \\boxed{@A",                 # unclosed after a closed one
    "<think>nested</think> \\boxed{{\\text{@A}}}",                     # nested braces
    "<think>a\n\nb</think>\n\\boxed{@A}\n",                            # newlines
    " <think>lead</think> \\boxed{@A}",                                # not at the very start
    "<think>unclosed think \\boxed{@A}",                               # no </think>
    "</think><think> \\boxed{@A}",                                      # tags in the wrong order
]


def responses() -> list[tuple[str, str]]:
    out = []
    for gold, answers in GOLDS.items():
        wrong = answers[-1]
        for shape, a in itertools.product(SHAPES, answers):
            out.append((shape.replace("@A", a).replace("@W", wrong), gold))
    return out


def test_equals_areals_rule_computed_by_mathruler():
    cases = responses()
    assert len(cases) >= 200
    fn = rewards.get("areal_geometry3k")
    seen = set()
    for text, gold in cases:
        want = areal_reward(text, gold)
        got = fn(text, {"answer": gold})
        assert (got["reward"], got["accuracy"], got["format"]) == pytest.approx(want), (text, gold)
        seen.add(want)
    # the set is not degenerate: every combination of right / wrong and formatted / not occurs
    assert {(a, f) for _, a, f in seen} == {(0.0, 0.0), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0)}


def test_format_check_equals_the_regex_on_random_text():
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "\\boxed{", "}", "{", "x", "\n", " ", "<", "\\boxed", "think>"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 9)))
        assert _format_ok(text) == bool(re.fullmatch(AREAL_FORMAT, text)), text


def test_format_check_is_linear_where_the_regex_backtracks():
    text = "<think>" + "</think>\\boxed{" * 3000  # no closing brace anywhere
    t = time.perf_counter()
    assert not _format_ok(text)
    assert time.perf_counter() - t < 0.05


def test_a_hung_grading_is_killed_and_the_next_call_grades():
    fn = rewards.get("areal_geometry3k")
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="grade_timeout_s"):  # sympy evaluating 9^(9^9)
        fn("\\boxed{9**9**9}", {"answer": "\\frac{1}{3}"}, grade_timeout_s=0.5)
    assert time.monotonic() - t < 0.5 + 5.0
    assert fn("<think>t</think> \\boxed{5}", {"answer": "5"})["reward"] == pytest.approx(1.0)


def test_a_missing_package_is_a_config_error(monkeypatch):
    monkeypatch.setitem(rewards.REQUIRES, "areal_geometry3k", ("mathruler", "no_such_package_x"))
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].name: .*no_such_package_x"):
        rewards.check_functions("reward.functions", [{"name": "areal_geometry3k"}])
