"""Geometry3K answer verifier (:func:`extract_answer`, :func:`format_ok`, :func:`is_correct`) and
the ``geometry`` reward built on them.

Which answer counts. Text inside ``<think>...</think>`` never counts: the answer is looked for
after the last ``</think>`` (or in the whole response when there is no think tag at all; an
unterminated ``<think>`` leaves no answer). There, in this order:
1. the ``<answer>...</answer>`` block (its last complete ``\\boxed{}`` if it holds one); several
   blocks must agree; an empty, unterminated or unopened block means no answer;
2. else the last complete ``\\boxed{...}`` (nested braces); an unterminated last box, or two
   different boxes on the same line ("\\boxed{60} or \\boxed{120}"), means no answer;
3. else the rest of the line after the last "The answer is" / "Answer:" (up to a sentence end).
Values that appear only in the reasoning never count; a response with none of these has no answer.

Equality is mathematical. After removing ``$``, ``**``, ``\\(``/``\\[``, ``\\text{}``-style
wrappers, a trailing period, degree marks (``^\\circ``, ``^{\\circ}``, ``°``, "degrees"), a
trailing unit (cm, units, m^2, square units, ...), a leading "The answer is" / "Therefore," and a
leading name (``x =``, ``m \\angle ABC =``, ``AB =``, ``\\sin A =``, "The length of AB is"), the
answer is parsed by a small recursive-descent parser that reads the dataset's spacing
(``\\frac { 40 } { 3 }``, ``6 \\sqrt 2``, ``4 \\frac { 4 } { 11 }`` as a mixed number),
``\\dfrac``/``\\tfrac``, ``a/b``, ``sqrt(3)``, unicode ``√`` and ``π``, into an exact value: a
sum of ``q * sqrt(r) * pi^k`` with rational ``q`` and square-free ``r``, a canonical form, so
``\\sqrt{72}`` = ``6\\sqrt{2}`` and ``80/6`` = ``40/3``. What the exact form cannot hold
(nested radicals, cube roots, division by a long sum) falls back to a float compared at 1e-9.
Repeating decimals (``13.\\overline{3}``) are read exactly. Several candidates ("60 or 120",
``\\pm``, lists, "x = 3, y = 4") and multiple-choice letters do not parse and are wrong; so is
anything else the parser does not read (words, ``%``, ``!``, ``\\sin 30``): unknown means wrong.
A ratio gold (``2:3``) matches a proportional ratio (``4:6``), not a fraction. A gold written
``x = 5`` is read as 5. Non-numeric golds (``A D and B E``, ``x < 60``) are compared as
normalised text (lower case, no spaces, braces, wrappers or segment bars; "X and Y" and "X, Y"
as an unordered pair); golds with letters that parse as an expression (``20 y^2 - 10 y``) also
match an equal expression, checked at two points.

Tolerance (prediction p, gold g):
- p equal to g (exactly, as above) is correct;
- p written as a decimal with at least two digits after the point is correct when
  ``|p - g| <= |g| / 100`` (relative error at most 1e-2);
- otherwise an integer or one-decimal p against an exact gold (integer, fraction, radical,
  pi) must be exact: ``36.4`` and ``36`` are wrong for ``21 \\sqrt { 3 }``;
- a gold that is itself a decimal (``18.8``, ``6.45``, treated as rounded) also matches any p
  that rounds to it: ``|p - g| <= 0.5 * 10**-digits(g)`` (``4\\sqrt{22}`` for ``18.8``);
- in a chain ``21\\sqrt{3} \\approx 36.4`` every value must be correct, except that a literal
  after ``\\approx`` only has to be the gold correctly rounded to its own digits, and some part
  must be correct on its own; after a name, a formula on the way (``A = \\pi r^2 = 25\\pi``) is
  skipped, but the last part must be a value (``5x = 15`` is wrong for 15).

Bounded work (the caps: docs/data.md): a candidate answer over 400 characters once runs of
whitespace are collapsed, or a longer gold, is unmatched; nothing raises (garbage is false).
"""
from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache

from rewards import register
from rewards._mathparse import Num, Reject, decimals, equal, mul, parse, rat, within

MAX_ANSWER = 400       # characters of a candidate answer; no real answer is longer
MAX_SCAN = 2000        # characters scanned for a \boxed{...} closing brace


