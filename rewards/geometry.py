"""Geometry3K answer verifier and the ``geometry`` reward.

Owns: which part of a response is the answer (:func:`extract_answer`), the anchors' format check
(:func:`format_ok`), whether the answer equals the gold (:func:`is_correct`), and the registered
reward built on them.

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

Bounded work: the response is only scanned with ``str`` methods and linear regexes; the
candidate answer is capped at 400 characters once runs of whitespace are collapsed (a longer
gold is judged unmatched), a ``\\boxed{`` at 2,000 characters, the parser at 160 tokens and
depth 40, powers at exponent 64, coefficients at 600 bits, radicands at 1e12; factorials are
refused. Any input up to 200,000 characters is judged in about a millisecond (the bound is
50 ms), with no signal or thread, so it works in any thread or process; nothing raises (garbage
is judged false).
"""
from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache

from rewards import register

MAX_ANSWER = 400       # characters of a candidate answer; no real answer is longer
MAX_SCAN = 2000        # characters scanned for a \boxed{...} closing brace
MAX_TOKENS = 160
MAX_DEPTH = 40
MAX_EXP = 64
MAX_BITS = 600         # numerator/denominator bits of an exact coefficient
MAX_RADICAND = 10**12  # square-free split by trial division up to 10^4 stays cheap
MAX_FLOAT = 1e60


class _Reject(Exception):
    """The text is not a value this verifier reads."""


# ----------------------------------------------------------------------------------------------
# Which answer counts
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Exact values: sum of q * sqrt(r) * pi^k, or a float where that form cannot hold the value
# ----------------------------------------------------------------------------------------------

def _primes(n: int) -> list[int]:
    sieve = bytearray([1]) * (n + 1)
    sieve[:2] = b"\x00\x00"
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(sieve[i * i::i]))
    return [i for i in range(n + 1) if sieve[i]]


_PRIMES = _primes(10_000)


