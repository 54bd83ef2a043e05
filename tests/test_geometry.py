"""The Geometry3K verifier (rewards/geometry.py): the case set, hand-checked rules, bounds on work,
the reward."""
from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
import time
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.verifier import load_cases  # the one reader of the case file
from rewards import REGISTRY
from rewards.geometry import extract_answer, format_ok, geometry_reward, is_correct

CASES_PATH = Path(__file__).resolve().parent / "data/verifier_cases.jsonl"
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared/data/geometry3k-text"
BOUND_S = 0.05


CASES = load_cases(CASES_PATH)


def W(answer: str) -> str:
    return f"<think>Some reasoning with 3, 4 and 5.</think>\n<answer>{answer}</answer>"


# --------------------------------------------------------------------------------------------
# The case set
# --------------------------------------------------------------------------------------------

def test_case_set_covers_every_rule_both_ways():
    by_rule: dict[str, set[bool]] = defaultdict(set)
    for c in CASES:
        by_rule[c["rule"]].add(c["expected"])
    assert len(CASES) >= 2000
    assert len(by_rule) >= 60
    both = sum(1 for v in by_rule.values() if v == {True, False})
    assert sum(c["expected"] for c in CASES) > 1000 and sum(not c["expected"] for c in CASES) > 1000
    assert both >= 6  # rules whose verdict depends on the value (tolerance, rounding)
    for rule in ("hedge", "multiple_choice", "answer_in_think_only", "reasoning_only",
                 "unterminated_answer", "power_tower", "deep_frac", "unbalanced_braces",
                 "unclosed_tags", "long_garbage", "unicode", "unreduced", "mixed_number",
                 "decimal_2_vs_exact", "decimal_gold_rounds_to", "text_gold", "ratio", "units",
                 "degrees", "dataset_spacing", "dfrac", "tfrac", "plain_slash_sqrt"):
        assert rule in by_rule, rule


def test_case_set_verdicts():
    wrong = defaultdict(list)
    for c in CASES:
        if is_correct(c["response"], c["gold"]) != c["expected"]:
            wrong[c["rule"]].append((c["id"], c["gold"], c["response"][-120:]))
    assert not wrong, {k: v[:3] for k, v in wrong.items()}


@pytest.mark.skipif(not SHARED_DATA.exists(), reason="shared/ data folder not beside the repo")
def test_case_set_is_reproducible_from_the_data():
    import importlib.util
    pytest.importorskip("sympy")
    spec = importlib.util.spec_from_file_location(
        "make_verifier_cases", CASES_PATH.parent / "make_verifier_cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    committed = [json.loads(line) for line in CASES_PATH.read_text().splitlines()]
    assert mod.build(SHARED_DATA) == committed


# --------------------------------------------------------------------------------------------
# Which answer counts
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("<think>x = 3</think><answer>15</answer>", "15"),
    ("<think>a</think> <answer> \\boxed{\\frac{40}{3}} </answer>", "\\frac{40}{3}"),
    ("<think>a</think><answer>The answer is $\\boxed{6}$.</answer>", "6"),
    ("<think><answer>1</answer></think><answer>2</answer>", "2"),
    ("reasoning</think>\n<answer>7</answer>", "7"),             # prompt-prefilled <think>
    ("<answer>8</answer>", "8"),                                  # no think tag at all
    ("<think>a</think> so \\boxed{3}.\nNo: \\boxed{4}", "4"),     # last box, own line
    ("<think>a</think> \\boxed{\\boxed{5}}", "5"),
    ("<think>a</think> \\boxed{\\frac{1}{\\sqrt{3}}}", "\\frac{1}{\\sqrt{3}}"),
    ("<think>a</think> The answer is 12.", "12"),
    ("work\n**Answer:** $9$", "$9$"),
    ("work\nThe final answer is:\n\n$9$\n", "$9$"),
    ("<think>a</think><answer>3</answer><answer>3</answer>", "3"),
])
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize("response", [
    "<think>the answer is 15 <answer>15</answer></think>",       # only inside <think>
    "<think>x = 15, so 15",                                      # unterminated <think>
    "<think>a</think><answer>15",                                # unterminated <answer>
    "<think>a</think>15</answer>",                               # unopened </answer>
    "<think>a</think><answer>  </answer> \\boxed{15}",            # empty tag: no fallback
    "<think>a</think><answer>1</answer><answer>2</answer>",      # blocks disagree
    "<think>a</think> \\boxed{60} or \\boxed{120}",              # two boxes on one line
    "<think>a</think> \\boxed{3}\n then \\boxed{4",              # unterminated last box
    "We find x = 15 and y = 20.",                                # reasoning only
    "<think>a</think>",
    "",
])
def test_extract_answer_none(response):
    assert extract_answer(response) is None


