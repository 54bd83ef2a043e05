"""Build ``verifier_cases.jsonl``: the Geometry3K verifier's case set, from the real gold strings.

    python tests/data/make_verifier_cases.py [--data ../shared/data/geometry3k-text]

Each line: ``{"id", "rule", "gold", "expected", "response"}``; very long adversarial responses
are stored as ``"response_parts": [[text, repeat], ...]`` (joined in order) to keep the file
small. The verdicts come from how each response is built and, for decimals, from the documented
tolerance rule evaluated exactly with sympy; the verifier under test is never called here.
Deterministic: a fixed seed, golds in file order.
"""
from __future__ import annotations

import argparse
import json
import random
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import sympy
from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr,
                                        rationalize, standard_transformations)

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parents[2] / "shared/data/geometry3k-text"
TEXT_GOLDS_EXTRA = ["A D and B E"]  # named in the issue; the test split has such golds
# How many golds of each kind get the per-kind variants (all ratios, sums and text golds do).
N_INT, N_DEC, N_EXACT, N_EXTRACT = 80, 60, 90, 10
N_VERBATIM_INT, N_VERBATIM_OTHER = 60, 250


# ---------------------------------------------------------------------------------------------
# Gold values, read independently of rewards/geometry.py (regex rewrite + sympy)
# ---------------------------------------------------------------------------------------------

def gold_value(g: str) -> sympy.Expr | None:
    m = re.fullmatch(r"(\d+) \\frac \{ (\d+) \} \{ (\d+) \}", g)
    if m:  # the dataset's mixed numbers
        a, b, c = map(int, m.groups())
        return sympy.Integer(a) + sympy.Rational(b, c)
    s = g
    for _ in range(4):
        s = re.sub(r"\\sqrt \{ ([^{}]*) \}", r"sqrt(\1)", s)
        s = re.sub(r"\\sqrt (\d+)", r"sqrt(\1)", s)
        s = re.sub(r"\\frac \{ ([^{}]*) \} \{ ([^{}]*) \}", r"((\1)/(\2))", s)
    s = s.replace("\\pi", "pi")
    if re.search(r"[\\{}A-Za-z:<=]", s.replace("sqrt", "").replace("pi", "")):
        return None
    return parse_expr(s, transformations=standard_transformations + (
        rationalize, implicit_multiplication_application))


def decimals_of(text: str) -> int | None:
    m = re.fullmatch(r"-?\d+(?:\.(\d+))?", text)
    return None if not m else len(m.group(1) or "")


def rule_label(pred: sympy.Expr, pred_text: str, gold: sympy.Expr, gold_text: str) -> bool:
    """The documented tolerance rule (module docstring of rewards/geometry.py)."""
    # 60 digits: the values here are small algebraic numbers, far from any tie but exact ones,
    # and exact ties (0.33 against 1/3) evaluate exactly.
    err, size = abs(sympy.N(pred - gold, 60)), abs(sympy.N(gold, 60))
    if err < sympy.Float("1e-45"):
        return True
    d = decimals_of(pred_text)
    if d is not None and d >= 2 and err <= size / 100 + sympy.Float("1e-45"):
        return True
    k = decimals_of(gold_text)  # a decimal gold is a rounded value: p must round to it
    return bool(k) and err <= sympy.Float(5, 60) / 10 ** (k + 1) + sympy.Float("1e-45")


# ---------------------------------------------------------------------------------------------
# Renderings of a value
# ---------------------------------------------------------------------------------------------

def unicode_form(v: sympy.Expr) -> str:
    s = str(v).replace("*", "").replace("pi", "π")
    return re.sub(r"sqrt\((\d+)\)", r"√\1", s).replace("sqrt", "√")


def unreduced_forms(v: sympy.Expr) -> list[str]:
    out = []
    if v.is_Rational and not v.is_Integer:
        p, q = v.p, v.q
        out += [f"\\frac{{{2 * p}}}{{{2 * q}}}", f"{3 * p}/{3 * q}"]
    c, rest = v.as_coeff_Mul()
    if rest.is_Pow and rest.exp == sympy.Rational(1, 2) and rest.base.is_Integer:
        r = int(rest.base)
        if c.is_Integer:
            out.append(f"\\sqrt{{{int(c) ** 2 * r}}}")
        elif c.is_Rational:
            out.append(f"\\frac{{\\sqrt{{{c.p ** 2 * r}}}}}{{{c.q}}}")
    if v.is_Integer:
        out.append(f"\\frac{{{2 * int(v)}}}{{2}}")
    return out