@lru_cache(maxsize=4096)
def _square_split(n: int) -> tuple[int, int]:
    """(s, r) with n = s*s*r and r square-free, for 0 < n < 1e12."""
    s, r = 1, 1
    for p in _PRIMES:
        if p * p > n:
            break
        if n % p == 0:
            e = 0
            while n % p == 0:
                n //= p
                e += 1
            s *= p ** (e // 2)
            if e % 2:
                r *= p
    # What is left has no prime factor below 10^4, so it is 1, a prime, p*q or p^2.
    root = math.isqrt(n)
    if root > 1 and root * root == n:
        return s * root, r
    return s, r * n


class _Num:
    """``terms`` maps (square-free r, power of pi k) to a nonzero rational; None means inexact."""

    __slots__ = ("terms", "approx")

    def __init__(self, terms: dict[tuple[int, int], Fraction] | None, approx: float = 0.0):
        self.terms = terms
        self.approx = approx

    def value(self) -> float:
        if self.terms is None:
            return self.approx
        return math.fsum(float(c) * math.sqrt(r) * math.pi ** k for (r, k), c in self.terms.items())

    def rational(self) -> Fraction | None:
        if self.terms is None or any(key != (1, 0) for key in self.terms):
            return None
        return self.terms.get((1, 0), Fraction(0))


def _inexact(v: float) -> _Num:
    if not isinstance(v, float) or not math.isfinite(v) or abs(v) > MAX_FLOAT:
        raise _Reject
    return _Num(None, v)


def _exact(terms: dict[tuple[int, int], Fraction]) -> _Num:
    if len(terms) > 12:
        raise _Reject
    for (r, k), c in terms.items():
        if r > MAX_RADICAND or abs(k) > 8 or c.numerator.bit_length() > MAX_BITS \
                or c.denominator.bit_length() > MAX_BITS:
            return _inexact(_Num(terms).value())
    return _Num(terms)


def _rat(q: Fraction) -> _Num:
    return _exact({(1, 0): q} if q else {})


def _add(a: _Num, b: _Num) -> _Num:
    if a.terms is None or b.terms is None:
        return _inexact(a.value() + b.value())
    t = dict(a.terms)
    for key, c in b.terms.items():
        v = t.get(key, 0) + c
        if v:
            t[key] = v
        else:
            t.pop(key, None)
    return _exact(t)


def _neg(a: _Num) -> _Num:
    return _inexact(-a.approx) if a.terms is None else _Num({k: -c for k, c in a.terms.items()})


def _mul(a: _Num, b: _Num) -> _Num:
    if a.terms is None or b.terms is None:
        return _inexact(a.value() * b.value())
    t: dict[tuple[int, int], Fraction] = {}
    for (r1, k1), c1 in a.terms.items():
        for (r2, k2), c2 in b.terms.items():
            g = math.gcd(r1, r2)  # sqrt(r1*r2) = g*sqrt(r1/g * r2/g), both square-free
            key = ((r1 // g) * (r2 // g), k1 + k2)
            v = t.get(key, 0) + c1 * c2 * g
            if v:
                t[key] = v
            else:
                t.pop(key, None)
    return _exact(t)


def _inv(a: _Num) -> _Num:
    if a.terms is not None and len(a.terms) == 1:
        (r, k), c = next(iter(a.terms.items()))
        return _exact({(r, -k): 1 / (c * r)})  # 1/(c sqrt r) = sqrt r / (c r)
    if a.terms is not None and len(a.terms) == 2:
        (k1, c1), (k2, c2) = sorted(a.terms.items())
        if k1[0] == 1 and k1[1] == k2[1]:  # (p + q sqrt r) pi^k: multiply by the conjugate
            r, k = k2
            den = c1 * c1 - c2 * c2 * r
            return _exact({(1, -k): c1 / den, (r, -k): -c2 / den})
    v = a.value()
    if v == 0:
        raise _Reject
    return _inexact(1.0 / v)


def _sqrt(a: _Num) -> _Num:
    if a.terms is not None and len(a.terms) <= 1:
        if not a.terms:
            return a
        (r, k), c = next(iter(a.terms.items()))
        if c > 0 and r == 1 and k % 2 == 0 and c.numerator * c.denominator < MAX_RADICAND:
            s, rest = _square_split(c.numerator * c.denominator)
            return _exact({(rest, k // 2): Fraction(s, c.denominator)})
    v = a.value()
    if v < 0:
        raise _Reject
    return _inexact(math.sqrt(v))


def _pow(a: _Num, e: _Num) -> _Num:
    q = e.rational()
    if q is not None and q.denominator in (1, 2) and abs(q.numerator) <= MAX_EXP:
        n = abs(q.numerator)
        if a.terms is not None:
            size = max([1] + [c.numerator.bit_length() + c.denominator.bit_length()
                              + r.bit_length() for (r, _), c in a.terms.items()])
            if n * size * len(a.terms) ** 2 > 4 * MAX_BITS:
                raise _Reject
        out, base = _rat(Fraction(1)), a
        while n:  # square and multiply
            if n & 1:
                out = _mul(out, base)
            n >>= 1
            if n:
                base = _mul(base, base)
        if q.numerator < 0:
            out = _inv(out)
        return _sqrt(out) if q.denominator == 2 else out
    base, x = a.value(), e.value()
    if base <= 0 or abs(x) > MAX_EXP:
        raise _Reject
    return _inexact(math.exp(x * math.log(base)) if abs(x * math.log(base)) < 130 else math.inf)


# ----------------------------------------------------------------------------------------------
# Tokens and a recursive-descent parser
# ----------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d{1,3}(?:,\d{3})+(?![\d,])(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
                    r"|\\([A-Za-z]+)|([A-Za-z]+)|(\S))")
_CMDS = {"frac": "frac", "sqrt": "sqrt", "pi": "pi", "cdot": "*", "times": "*", "ast": "*",
         "div": "/"}
_UNICODE = {"√": ("cmd", "sqrt"), "π": ("cmd", "pi"), "·": ("sym", "*"), "×": ("sym", "*"),
            "⋅": ("sym", "*"), "∙": ("sym", "*"), "÷": ("sym", "/"), "−": ("sym", "-"),
            "–": ("sym", "-")}
_SYMS = set("+-*/^(){}[]")


def _tokens(s: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if not m:
            break  # only trailing spaces are left
        pos = m.end()
        num, cmd, word, sym = m.groups()
        if num is not None:
            if len(num) > 40:
                raise _Reject
            out.append(("num", num.replace(",", "")))
        elif cmd is not None:
            if cmd not in _CMDS:
                raise _Reject
            c = _CMDS[cmd]
            out.append(("sym", c) if c in "*/" else ("cmd", c))
        elif word is not None:
            if word.lower() in ("sqrt", "pi"):
                out.append(("cmd", word.lower()))
            elif len(word) == 1:
                out.append(("var", word))
            else:
                raise _Reject  # words: "or", "and", "cm" left inside, multiple-choice text
        elif sym in _UNICODE:
            out.append(_UNICODE[sym])
        elif sym in "²³":
            out += [("sym", "^"), ("num", "2" if sym == "²" else "3")]
        elif sym in _SYMS:
            out.append(("sym", sym))
        else:
            raise _Reject  # , ; : ! % = < > ± and anything else
        if len(out) > MAX_TOKENS:
            raise _Reject
    return out


_CLOSE = {"(": ")", "{": "}", "[": "]"}


class _Parser:
    def __init__(self, toks: list[tuple[str, str]], env: dict[str, float] | None):
        self.t, self.i, self.env, self.depth = toks, 0, env, 0

    def peek(self, ahead: int = 0) -> tuple[str, str]:
        j = self.i + ahead
        return self.t[j] if j < len(self.t) else ("end", "")

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        self.i += 1
        return tok

    def expect(self, sym: str) -> None:
        if self.take() != ("sym", sym):
            raise _Reject

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Reject

    def parse(self) -> _Num:
        if not self.t:
            raise _Reject
        v = self.expr()
        if self.i != len(self.t):
            raise _Reject
        return v

    def expr(self) -> _Num:
        self.enter()
        v = self.term()
        while self.peek() in (("sym", "+"), ("sym", "-")):
            op = self.take()[1]
            w = self.term()
            v = _add(v, w if op == "+" else _neg(w))
        self.depth -= 1
        return v

    def term(self) -> _Num:
        v = self.unary()
        while True:
            kind, x = self.peek()
            if (kind, x) == ("sym", "*"):
                self.take()
                v = _mul(v, self.unary())
            elif (kind, x) == ("sym", "/"):
                self.take()
                v = _mul(v, _inv(self.unary()))
            elif kind in ("cmd", "var") or (kind == "sym" and x in "({["):
                v = _mul(v, self.power())  # implicit product: 6 \sqrt 2, \frac{5}{3} \pi
            else:
                return v  # a number right after a value ("60 120") is left unparsed: rejected

    def unary(self) -> _Num:
        if self.peek() in (("sym", "-"), ("sym", "+")):
            neg = self.take()[1] == "-"
            self.enter()
            v = self.unary()
            self.depth -= 1
            return _neg(v) if neg else v
        return self.power()

    def power(self) -> _Num:
        base = self.primary()
        if self.peek() == ("sym", "^"):
            self.take()
            base = _pow(base, self.exponent())
        return base

    def exponent(self) -> _Num:
        self.enter()
        if self.peek() in (("sym", "-"), ("sym", "+")):
            neg = self.take()[1] == "-"
            v = self.exponent()
            v = _neg(v) if neg else v
        else:
            v = self.primary(mixed=False)
            if self.peek() == ("sym", "^"):  # right-associative: 2^3^2 = 2^9
                self.take()
                v = _pow(v, self.exponent())
        self.depth -= 1
        return v

    def arg(self) -> _Num:
        if self.peek() == ("sym", "{"):
            return self.primary()
        return self.primary(mixed=False)  # \sqrt 3, \frac 1 2, \sqrt(3)

    def _int_at(self, j: int) -> int | None:
        kind, x = self.peek(j)
        return int(x) if kind == "num" and x.isdigit() else None

    def _mixed_fraction(self) -> Fraction | None:
        """A following proper \\frac{a}{b} or a/b of integers: "4 \\frac { 4 } { 11 }", "4 4/11"."""
        if self.peek() == ("cmd", "frac"):
            if self.peek(1) == ("sym", "{") and self.peek(3) == ("sym", "}") \
                    and self.peek(4) == ("sym", "{") and self.peek(6) == ("sym", "}"):
                a, b, width = self._int_at(2), self._int_at(5), 7
            else:
                a, b, width = self._int_at(1), self._int_at(2), 3
        elif self.peek(1) == ("sym", "/"):
            a, b, width = self._int_at(0), self._int_at(2), 3
        else:
            return None
        if a is None or not b or a >= b:
            return None
        self.i += width
        return Fraction(a, b)

    def primary(self, mixed: bool = True) -> _Num:
        self.enter()
        kind, x = self.take()
        if kind == "num":
            v = Fraction(x)
            if mixed and x.isdigit():
                frac = self._mixed_fraction()
                if frac is not None:
                    v += frac
            out = _rat(v)
        elif kind == "sym" and x in _CLOSE:
            out = self.expr()
            self.expect(_CLOSE[x])
        elif (kind, x) == ("cmd", "frac"):
            num = self.arg()
            out = _mul(num, _inv(self.arg()))
        elif (kind, x) == ("cmd", "sqrt"):
            if self.peek() == ("sym", "["):  # \sqrt[n]{x}
                self.take()
                n = self.expr().rational()
                self.expect("]")
                if n is None or n.denominator != 1 or not 2 <= n <= 6:
                    raise _Reject
                out = _pow(self.arg(), _rat(Fraction(1, int(n)))) if n != 2 else _sqrt(self.arg())
            else:
                out = _sqrt(self.arg())
        elif (kind, x) == ("cmd", "pi"):
            out = _exact({(1, 1): Fraction(1)})
        elif kind == "var" and self.env is not None and x in self.env:
            out = _inexact(self.env[x])
        else:
            raise _Reject
        self.depth -= 1
        return out


def _parse(s: str, env: dict[str, float] | None = None) -> _Num:
    return _Parser(_tokens(s), env).parse()


_LITERAL = re.compile(r"[+-]?\s?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.(\d+))?")


def _decimals(s: str) -> int | None:
    """Digits after the point when ``s`` is a plain number literal (0 for an integer)."""
    m = _LITERAL.fullmatch(s.strip())
    if not m or not re.search(r"\d", s):
        return None
    return len(m.group(1)) if m.group(1) else 0


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------

def _eq(a: _Num, b: _Num) -> bool:
    if a.terms is not None and b.terms is not None:
        return a.terms == b.terms  # the form is canonical: sqrt(r) pi^k are independent over Q
    x, y = a.value(), b.value()
    return abs(x - y) <= 1e-9 * max(1.0, abs(x), abs(y))


def _within(p: _Num, g: _Num, tol: Fraction) -> bool:
    pr, gr = p.rational(), g.rational()
    if pr is not None and gr is not None:
        return abs(pr - gr) <= tol
    x, y = p.value(), g.value()
    return abs(x - y) <= float(tol) + 1e-12 * max(1.0, abs(y))


class _Gold:
    """The gold, parsed once: kind is num, ratio, expr (has letters) or text."""

    def __init__(self, gold: str):
        self.kind, self.val, self.decimals, self.parts = "text", None, None, []
        self.vars: set[str] = set()
        self.vals: list[_Num] = []
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
                self.parts = [_parse(p) for p in s.split(":")]
                self.kind = "ratio"
                return
            self.val = _parse(s)
            self.kind, self.decimals = "num", _decimals(s) or None
            return
        except (_Reject, ArithmeticError, ValueError):
            pass
        s = _clean(gold, strip_units=False)
        letters = _letters(s)
        if letters and not re.search(r"[=<>≤≥≠]|\\", s):
            try:
                self.vals = [_parse(s, env) for env in _envs(letters)]
                self.kind, self.vars = "expr", letters
            except (_Reject, ArithmeticError, ValueError):
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


def _close_to_gold(p: _Num, digits: int | None, g: _Gold) -> bool:
    if _eq(p, g.val):
        return True
    if digits is not None and digits >= 2 and _within(p, g.val, abs(_frac_of(g.val)) / 100):
        return True
    return g.decimals is not None and _within(p, g.val, Fraction(1, 2 * 10 ** g.decimals))


def _frac_of(v: _Num) -> Fraction:
    q = v.rational()
    return q if q is not None else Fraction(v.value())


def _is_formula(s: str) -> bool:
    """An expression in letters ("\\pi r^2"), not a list or a sentence ("81, y", "3 or x")."""
    letters = _letters(s)
    try:
        return bool(letters) and bool(_parse(s, _envs(letters)[0]))
    except (_Reject, ArithmeticError, ValueError):
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
        vals = [_parse(p) for p in pieces]
        if any(_eq(v, _rat(Fraction(0))) for v in vals + g.parts):
            return False
        return all(_eq(_mul(v, g.parts[0]), _mul(w, vals[0])) for v, w in zip(vals, g.parts))
    some = False
    for i, part in enumerate(parts):
        if named and i < len(parts) - 1 and _is_formula(part):
            continue  # "A = \\pi r^2 = 25\\pi" (but "5x = 15" states no value)
        p, digits = _parse(part), _decimals(part)
        if _close_to_gold(p, digits, g):
            some = True
        elif not (i > 0 and seps[i - 1] == "≈" and digits is not None
                  and _within(p, g.val, Fraction(1, 2 * 10 ** digits))):
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
        return all(_eq(_parse(s, env), v) for env, v in zip(_envs(g.vars), g.vals))
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