@pytest.mark.parametrize("response, ok", [
    ("<think>r</think><answer>1</answer>", True),
    ("  \n<think>\nr\n</think>\n\n<answer>\n1\n</answer>\n ", True),
    ("<think>r</think><answer>1</answer> trailing", False),
    ("lead <think>r</think><answer>1</answer>", False),
    ("<think>r</think> text <answer>1</answer>", False),
    ("<think> </think><answer>1</answer>", False),
    ("<think>r</think><answer> </answer>", False),
    ("<think>r</think><answer>1</answer><answer>1</answer>", False),
    ("<think>r<think>r</think><answer>1</answer>", False),
    ("<answer>1</answer><think>r</think>", False),
    ("<think>r</think>", False),
    ("<think>r</think>\\boxed{1}", False),
])
def test_format_ok(response, ok):
    assert format_ok(response) is ok


# --------------------------------------------------------------------------------------------
# Equality and tolerance, hand-computed
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("answer, gold, ok", [
    ("\\sqrt{72}", "6 \\sqrt 2", True),                  # 72 = 36 * 2
    ("\\sqrt{1323}", "21 \\sqrt { 3 }", True),           # 441 * 3
    ("80/6", "\\frac { 40 } { 3 }", True),
    ("13 \\frac{1}{3}", "\\frac { 40 } { 3 }", True),    # mixed number
    ("4\\frac{4}{11}", "\\frac{48}{11}", True),
    ("\\frac{48}{11}", "4 \\frac { 4 } { 11 }", True),
    ("\\frac{5\\pi}{3}", "\\frac { 5 } { 3 } \\pi", True),
    ("√3/3", "\\frac { 1 } { \\sqrt { 3 } }", True),     # rationalised
    ("sqrt(2) - 1", "\\frac{1}{1+\\sqrt{2}}", True),      # conjugate
    ("6\\sqrt3 + 38 + 6\\sqrt2", "38 + 6 \\sqrt { 2 } + 6 \\sqrt { 3 }", True),
    ("38 + 6\\sqrt2 + 6\\sqrt5", "38 + 6 \\sqrt { 2 } + 6 \\sqrt { 3 }", False),
    ("3", "21 \\sqrt { 3 }", False),                      # math-verify's misreading
    ("21", "21 \\sqrt { 3 }", False),
    ("4:6", "2:3", True),
    ("3:2", "2:3", False),
    ("0.33", "\\frac{1}{3}", True),     # |0.33 - 1/3| = 1/300 = |1/3| / 100: on the bound
    ("0.32", "\\frac{1}{3}", False),
    ("0.3", "\\frac{1}{3}", False),     # one decimal against an exact gold
    ("31.42", "10 \\pi", True),
    ("31.4", "10 \\pi", False),
    ("31", "10 \\pi", False),
    ("15.0", "15", True),
    ("14.9", "15", False),
    ("\\frac{375}{20}", "18.8", True),  # 18.75 rounds to 18.8 (half up)
    ("\\frac{1874}{100}", "18.8", False),
    ("19", "18.8", False),
    ("6", "6.0", True),
    ("4\\sqrt{22}", "18.8", True),      # 18.76...
    ("21\\sqrt{3} \\approx 36.4", "21 \\sqrt { 3 }", True),
    ("21\\sqrt{3} \\approx 37", "21 \\sqrt { 3 }", False),
    ("x = 13.\\overline{3}", "\\frac { 40 } { 3 }", True),
    ("68^o", "68", True),
    ("15 \\text{ cm}^2", "15", True),
    ("The length of AB is 15 units.", "15", True),
    ("x is approximately 13.33", "\\frac { 40 } { 3 }", True),
    ("5x = 15", "15", False),
    ("x = 3, y = 4", "3", False),
    ("15 or 30", "15", False),
    ("\\pm 15", "15", False),
    ("B", "15", False),
    ("(B) 15", "15", False),
    ("BE and AD", "A D and B E", True),
    ("AD", "A D and B E", False),
    ("10y(2y - 1)", "20 y^2 - 10 y", True),
    ("10y(2y + 1)", "20 y^2 - 10 y", False),
    ("m + n - 180", "m + n - 180", True),
    ("5", "x = 5", True),
])
def test_equality(answer, gold, ok):
    assert is_correct(W(answer), gold) is ok


def test_never_raises_on_odd_types():
    assert is_correct(None, "1") is False  # type: ignore[arg-type]
    assert is_correct(W("1"), None) is False  # type: ignore[arg-type]
    assert extract_answer(123) is None  # type: ignore[arg-type]
    assert format_ok(None) is False  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The reward
# --------------------------------------------------------------------------------------------

def test_reward_registered_and_weighted():
    assert REGISTRY["geometry"] is geometry_reward
    good, sample = W("15"), {"answer": "15"}
    assert geometry_reward(good, sample) == pytest.approx(
        {"reward": 1.0, "accuracy": 1.0, "format": 1.0})
    assert geometry_reward("\\boxed{15}", sample) == pytest.approx(
        {"reward": 0.9, "accuracy": 1.0, "format": 0.0})
    assert geometry_reward(W("16"), sample) == pytest.approx(
        {"reward": 0.1, "accuracy": 0.0, "format": 1.0})
    out = geometry_reward(good, sample, accuracy_weight=0.5, format_weight=0.25)
    assert out == pytest.approx({"reward": 0.75, "accuracy": 1.0, "format": 1.0})