def dataset_spacing(v: sympy.Expr) -> list[str]:
    """The dataset's own spacing for another value's form: 6 \\sqrt 2, \\frac { 40 } { 3 }."""
    out = []
    if v.is_Rational and not v.is_Integer:
        out.append(f"\\frac {{ {v.p} }} {{ {v.q} }}")
    c, rest = v.as_coeff_Mul()
    if rest.is_Pow and rest.exp == sympy.Rational(1, 2) and rest.base.is_Integer and c.is_Integer:
        out += [f"{c} \\sqrt {rest.base}", f"{c} \\sqrt {{ {rest.base} }}"]
    if rest == sympy.pi and c.is_Rational and not c.is_Integer:
        out.append(f"\\frac {{ {c.p} }} {{ {c.q} }} \\pi")
    return out


def mixed_form(v: sympy.Expr) -> str | None:
    if v.is_Rational and not v.is_Integer and v > 1:
        return f"{v.p // v.q} \\frac{{{v.p % v.q}}}{{{v.q}}}"
    return None


def wrong_values(v: sympy.Expr) -> list[sympy.Expr]:
    out = [v + 1, 2 * v, v / 2, v - 1]
    c, rest = v.as_coeff_Mul()
    if rest != 1:
        out += [c, (c + 1) * rest]  # "21" for 21 sqrt 3 (math-verify's misreading)
        if rest.is_Pow and rest.base.is_Integer:
            out += [rest.base, c * sympy.sqrt(rest.base + 1)]
    return [w for w in out if abs((w - v).evalf(40)) > 1e-20]


def fmt_decimal(v: sympy.Expr, d: int) -> str:
    """v rounded half-up to d digits after the point."""
    exact = Decimal(str(sympy.N(v, 40)))
    return str(exact.quantize(Decimal(1).scaleb(-d), rounding=ROUND_HALF_UP))


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------

class Builder:
    def __init__(self, problems: dict[str, str], seed: int = 20240611):
        self.rng = random.Random(seed)
        self.problems = problems
        self.cases: list[dict] = []

    def reasoning(self, gold: str, include: str | None = None) -> str:
        rng = self.rng
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        steps = [self.problems.get(gold, "Find x."),
                 f"One side is {a}, another {b}, so {a} + {b} = {a + b} and the angle is "
                 f"{rng.choice([30, 45, 60, 90, 120])} degrees."]
        if include is not None:
            steps.append(f"So the value could be {include}.")
        return " ".join(steps)

    def add(self, rule: str, gold: str, expected: bool, response: str | None = None,
            parts: list[list] | None = None) -> None:
        case = {"id": len(self.cases), "rule": rule, "gold": gold, "expected": bool(expected)}
        if parts is not None:
            case["response_parts"] = parts
        else:
            case["response"] = response
        self.cases.append(case)

    def std(self, gold: str, answer: str) -> str:
        """The prompt's format: <think>...</think> <answer>...</answer>."""
        return f"<think>\n{self.reasoning(gold)}\n</think>\n<answer>{answer}</answer>"

    def any_template(self, gold: str, answer: str) -> str:
        r = self.reasoning(gold)
        return self.rng.choice([
            f"<think>{r}</think>\n<answer>{answer}</answer>",
            f"<think>\n{r}\n</think>\n\n<answer>\n{answer}\n</answer>\n",
            f"<think>{r}</think><answer>\\boxed{{{answer}}}</answer>",
            f"<think>{r}</think>\nThe final answer is $\\boxed{{{answer}}}$.",
            f"{r}\nTherefore the answer is \\boxed{{{answer}}}",
            f"{r}</think>\n<answer>{answer}</answer>",
        ])