# ---- Which answer counts

def _outside_think(response: str) -> str | None:
    close = response.rfind("</think>")
    if close >= 0:
        region = response[close + len("</think>"):]
        return None if "<think>" in region else region
    return None if "<think>" in response else response


def _brace_group(text: str, pos: int) -> tuple[str, int] | None:
    """Content and end index of the ``{...}`` starting at ``pos`` (after spaces), or None."""
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        return None
    depth = 0
    window = text[pos:pos + MAX_SCAN]
    for m in re.finditer(r"[{}]", window):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return window[1:m.start()], pos + m.start() + 1
    return None


_ABSENT = object()


def _last_boxed(text: str):
    """Content of the last complete ``\\boxed{}``; None if broken or ambiguous; _ABSENT if none."""
    i = text.rfind("\\boxed")
    if i < 0:
        return _ABSENT
    got = _brace_group(text, i + len("\\boxed"))
    if got is None:
        return None
    content = got[0].strip()
    j = text.rfind("\\boxed", 0, i)
    if j >= 0:
        prev = _brace_group(text, j + len("\\boxed"))
        # Two different boxes on one line are a hedge; an outer box around this one is not.
        if prev is not None and prev[1] <= i and prev[0].strip() != content \
                and "\n" not in text[prev[1]:i]:
            return None
    return content


def _answer_text(inner: str) -> str | None:
    if len(inner) > MAX_ANSWER:
        inner = " ".join(inner.split())  # "15      cm" is still 15 cm
    inner = inner.strip()
    if "\\boxed" in inner:
        b = _last_boxed(inner)
        inner = "" if b is _ABSENT or b is None else b
    return inner if 0 < len(inner) <= MAX_ANSWER else None


def _from_answer_tags(region: str) -> str | None:
    n = region.count("<answer>")
    if n == 0 or n > 4 or region.count("</answer>") != n:
        return None
    found: set[str | None] = set()
    pos = 0
    for _ in range(n):
        a = region.find("<answer>", pos)
        b = region.find("</answer>", a)
        if a < 0 or b < 0 or "<answer>" in region[a + 8:b]:
            return None
        found.add(_answer_text(region[a + 8:b]))
        pos = b + 9
    return found.pop() if len(found) == 1 else None


_PHRASE = re.compile(r"answer(?:\*\*)?\s{0,3}(?:is\b|:)")


def _after_answer_phrase(region: str) -> str | None:
    low = region.lower()
    pos = len(low)
    for _ in range(20):  # bounded: a hostile text may say "answer" thousands of times
        k = low.rfind("answer", 0, pos)
        if k < 0:
            return None
        m = _PHRASE.match(low, k)
        if m:
            break
        pos = k
    else:
        return None
    start = m.end()
    for _ in range(3):  # the phrase may end its line ("The answer is:\n$15$")
        end = region.find("\n", start)
        line = region[start:end if end >= 0 else len(region)].strip().lstrip(":*").strip()
        if line or end < 0:
            break
        start = end + 1
    cut = re.search(r"\.(?:\s|$)", line)
    if cut:
        line = line[:cut.start()]
    return _answer_text(line)


def extract_answer(response: str) -> str | None:
    """The candidate answer text of ``response`` (see the module docstring), or None."""
    try:
        if not isinstance(response, str):
            return None
        region = _outside_think(response)
        if region is None:
            return None
        if "<answer>" in region or "</answer>" in region:
            return _from_answer_tags(region)
        boxed = _last_boxed(region)
        if boxed is not _ABSENT:
            return _answer_text(boxed) if boxed is not None else None
        return _after_answer_phrase(region)
    except Exception:  # noqa: BLE001 - a verifier never raises
        return None


def format_ok(response: str) -> bool:
    """The anchors' format: ``<think>T</think>`` then ``<answer>A</answer>``, nothing else.

    Accepted exactly: optional whitespace, ``<think>``, a body T, ``</think>``, optional
    whitespace, ``<answer>``, a body A, ``</answer>``, optional whitespace. T and A are not blank,
    and each of the four tags occurs exactly once.
    """
    if not isinstance(response, str):
        return False
    s = response.strip()
    if not s.startswith("<think>") or not s.endswith("</answer>"):
        return False
    if any(s.count(t) != 1 for t in ("<think>", "</think>", "<answer>", "</answer>")):
        return False
    t_end, a = s.find("</think>"), s.find("<answer>")
    if not 7 <= t_end < a or s[t_end + 8:a].strip():
        return False
    return bool(s[7:t_end].strip()) and bool(s[a + 8:-9].strip())