# --------------------------------------------------------------------------------------------
# Bounded work
# --------------------------------------------------------------------------------------------

def best_time(fn, *args, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):  # the best of a few runs sheds other processes' noise
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best


def test_every_case_within_bound():
    slow = [(c["rule"], c["id"], round(dt, 4)) for c in CASES
            if (dt := best_time(is_correct, c["response"], c["gold"])) > BOUND_S]
    assert not slow
    assert max(len(c["response"]) for c in CASES) >= 199_000  # the bound is tested at size


def test_throughput_one_core():
    pairs = [(c["response"], c["gold"]) for c in CASES]
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for r, g in pairs:
            is_correct(r, g)
        best = min(best, time.perf_counter() - t)
    assert len(pairs) / best >= 2000, len(pairs) / best


def _judge_pair(pair: tuple[str, str]) -> bool:
    return is_correct(*pair)


def test_works_off_main_thread_and_in_worker_processes():
    pairs = [(W("21\\sqrt{3}"), "21 \\sqrt { 3 }"), (W("36.4"), "21 \\sqrt { 3 }"),
             ("<answer>" + "\\frac{1}{" * 400 + "2" + "}" * 400 + "</answer>", "2")]
    want = [True, False, False]
    with cf.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(_judge_pair, pairs)) == want
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        assert list(pool.map(_judge_pair, pairs)) == want


HOSTILE = ["\\frac{", "{", "}", "^", "^{", "9", "10", "!", "\\sqrt{", "\\sqrt", "(", ")", "π",
           "√", "\\pi", "<think>", "</think>", "<answer>", "</answer>", "\\boxed{", " ", "\n",
           "$", "**", "=", "\\approx", ".", ",", "x", "answer:", "The answer is ", "\\text{",
           "cm", "^\\circ", "-", "+", "/", ":", "\\left(", "\\right)", "\\cdot", "\\pm", "e",
           "\\overline{", "1.5", "\\dfrac", "[", "]", "\\\\", "%", "∞", "\x00", "é"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(HOSTILE), st.integers(1, 4000)), max_size=12),
       st.sampled_from(["15", "21 \\sqrt { 3 }", "\\frac { 40 } { 3 }", "18.8", "2:3",
                        "A D and B E", "20 y^2 - 10 y", "- 8"]))
def test_hostile_inputs_are_bounded(parts, gold):
    response = "".join(tok * n for tok, n in parts)[:200_000]
    assert isinstance(is_correct(response, gold), bool)
    assert best_time(is_correct, response, gold, repeat=2) < BOUND_S
    got = extract_answer(response)
    assert got is None or (isinstance(got, str) and 0 < len(got) <= 400)
    assert isinstance(format_ok(response), bool)


HEAVY = ["(1+\\sqrt{2}+\\sqrt{3}+\\sqrt{5})", "(\\pi+\\sqrt{7})", "^{64}", "^{2}", "^{-3}",
         "^{1/2}", "99999999999999999999999999999999999999", "\\sqrt{999999999989}", "\\frac{1}{",
         "}", "{", "*", "/", "+", "-", "π", "√", "\\sqrt[3]{", "0", "(", ")", "^", "x", "\\cdot",
         "0.5", "7", "=", "\\approx", ":"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(HEAVY), max_size=120),
       st.sampled_from(["15", "21 \\sqrt { 3 }", "18.8", "2:3", "20 y^2 - 10 y"]))
def test_heavy_short_answers_are_bounded(tokens, gold):
    response = W("".join(tokens))  # within the 400-character cap, so the parser does the work
    assert isinstance(is_correct(response, gold), bool)
    assert best_time(is_correct, response, gold, repeat=2) < BOUND_S


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=3000), st.text(max_size=60))
def test_random_text_never_raises(response, gold):
    assert isinstance(is_correct(response, gold), bool)
    assert isinstance(is_correct(W(response), gold), bool)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 500), st.integers(1, 60), st.integers(2, 9))
def test_equal_forms_of_random_values(p, q, k):
    from fractions import Fraction
    f = Fraction(p, q)
    gold = f"\\frac {{ {f.numerator} }} {{ {f.denominator} }}"
    assert is_correct(W(f"\\frac{{{k * p}}}{{{k * q}}}"), gold)        # unreduced
    assert is_correct(W(f"{k * p}/{k * q}"), gold)
    assert not is_correct(W(f"\\frac{{{p + 1}}}{{{q}}}"), gold)
    assert is_correct(W(f"\\sqrt{{{k * k * p}}}"), f"{k} \\sqrt {{ {p} }}")  # k sqrt p
    assert not is_correct(W(f"\\sqrt{{{k * k * p + 1}}}"), f"{k} \\sqrt {{ {p} }}")