WRAPS = ["${}$", "$${}$$", "\\({}\\)", "\\[{}\\]", "**{}**", "{}.", "\\boxed{{{}}}",
         "$\\boxed{{{}}}$", "x = {}", "y={}", "AB = {}", "m \\angle ABC = {}", "\\angle 1 = {}",
         "The answer is {}.", "The answer is ${}$", "Answer: {}", "\\textbf{{{}}}",
         "$x = {}$.", "Therefore, x = {}", "The length of AB is {}"]
UNITS = ["{} cm", "{} \\text{{ cm}}", "{} units", "{} \\text{{ units}}^2", "{} m^2",
         "{} \\mathrm{{cm}}^2", "{} square units", "{} inches", "{} ft", "{}\\,\\text{{cm}}"]
DEGREES = ["{}^\\circ", "{}^{{\\circ}}", "{}°", "{} degrees", "{} \\text{{ degrees}}",
           "{}^{{ \\circ }}", "m \\angle 1 = {}^\\circ"]
MC = ["A", "B", "(C)", "D.", "\\boxed{{B}}", "The answer is C.", "(A) {}", "B. {}"]
HEDGES = ["{} or {}", "{}, {}", "{} \\text{{ or }} {}", "{} and {}", "x = {}, y = {}",
          "\\{{{}, {}\\}}", "{}; {}", "x = {} \\text{{ or }} x = {}"]


def P(*items: str | tuple[str, int]) -> list[list]:
    """``response_parts`` from strings and (text, repeat) pairs."""
    return [[x, 1] if isinstance(x, str) else list(x) for x in items]