# ---- Normalisation

_REPLACE = [
    ("$", " "), ("**", " "), ("`", " "), ("\\(", " "), ("\\)", " "), ("\\[", " "), ("\\]", " "),
    ("\\displaystyle", " "), ("\\left", " "), ("\\right", " "), ("\\qquad", " "), ("\\quad", " "),
    ("\\!", " "), ("\\,", " "), ("\\;", " "), ("\\:", " "), ("\\ ", " "), ("~", " "),
    ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cfrac", "\\frac"),
    ("\\{", "{"), ("\\}", "}"), ("\\colon", ":"),
    ("\\approx", "≈"), ("\\simeq", "≈"), ("\\sim", "≈"),
    ("\\ge", "≥"), ("\\le", "≤"), ("\\neq", "≠"), ("\\ne ", "≠"),
]
_WRAPPER = re.compile(r"\\(?:text[a-z]*|math(?:rm|bf|it|sf|tt)|mbox|operatorname|boldsymbol|bm)"
                      r"(?![A-Za-z])")
_DEGREE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree|\\deg(?![a-z])"
                     r"|\^\s*\{?\s*o\s*\}?(?![A-Za-z])")
_REPEATING = re.compile(r"(\d*)\.(\d*)\\overline\s*\{(\d{1,6})\}")  # 13.\overline{3} = 40/3
_LEAD = re.compile(r"^(?:(?:therefore|thus|hence|so),?\s)?(?:the\s)?(?:final\s)?"
                   r"(?:answer\s?(?:is\b)?\s?:?\s?)?", re.I)
_ABOUT = re.compile(r"\b(?:approximately|approx\.?|about|roughly|nearly)(?:\s|$)", re.I)
_UNIT = re.compile(
    r"(?:\s?(?:square|sq\.?|cubic))?\s?(?:units?|cm|mm|km|m|in|inch(?:es)?|ft|feet|foot|yd"
    r"|yards?|(?:centi|milli|kilo)?met(?:er|re)s?|miles?|degrees?|deg)\s?"
    r"(?:\^\s?\{?\s?[23]\s?\}?|[²³])?$", re.I)
_FRAC_DIGITS = re.compile(r"\\frac\s*(\d)\s*(\d)")  # LaTeX \frac12 is 1/2


def _clean(text: str, strip_units: bool) -> str:
    """Remove wrappers, degree marks, a leading answer phrase, a trailing period and units."""
    s = text
    for a, b in _REPLACE:
        if a in s:
            s = s.replace(a, b)
    for _ in range(8):  # \textbf{\frac{40}{3}} -> \frac{40}{3}; \text{ cm} -> cm
        m = _WRAPPER.search(s)
        got = _brace_group(s, m.end()) if m else None
        if got is None:
            break
        s = f"{s[:m.start()]} {got[0]} {s[got[1]:]}"
    # The `in` tests only skip regexes that cannot match; the hot path is a bare number.
    if "circ" in s or "°" in s or "deg" in s or "^" in s:
        s = _DEGREE.sub(" ", s)
    if "overline" in s:
        s = _REPEATING.sub(_repeating_to_frac, s)
    s = " ".join(s.split())  # single spaces keep the unit regex linear
    if not s[:1].isdigit():
        s = _LEAD.sub("", s, count=1)
    low = s.lower()
    if "ab" in low or "ppro" in low or "rough" in low or "near" in low:
        s = _ABOUT.sub("≈ ", s)
    if "\\frac" in s:
        s = _FRAC_DIGITS.sub(r"\\frac{\1}{\2}", s)
    return _strip_tail(s, strip_units)


def _repeating_to_frac(m: re.Match) -> str:
    whole, fixed, rep = m.group(1) or "0", m.group(2), m.group(3)
    if len(whole) + len(fixed) > 12:
        return m.group(0)
    q = Fraction(int(whole + fixed + rep) - int(whole + fixed),
                 10 ** len(fixed) * (10 ** len(rep) - 1))
    return f"\\frac{{{q.numerator}}}{{{q.denominator}}}"


