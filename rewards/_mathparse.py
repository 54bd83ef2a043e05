"""Exact values of an answer's math, for the Geometry3K verifier (rules: rewards/geometry.py).

:func:`parse` reads an expression into a :class:`Num`: a sum of ``q * sqrt(r) * pi^k`` (rational
``q``, square-free ``r``), a canonical form, or a float where that form cannot hold the value.
No reward is registered here; the package's discovery imports this module like any other.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache

MAX_TOKENS = 160
MAX_DEPTH = 40
MAX_EXP = 64
MAX_BITS = 600         # numerator/denominator bits of an exact coefficient
MAX_RADICAND = 10**12  # square-free split by trial division up to 10^4 stays cheap
MAX_FLOAT = 1e60


class Reject(Exception):
    """The text is not a value this verifier reads."""


# ---- Exact values: sum of q * sqrt(r) * pi^k, or a float where that form cannot hold the value

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


class Num:
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


def _inexact(v: float) -> Num:
    if not isinstance(v, float) or not math.isfinite(v) or abs(v) > MAX_FLOAT:
        raise Reject
    return Num(None, v)


def _exact(terms: dict[tuple[int, int], Fraction]) -> Num:
    if len(terms) > 12:
        raise Reject
    for (r, k), c in terms.items():
        if r > MAX_RADICAND or abs(k) > 8 or c.numerator.bit_length() > MAX_BITS \
                or c.denominator.bit_length() > MAX_BITS:
            return _inexact(Num(terms).value())
    return Num(terms)


def rat(q: Fraction) -> Num:
    return _exact({(1, 0): q} if q else {})


def _add(a: Num, b: Num) -> Num:
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


def _neg(a: Num) -> Num:
    return _inexact(-a.approx) if a.terms is None else Num({k: -c for k, c in a.terms.items()})


def mul(a: Num, b: Num) -> Num:
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


def _inv(a: Num) -> Num:
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
        raise Reject
    return _inexact(1.0 / v)


def _sqrt(a: Num) -> Num:
    if a.terms is not None and len(a.terms) <= 1:
        if not a.terms:
            return a
        (r, k), c = next(iter(a.terms.items()))
        if c > 0 and r == 1 and k % 2 == 0 and c.numerator * c.denominator < MAX_RADICAND:
            s, rest = _square_split(c.numerator * c.denominator)
            return _exact({(rest, k // 2): Fraction(s, c.denominator)})
    v = a.value()
    if v < 0:
        raise Reject
    return _inexact(math.sqrt(v))


def _pow(a: Num, e: Num) -> Num:
    q = e.rational()
    if q is not None and q.denominator in (1, 2) and abs(q.numerator) <= MAX_EXP:
        n = abs(q.numerator)
        if a.terms is not None:
            size = max([1] + [c.numerator.bit_length() + c.denominator.bit_length()
                              + r.bit_length() for (r, _), c in a.terms.items()])
            if n * size * len(a.terms) ** 2 > 4 * MAX_BITS:
                raise Reject
        out, base = rat(Fraction(1)), a
        while n:  # square and multiply
            if n & 1:
                out = mul(out, base)
            n >>= 1
            if n:
                base = mul(base, base)
        if q.numerator < 0:
            out = _inv(out)
        return _sqrt(out) if q.denominator == 2 else out
    base, x = a.value(), e.value()
    if base <= 0 or abs(x) > MAX_EXP:
        raise Reject
    return _inexact(math.exp(x * math.log(base)) if abs(x * math.log(base)) < 130 else math.inf)


def equal(a: Num, b: Num) -> bool:
    if a.terms is not None and b.terms is not None:
        return a.terms == b.terms  # the form is canonical: sqrt(r) pi^k are independent over Q
    x, y = a.value(), b.value()
    return abs(x - y) <= 1e-9 * max(1.0, abs(x), abs(y))


def within(p: Num, g: Num, tol: Fraction) -> bool:
    pr, gr = p.rational(), g.rational()
    if pr is not None and gr is not None:
        return abs(pr - gr) <= tol
    x, y = p.value(), g.value()
    return abs(x - y) <= float(tol) + 1e-12 * max(1.0, abs(y))


# ---- Tokens and a recursive-descent parser

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
                raise Reject
            out.append(("num", num.replace(",", "")))
        elif cmd is not None:
            if cmd not in _CMDS:
                raise Reject
            c = _CMDS[cmd]
            out.append(("sym", c) if c in "*/" else ("cmd", c))
        elif word is not None:
            if word.lower() in ("sqrt", "pi"):
                out.append(("cmd", word.lower()))
            elif len(word) == 1:
                out.append(("var", word))
            else:
                raise Reject  # words: "or", "and", "cm" left inside, multiple-choice text
        elif sym in _UNICODE:
            out.append(_UNICODE[sym])
        elif sym in "²³":
            out += [("sym", "^"), ("num", "2" if sym == "²" else "3")]
        elif sym in _SYMS:
            out.append(("sym", sym))
        else:
            raise Reject  # , ; : ! % = < > ± and anything else
        if len(out) > MAX_TOKENS:
            raise Reject
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
            raise Reject

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Reject

    def parse(self) -> Num:
        if not self.t:
            raise Reject
        v = self.expr()
        if self.i != len(self.t):
            raise Reject
        return v

    def expr(self) -> Num:
        self.enter()
        v = self.term()
        while self.peek() in (("sym", "+"), ("sym", "-")):
            op = self.take()[1]
            w = self.term()
            v = _add(v, w if op == "+" else _neg(w))
        self.depth -= 1
        return v

    def term(self) -> Num:
        v = self.unary()
        while True:
            kind, x = self.peek()
            if (kind, x) == ("sym", "*"):
                self.take()
                v = mul(v, self.unary())
            elif (kind, x) == ("sym", "/"):
                self.take()
                v = mul(v, _inv(self.unary()))
            elif kind in ("cmd", "var") or (kind == "sym" and x in "({["):
                v = mul(v, self.power())  # implicit product: 6 \sqrt 2, \frac{5}{3} \pi
            else:
                return v  # a number right after a value ("60 120") is left unparsed: rejected

    def unary(self) -> Num:
        if self.peek() in (("sym", "-"), ("sym", "+")):
            neg = self.take()[1] == "-"
            self.enter()
            v = self.unary()
            self.depth -= 1
            return _neg(v) if neg else v
        return self.power()

    def power(self) -> Num:
        base = self.primary()
        if self.peek() == ("sym", "^"):
            self.take()
            base = _pow(base, self.exponent())
        return base

    def exponent(self) -> Num:
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

    def arg(self) -> Num:
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

    def primary(self, mixed: bool = True) -> Num:
        self.enter()
        kind, x = self.take()
        if kind == "num":
            v = Fraction(x)
            if mixed and x.isdigit():
                frac = self._mixed_fraction()
                if frac is not None:
                    v += frac
            out = rat(v)
        elif kind == "sym" and x in _CLOSE:
            out = self.expr()
            self.expect(_CLOSE[x])
        elif (kind, x) == ("cmd", "frac"):
            num = self.arg()
            out = mul(num, _inv(self.arg()))
        elif (kind, x) == ("cmd", "sqrt"):
            if self.peek() == ("sym", "["):  # \sqrt[n]{x}
                self.take()
                n = self.expr().rational()
                self.expect("]")
                if n is None or n.denominator != 1 or not 2 <= n <= 6:
                    raise Reject
                out = _pow(self.arg(), rat(Fraction(1, int(n)))) if n != 2 else _sqrt(self.arg())
            else:
                out = _sqrt(self.arg())
        elif (kind, x) == ("cmd", "pi"):
            out = _exact({(1, 1): Fraction(1)})
        elif kind == "var" and self.env is not None and x in self.env:
            out = _inexact(self.env[x])
        else:
            raise Reject
        self.depth -= 1
        return out


def parse(s: str, env: dict[str, float] | None = None) -> Num:
    return _Parser(_tokens(s), env).parse()


_LITERAL = re.compile(r"[+-]?\s?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.(\d+))?")


def decimals(s: str) -> int | None:
    """Digits after the point when ``s`` is a plain number literal (0 for an integer)."""
    m = _LITERAL.fullmatch(s.strip())
    if not m or not re.search(r"\d", s):
        return None
    return len(m.group(1)) if m.group(1) else 0