def build(data: Path) -> list[dict]:
    rows = [json.loads(line) for split in ("train", "val")
            for line in (data / f"{split}.jsonl").read_text().splitlines()]
    problems: dict[str, str] = {}
    for r in rows:
        text = r["messages"][0]["content"].replace("<image>", "").split("\n\n")[0].strip()
        problems.setdefault(r["solution"], text)
    golds = list(dict.fromkeys(r["solution"] for r in rows))
    B = Builder(problems)
    rng = B.rng

    numeric, ratios, texts = {}, [], list(TEXT_GOLDS_EXTRA)
    for g in golds:
        if ":" in g:
            ratios.append(g)
            continue
        v = gold_value(g)
        if v is None:
            texts.append(g)
        else:
            numeric[g] = v

    all_ints = [g for g, v in numeric.items() if re.fullmatch(r"-?\s?\d+", g)]
    all_decs = [g for g in numeric if re.fullmatch(r"\d+\.\d+", g)]
    all_exact = [g for g in numeric if g not in all_ints and g not in all_decs]
    ints = rng.sample(all_ints, N_INT) + [g for g in all_ints if g.startswith("-")]
    decs = rng.sample(all_decs, N_DEC)
    exact = rng.sample(all_exact, N_EXACT)

    # 1. Every non-integer gold string verbatim (and a sample of the integers), in the prompt's
    # format or another common one.
    others = [g for g in golds if g not in all_ints and g not in ratios + texts]
    for g in rng.sample(all_ints, N_VERBATIM_INT) + rng.sample(others, N_VERBATIM_OTHER) \
            + ratios + texts:
        B.add("gold_verbatim", g, True, B.any_template(g, g))

    # 2. Exact non-integer golds: other spellings, approximations, wrong values.
    for g in exact:
        v = numeric[g]
        pos = [("latex_compact", sympy.latex(v)), ("plain_slash_sqrt", str(v)),
               ("unicode", unicode_form(v)),
               ("dfrac", sympy.latex(v).replace("\\frac", "\\dfrac")),
               ("tfrac", sympy.latex(v).replace("\\frac", "\\tfrac"))]
        pos += [("unreduced", u) for u in unreduced_forms(v)]
        pos += [("dataset_spacing", u) for u in dataset_spacing(v)]
        if mixed_form(v):
            pos.append(("mixed_number", mixed_form(v)))
        pos = [p for p in pos if p[1] != g]
        for rule, text in rng.sample(pos, min(3, len(pos))):
            B.add(rule, g, True, B.std(g, text))
        for d in (2, 3, 1, 0):
            text = fmt_decimal(v, d)
            B.add(f"decimal_{d}_vs_exact", g, rule_label(sympy.Rational(text), text, v, g),
                  B.std(g, text))
        w = rng.choice(wrong_values(v))
        B.add("wrong_value", g, False, B.std(g, rng.choice([sympy.latex(w), str(w)])))
        for rule, factors in (("decimal_2_far", [103, 97, 105, 95]),
                              ("decimal_2_near", [1006, 994, 1003, 997])):
            text = fmt_decimal(v * sympy.Rational(rng.choice(factors), factors[0] // 100 * 100), 2)
            B.add(rule, g, rule_label(sympy.Rational(text), text, v, g), B.std(g, text))
        text = fmt_decimal(v, 2)
        B.add("approximately", g, rule_label(sympy.Rational(text), text, v, g), B.std(g, rng.choice(
            [f"x \\approx {text}", f"approximately {text}", f"x is about {text}", f"≈ {text}"])))
        B.add(rng.choice(["units", "wrapper", "degrees"]), g, True,
              B.std(g, rng.choice(UNITS + WRAPS + DEGREES).format(sympy.latex(v))))

    # 3. Integer golds: wrappers, units, degrees, prefixes; near misses, hedges, letters.
    for g in ints:
        n = int(numeric[g])
        s = str(n)
        B.add("wrapper", g, True, B.std(g, rng.choice(WRAPS).format(s)))
        B.add(rng.choice(["units", "degrees"]), g, True,
              B.std(g, rng.choice(UNITS + DEGREES).format(s)))
        B.add("trailing_zeros", g, True, B.std(g, rng.choice([f"{s}.0", f"{s}.00"])))
        w = n + rng.choice([-2, -1, 1, 2, 10])
        B.add("wrong_value", g, False, B.std(g, rng.choice([str(w), f"x = {w}", f"{w}^\\circ"])))
        B.add("one_decimal_vs_int", g, False, B.std(g, f"{n}.{rng.randint(1, 9)}"))
        other = n + rng.choice([-30, 30, 60, 90, 180]) if n < 90 else n - 30
        hedge = rng.choice(HEDGES)
        vals = (s, str(other)) if rng.random() < 0.5 else (str(other), s)
        B.add("hedge", g, False, B.std(g, hedge.format(*vals)))
        if rng.random() < 0.5:
            B.add("plus_minus", g, False, B.std(g, rng.choice(["\\pm {}", "±{}", "x = \\pm {}"])
                                                 .format(s)))
        else:
            B.add("multiple_choice", g, False, B.std(g, rng.choice(MC).format(s)))
        text = f"{n * rng.choice([0.996, 1.004, 0.985, 1.015, 1.03]):.2f}"
        B.add("decimal_2_vs_int", g, rule_label(sympy.Rational(text), text, sympy.Integer(n), g),
              B.std(g, text))

    # 4. Decimal golds (rounded values): predictions that round to them, and ones that do not.
    for g in decs:
        v = numeric[g]
        k = decimals_of(g)
        unit = sympy.Rational(1, 10 ** k)
        for delta, rule in ((sympy.Rational(0), "decimal_gold_pad"),
                            (unit * sympy.Rational(rng.choice([-4, -3, 3, 4]), 10),
                             "decimal_gold_rounds_to"),
                            (unit * rng.choice([-2, -1, 1, 2]), "decimal_gold_off_by_unit")):
            p = v + delta
            text = fmt_decimal(p, k + (1 if delta or rule == "decimal_gold_pad" else 0))
            B.add(rule, g, rule_label(sympy.Rational(text), text, v, g), B.std(g, text))
        text = fmt_decimal(v, 0)
        B.add("decimal_gold_int_pred", g, rule_label(sympy.Rational(text), text, v, g),
              B.std(g, text))
        B.add("decimal_gold_fraction", g, True, B.std(g, sympy.latex(v)))
        B.add(rng.choice(["units", "degrees", "wrapper"]), g, True,
              B.std(g, rng.choice(UNITS + DEGREES + WRAPS).format(g)))

    # 5. Ratios, sums and text golds.
    for g in ratios:
        a, b = g.split(":")
        va, vb = gold_value(a.strip()), gold_value(b.strip())
        B.add("ratio", g, True, B.std(g, f"{sympy.latex(va)} : {sympy.latex(vb)}"))
        B.add("ratio", g, True, B.std(g, f"{sympy.latex(2 * va)}:{sympy.latex(2 * vb)}"))
        B.add("ratio", g, True, B.std(g, g.replace(" ", "")))
        B.add("ratio_wrong", g, False, B.std(g, f"{sympy.latex(vb)}:{sympy.latex(va)}"))
        B.add("ratio_wrong", g, False, B.std(g, f"{sympy.latex(va + 1)}:{sympy.latex(vb)}"))
    for g in [g for g in exact if "+" in g or " - " in g]:
        v = numeric[g]
        terms = list(sympy.Add.make_args(v))
        rng.shuffle(terms)
        B.add("sum_reordered", g, True, B.std(g, " + ".join(sympy.latex(t) for t in terms)
                                             .replace("+ -", "- ")))
        B.add("sum_wrong", g, False, B.std(g, sympy.latex(v + sympy.sqrt(2))))
    text_variants = {
        "A D and B E": (["AD and BE", "$\\overline{AD}$ and $\\overline{BE}$", "a d and b e",
                         "BE and AD", "AD, BE"],
                        ["AD", "BE and AD and CF", "A D or B E", "\\overline{AD}"]),
        "\\angle 1 \\cong \\angle 4": (["∠1 ≅ ∠4", "\\angle1\\cong\\angle4"],
                                       ["\\angle 1 \\cong \\angle 3", "\\angle 4"]),
        "\\angle 8 \\cong \\angle 2": (["∠8 ≅ ∠2", "$\\angle 8 \\cong \\angle 2$"],
                                       ["\\angle 8 \\cong \\angle 3", "\\angle 2"]),
        "a + b = 90": (["a+b=90", "$a + b = 90^\\circ$"], ["a + b = 180", "90", "a - b = 90"]),
        "m + n - 180": (["m+n-180", "n + m - 180", "m + n - 180^\\circ"],
                        ["m + n + 180", "180", "m - n - 180"]),
        "not enough information": (["Not enough information.", "\\text{not enough information}"],
                                   ["enough information", "0", "A"]),
        "\\angle 2 and \\angle 6": (["∠2 and ∠6", "$\\angle 2$ and $\\angle 6$"],
                                    ["\\angle 2 and \\angle 5", "\\angle 2", "\\angle 6"]),
        "x < 60": (["x<60", "$x < 60$"], ["x > 60", "x < 30", "60"]),
        "20 y^2 - 10 y": (["20y^2-10y", "10y(2y - 1)", "-10y + 20y^2"],
                          ["20y^2 + 10y", "10y", "20 y - 10 y^2"]),
    }
    for g in texts:
        good, bad = text_variants.get(g, ([], []))
        for t in good:
            B.add("text_gold", g, True, B.std(g, t))
        for t in bad:
            B.add("text_gold_wrong", g, False, B.std(g, t))
        B.add("multiple_choice", g, False, B.std(g, rng.choice(["A", "B", "(C)", "D"])))

    # 6. Which answer counts (extraction), on a sample of golds of every kind.
    pool = rng.sample(ints, N_EXTRACT) + rng.sample(decs, N_EXTRACT // 2) \
        + rng.sample(exact, N_EXTRACT)
    for g in pool:
        v = numeric[g]
        right = rng.choice([g, sympy.latex(v)])
        w = sympy.latex(rng.choice(wrong_values(v)))
        r = B.reasoning(g)
        rr = B.reasoning(g, include=right)  # the right value only inside the reasoning
        B.add("answer_tag", g, True, f"<think>{r}</think>\n<answer>{right}</answer>")
        B.add("answer_tag_boxed", g, True,
              f"<think>{r}</think>\n<answer>The answer is $\\boxed{{{right}}}$.</answer>")
        B.add("answer_tag_no_think", g, True, f"{r}\n<answer>{right}</answer>")
        B.add("prefilled_think", g, True, f"{r}\n</think>\n<answer>{right}</answer>")
        B.add("boxed_last", g, True, f"<think>{r}</think>\nWe get \\boxed{{{w}}}.\n"
              f"Correcting the arithmetic, the result is \\boxed{{{right}}}.")
        B.add("boxed_last_wrong", g, False, f"{rr}\nFirst guess \\boxed{{{right}}}.\n"
              f"After checking, it is \\boxed{{{w}}}.")
        B.add("boxed_hedge", g, False,
              f"<think>{r}</think> \\boxed{{{right}}} or \\boxed{{{w}}}")
        B.add("boxed_unterminated", g, False, f"<think>{r}</think> \\boxed{{{right}")
        B.add("answer_is", g, True, f"<think>{r}</think>\nThe answer is {right}.")
        B.add("answer_colon", g, True, f"{r}\n\n**Answer:** ${right}$")
        B.add("answer_in_think_only", g, False, f"<think>{r} <answer>{right}</answer></think>")
        B.add("answer_in_think_wrong_after", g, False,
              f"<think>{r} <answer>{right}</answer></think>\n<answer>{w}</answer>")
        B.add("answer_in_think_right_after", g, True,
              f"<think>{r} <answer>{w}</answer></think>\n<answer>{right}</answer>")
        B.add("boxed_in_think_only", g, False, f"<think>{r} \\boxed{{{right}}}</think>\n"
              "I have finished thinking.")
        B.add("reasoning_only", g, False, f"{rr}\nThe answer is {w}.")
        B.add("reasoning_only_no_final", g, False, rr)
        B.add("unterminated_think", g, False, f"<think>{r} so the answer is {right}")
        B.add("unterminated_answer", g, False, f"<think>{r}</think>\n<answer>{right}")
        B.add("empty_answer_tag", g, False,
              f"<think>{r}</think>\n<answer> </answer>\n\\boxed{{{right}}}")
        B.add("unopened_answer_tag", g, False, f"<think>{r}</think>\n{right}</answer>")
        B.add("answer_tags_disagree", g, False,
              f"<think>{r}</think><answer>{right}</answer><answer>{w}</answer>")
        B.add("answer_phrase_in_think_only", g, False,
              f"<think>{r} The answer is {right}.</think>\nDone.")
        B.add("chain_exact_then_approx", g, True, B.std(g, f"x = {sympy.latex(v)} \\approx "
                                                           f"{fmt_decimal(v, 3)}"))
        B.add("chain_wrong_approx", g, False, B.std(g, f"x = {sympy.latex(v)} \\approx "
                                                       f"{fmt_decimal(2 * v + 3, 2)}"))
        B.add("formula_chain", g, True, B.std(g, f"A = \\frac{{1}}{{2}} b h = {sympy.latex(v)}"))
        B.add("trig_lhs", g, True, B.std(g, f"\\sin A = {right}"))
        B.add("hedge_named_list", g, False, B.std(g, rng.choice(
            [f"x = {right}, y = {w}", f"x = {w}, y = {right}",
             f"x = {right} \\text{{ and }} {w}"])))

    # 7. Adversarial inputs: all judged quickly; no value hides in garbage.
    adv = [
        ("power_tower", "15", P("<think>a</think><answer>9^{9^{9^{9^{9}}}}</answer>")),
        ("power_tower", "4", P("<think>a</think><answer>2^2^2^2^2^2^2^2</answer>")),
        ("power_tower", "10", P("\\boxed{10^{10^{10^{10}}}}")),
        ("power_tower", "27", P("<answer>", ("3^{", 60), "3", ("}", 60), "</answer>")),
        ("huge_factorial", "100", P("<think>a</think><answer>(10^{100})!</answer>")),
        ("huge_factorial", "15", P("<answer>5!</answer> and \\boxed{(10^{100})!}")),
        ("huge_factorial", "15", P("The answer is 1000000!")),
        ("huge_power", "15", P("<answer>2^{999999999}</answer>")),
        ("huge_power", "15", P("<answer>(\\sqrt{2}+\\sqrt{3}+\\sqrt{5}+\\pi)^{999}</answer>")),
        ("huge_number", "15", P("<answer>", ("9", 5000), "</answer>")),
        ("deep_frac", "15", P("<answer>", ("\\frac{1}{", 400), "2", ("}", 400), "</answer>")),
        ("deep_frac", "15", P("\\boxed{", ("\\frac{1}{", 400), "7", ("}", 400), "}")),
        ("deep_frac", "15", P("<answer>", ("\\frac{", 400), "</answer>")),
        ("deep_sqrt", "2", P("<answer>", ("\\sqrt{", 400), "16", ("}", 400), "</answer>")),
        ("deep_parens", "16", P("<answer>", ("(", 5000), "15", (")", 5000), "</answer>")),
        ("unbalanced_braces", "15", P("<think>a</think>\\boxed{", ("{", 5000), "15")),
        ("unbalanced_braces", "15", P("<answer>", ("{", 5000), "15</answer>")),
        ("unbalanced_braces", "15", P("<answer>15", ("}", 5000), "</answer>")),
        ("unbalanced_braces", "15", P(("\\boxed{", 5000), "15")),
        ("unclosed_tags", "15", P(("<think>", 20000), "15")),
        ("unclosed_tags", "15", P(("<answer>", 20000), "15")),
        ("unclosed_tags", "16", P(("<answer>", 20000), "15</answer>")),
        ("unclosed_tags", "15", P("<think>a</think>", ("<answer>", 20000), "15")),
        ("unclosed_tags", "15", P(("</think><answer>", 20000), "15")),
    ]
    for rule, g, parts in adv:
        B.add(rule, g, False, parts=parts)
    printable = "".join(chr(c) for c in range(32, 127)) + "{}\\$^_<>/"
    noise = "".join(rng.choice(printable) for _ in range(2000))
    big = [
        ("long_garbage", "15", [["a", 200000]]),
        ("long_garbage", "15", [[noise, 100]]),
        ("long_garbage", "15", [["\\", 200000]]),
        ("long_garbage", "15", [["{", 200000]]),
        ("long_garbage", "15", [["$", 200000]]),
        ("long_garbage", "15", [["answer: ", 25000]]),
        ("long_garbage", "15", [["The answer is ", 14000]]),
        ("long_garbage", "15", [["\\boxed{1}", 20000]]),
        ("long_garbage", "15", [["<answer>1</answer>", 11000]]),
        ("long_garbage", "15", [["<think>", 1], ["x ", 99990], ["</think><answer>", 1],
                                ["9", 150]]),
        ("long_garbage", "15", [["<answer>", 1], ["9", 199000], ["</answer>", 1]]),
        ("long_garbage", "15", [["<answer>", 1], ["(", 100000], ["</answer>", 1]]),
        ("long_garbage", "15", [["<answer>", 1], ["\\sqrt{", 30000], ["</answer>", 1]]),
        ("long_garbage", "15", [["\\boxed{", 1], ["1+", 99000], ["15}", 1]]),
    ]
    for rule, g, parts in big:
        B.add(rule, g, False, parts=parts)
    long_ok = [
        ("long_correct", "15", [["<think>", 1], ["The side is 5 and 9. ", 9500], ["</think>\n", 1],
                                ["<answer>15</answer>", 1]]),
        ("long_correct", r"\frac { 40 } { 3 }", [["<think>", 1], ["x = 12. ", 24000],
                                                 ["</think>\\boxed{\\frac{40}{3}}", 1]]),
        ("long_correct", r"21 \sqrt { 3 }", [["Reasoning about 3 and 21. ", 7600],
                                             ["<answer>36.37</answer>", 1]]),
        ("long_whitespace", "15", [["<answer>15", 1], [" ", 199000], ["cm</answer>", 1]]),
        ("long_correct", "68", [["<think>", 1], ["{", 5000], ["</think>", 1],
                                ["<answer>68^\\circ</answer>", 1]]),
    ]
    for rule, g, parts in long_ok:
        B.add(rule, g, True, parts=parts)
    return B.cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--out", type=Path, default=HERE / "verifier_cases.jsonl")
    args = ap.parse_args()
    cases = build(args.data)
    with args.out.open("w") as f:
        for c in cases:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    pos = sum(c["expected"] for c in cases)
    print(f"wrote {len(cases)} cases ({pos} correct, {len(cases) - pos} wrong) to {args.out}")


if __name__ == "__main__":
    main()