def _strip_tail(s: str, strip_units: bool) -> str:
    for _ in range(3):  # "15 cm." -> "15 cm" -> "15"
        s = s.strip().rstrip(" .")
        if not strip_units or len(s) < 2 or not (s[-1].isalpha() or s[-1] in "}²³23"):
            break
        tail = s[-48:]  # a unit is short: matching only the tail keeps this cheap
        m = _UNIT.search(tail)
        if not m:
            break
        s = s[:len(s) - len(tail) + m.start()]
    return s.strip()


# ---- Comparison

class _Gold:
    """The gold, parsed once: kind is num, ratio, expr (has letters) or text."""

    def __init__(self, gold: str):
        self.kind, self.val, self.decimals, self.parts = "text", None, None, []
        self.vars: set[str] = set()
        self.vals: list[Num] = []
        self.has_eq = "=" in gold
        self.text = _text_key(gold) if len(gold) <= MAX_ANSWER else None
        if self.text is None:
            return
        s = _clean(gold, strip_units=True)
        sides = s.split("=")
        if len(sides) == 2 and _is_name(sides[0]):  # a gold written "x = 5"
            s = sides[1].strip()
        try:
            if ":" in s:
                self.parts = [parse(p) for p in s.split(":")]
                self.kind = "ratio"
                return
            self.val = parse(s)
            self.kind, self.decimals = "num", decimals(s) or None
            return
        except (Reject, ArithmeticError, ValueError):
            pass
        s = _clean(gold, strip_units=False)
        letters = _letters(s)
        if letters and not re.search(r"[=<>≤≥≠]|\\", s):
            try:
                self.vals = [parse(s, env) for env in _envs(letters)]
                self.kind, self.vars = "expr", letters
            except (Reject, ArithmeticError, ValueError):
                pass


def _letters(s: str) -> set[str]:
    return set(re.findall(r"(?<![\\A-Za-z])[A-Za-z](?![A-Za-z])", s))


def _envs(letters: set[str]) -> list[dict[str, float]]:
    # Two generic points: distinct polynomials of small degree differ there.
    return [{c: math.sqrt(2 + i) + 0.1 * k for i, c in enumerate(sorted(letters))}
            for k in (1, 7)]


@lru_cache(maxsize=8192)
def _gold(gold: str) -> _Gold:
    return _Gold(gold)


_NAME_TOKEN = re.compile(r"\\[A-Za-z]+|[A-Za-z]+|\d+|\S")
_NAME_CMDS = {"\\angle", "\\measuredangle", "\\overline", "\\widehat", "\\overarc", "\\arc",
              "\\triangle", "\\odot", "∠", "{", "}", "_", "(", ")", "\\sin", "\\cos",
              "\\tan", "\\cot", "\\sec", "\\csc"}


def _is_name(s: str) -> bool:
    """A left-hand side to drop: x, AB, m \\angle ABC, \\angle 1, \\overline{AB}, x_1,
    "The length of AB". Words and angle/segment marks only; a number only right after an
    angle mark or ``_``; no operator."""
    toks = _NAME_TOKEN.findall(s)
    if len(toks) > 24 or not any(t.isalpha() or t in _NAME_CMDS and len(t) > 2 for t in toks):
        return False
    prev = ""
    for t in toks:
        if t.isdigit():
            if len(t) > 2 or prev not in ("\\angle", "∠", "_", "{"):
                return False
        elif not t.isalpha() and t not in _NAME_CMDS:
            return False
        prev = t
    return True


def _chain(s: str) -> tuple[list[str], list[str], bool]:
    """Split ``x = a \\approx b`` into parts and separators, dropping a leading name (and
    saying whether there was one)."""
    pieces = re.split(r"(=|≈|\bis\b|\bequals\b)", s)
    parts, seps = pieces[0::2], pieces[1::2]
    named = len(parts) > 1 and _is_name(parts[0])
    if named or len(parts) > 1 and not parts[0].strip():
        parts, seps = parts[1:], seps[1:]
        if len(parts) > 1 and not parts[0].strip():  # "x is approximately 13.33"
            parts, seps = parts[1:], seps[1:]
    return [_strip_tail(p, True) for p in parts], seps, named


def _close_to_gold(p: Num, digits: int | None, g: _Gold) -> bool:
    if equal(p, g.val):
        return True
    if digits is not None and digits >= 2 and within(p, g.val, abs(_frac_of(g.val)) / 100):
        return True
    return g.decimals is not None and within(p, g.val, Fraction(1, 2 * 10 ** g.decimals))


def _frac_of(v: Num) -> Fraction:
    q = v.rational()
    return q if q is not None else Fraction(v.value())


def _is_formula(s: str) -> bool:
    """An expression in letters ("\\pi r^2"), not a list or a sentence ("81, y", "3 or x")."""
    letters = _letters(s)
    try:
        return bool(letters) and bool(parse(s, _envs(letters)[0]))
    except (Reject, ArithmeticError, ValueError):
        return False


def _match_numeric(s: str, g: _Gold) -> bool:
    if any(h in s for h in ("\\pm", "±", "\\mp", "∓")):
        return False
    parts, seps, named = _chain(s)
    if not parts or len(parts) > 4 or not all(parts):
        return False
    if g.kind == "ratio":
        if len(parts) != 1:
            return False
        pieces = parts[0].split(":")
        if len(pieces) != len(g.parts):
            return False
        vals = [parse(p) for p in pieces]
        if any(equal(v, rat(Fraction(0))) for v in vals + g.parts):
            return False
        return all(equal(mul(v, g.parts[0]), mul(w, vals[0])) for v, w in zip(vals, g.parts))
    some = False
    for i, part in enumerate(parts):
        if named and i < len(parts) - 1 and _is_formula(part):
            continue  # "A = \\pi r^2 = 25\\pi" (but "5x = 15" states no value)
        p, digits = parse(part), decimals(part)
        if _close_to_gold(p, digits, g):
            some = True
        elif not (i > 0 and seps[i - 1] == "≈" and digits is not None
                  and within(p, g.val, Fraction(1, 2 * 10 ** digits))):
            return False
    return some


_TEXT_DROP = re.compile(r"\\(?:overline|widehat|overarc|arc)|[\s{}]")
_TEXT_SPLIT = re.compile(r"\s?(?:,|&|\band\b)\s?")


def _text_key(s: str) -> tuple[str, ...]:
    """Lower case, no spaces, braces or segment marks; "X and Y" / "X, Y" as an unordered pair."""
    s = _clean(s, strip_units=False).lower()
    s = s.replace("∠", "\\angle").replace("≅", "\\cong").replace("△", "\\triangle")
    items = [_TEXT_DROP.sub("", x) for x in _TEXT_SPLIT.split(s)]
    return tuple(sorted(x for x in items if x))


def _match_text(cand: str, g: _Gold) -> bool:
    s = _clean(cand, strip_units=False)
    sides = s.split("=")
    if not g.has_eq and len(sides) == 2 and _is_name(sides[0]):  # "x = m + n - 180"
        s = sides[1]
    if _text_key(s) == g.text:
        return True
    if g.kind == "expr" and _letters(s) == g.vars:
        return all(equal(parse(s, env), v) for env, v in zip(_envs(g.vars), g.vals))
    return False


def is_correct(response: str, gold: str) -> bool:
    """Whether the answer of ``response`` equals ``gold`` (rules in the module docstring)."""
    try:
        cand = extract_answer(response)
        if cand is None or not isinstance(gold, str) or len(gold) > MAX_ANSWER:
            return False
        g = _gold(gold.strip())
        if g.kind in ("num", "ratio"):
            return _match_numeric(_clean(cand, strip_units=True), g)
        return g.text is not None and _match_text(cand, g)
    except Exception:  # noqa: BLE001 - garbage is judged false, never raised
        return False


@register("geometry")
def geometry_reward(response: str, sample: dict, accuracy_weight: float = 0.9,
                    format_weight: float = 0.1) -> dict[str, float]:
    """Accuracy (``is_correct`` against ``sample["answer"]``) plus format (``format_ok``)."""
    acc = 1.0 if is_correct(response, sample["answer"]) else 0.0
    fmt = 1.0 if format_ok(response) else 0.0
    return {"reward": accuracy_weight * acc + format_weight * fmt, "accuracy": acc, "format": fmt}
