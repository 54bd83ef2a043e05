"""The `calculator` tool: safe arithmetic for geometry problems (docs/multiturn.md, "Tools").

:func:`evaluate` walks the expression's Python syntax tree (``ast``; never eval or exec) and
allows only numbers, ``+ - * / // % **``, unary minus and plus, parentheses, the functions of
:data:`FUNCTIONS` and the constants ``pi`` and ``e``. Trigonometry is in radians as in Python;
``radians(deg)`` / ``degrees(rad)`` convert (Geometry3K's angles are degrees). Work is bounded
before it is done: the expression's length and nesting, integers of at most MAX_INT_BITS bits
(a power is refused before it is computed), round()'s digits. Every refusal or arithmetic
failure is a ToolError with one line for the model.
"""
from __future__ import annotations

import ast
import math
from typing import Any

from envs.tools import ToolError, tool

MAX_CHARS = 500
MAX_DEPTH = 100         # nodes from the root of the syntax tree to its deepest leaf (a+b+c: 3)
MAX_INT_BITS = 1024     # an exact integer of ~308 digits; a float holds up to ~1.8e308 anyway
MAX_ROUND_DIGITS = 30

FUNCTIONS = {"sqrt": math.sqrt, "sin": math.sin, "cos": math.cos, "tan": math.tan,
             "asin": math.asin, "acos": math.acos, "atan": math.atan, "log": math.log,
             "exp": math.exp, "abs": abs, "round": round, "min": min, "max": max,
             "radians": math.radians, "degrees": math.degrees}
CONSTANTS = {"pi": math.pi, "e": math.e}
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
           ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_HINTS = {ast.Attribute: "attributes (a.b)", ast.Subscript: "indexing (a[b])",
          ast.Compare: "comparisons", ast.BoolOp: "and / or", ast.Lambda: "lambda"}

DESCRIPTION = (
    "Evaluate an arithmetic expression and return its value. Allowed: numbers, + - * / // % ** "
    "and parentheses; sqrt, sin, cos, tan, asin, acos, atan (radians), log (natural; log(x, "
    "base)), exp, abs, round, min, max; radians(degrees) and degrees(radians); the constants pi "
    "and e. Example: 0.5*8*6*sin(radians(30)).")


@tool("calculator", DESCRIPTION, {
    "type": "object",
    "properties": {"expression": {"type": "string",
                                  "description": "e.g. sqrt(3**2 + 4**2) or 180 - 2*35"}},
    "required": ["expression"]})
def calculator(expression: str) -> str:
    return evaluate(expression)


def evaluate(expression: str) -> str:
    """The value of `expression`, formatted (:func:`fmt`); ToolError saying why it is refused."""
    if not isinstance(expression, str):
        raise ToolError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ToolError(f"the expression is {len(expression)} characters, over the limit of {MAX_CHARS}")
    if not expression.strip():
        raise ToolError("the expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ToolError(f"not an arithmetic expression ({getattr(e, 'msg', None) or e})") from None
    if _depth(tree.body) > MAX_DEPTH:
        raise ToolError(f"the expression is nested more than {MAX_DEPTH} levels deep")
    try:
        return fmt(_eval(tree.body))
    except (ArithmeticError, ValueError, TypeError) as e:
        raise ToolError(_arith_message(e)) from None


def _depth(node: ast.AST) -> int:
    """Depth of the tree, without recursion (a deep tree must not hit Python's own limit)."""
    deepest, todo = 0, [(node, 1)]
    while todo:
        n, d = todo.pop()
        deepest = max(deepest, d)
        if d <= MAX_DEPTH:
            todo += [(c, d + 1) for c in ast.iter_child_nodes(n)]
    return deepest


def _arith_message(e: Exception) -> str:
    text = " ".join(str(e).split())[:200] or type(e).__name__
    if isinstance(e, ZeroDivisionError):
        return "division by zero"
    if isinstance(e, OverflowError):
        return "the result is too large"
    return text


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ToolError(f"{v!r} is not a number")
        return _checked(v)
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        if node.id in FUNCTIONS:
            raise ToolError(f"{node.id} is a function: call it, e.g. {node.id}(x)")
        raise ToolError(f"unknown name {node.id!r} (known: {', '.join([*CONSTANTS, *FUNCTIONS])})")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _power(_eval(node.left), _eval(node.right))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _checked(_BINARY[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.Call):
        return _call(node)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ToolError("'^' is not a power here: write a**b")
    what = _HINTS.get(type(node)) or type(getattr(node, "op", node)).__name__
    raise ToolError(f"not allowed: {what} (only numbers, + - * / // % **, parentheses, the "
                    "listed functions and pi, e)")

def _call(node: ast.Call) -> int | float:
    if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
        shown = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)[:40]
        raise ToolError(f"{shown!r} is not a known function (known: {', '.join(FUNCTIONS)})")
    name = node.func.id
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        raise ToolError(f"{name}() takes plain arguments only (no name=value, no *args)")
    args = [_eval(a) for a in node.args]
    if name == "round" and len(args) == 2 and not (
            isinstance(args[1], int) and abs(args[1]) <= MAX_ROUND_DIGITS):
        raise ToolError(f"round(x, n): n must be an integer between -{MAX_ROUND_DIGITS} and "
                        f"{MAX_ROUND_DIGITS}")
    try:
        return _checked(FUNCTIONS[name](*args))
    except (ArithmeticError, ValueError, TypeError) as e:
        raise ToolError(f"{name}: {_arith_message(e)}") from None


def _power(base: int | float, exp: int | float) -> int | float:
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1 and (
            (abs(base).bit_length() - 1) * exp > MAX_INT_BITS):
        raise ToolError(f"the power is too large: over {MAX_INT_BITS} bits")
    try:
        v = base ** exp
    except ZeroDivisionError:
        raise ToolError("0 cannot be raised to a negative power") from None
    if isinstance(v, complex):
        raise ToolError("a negative number to a fractional power is not a real number")
    return _checked(v)


def _checked(v: Any) -> int | float:
    """`v` if it is a real number within the bounds, else ToolError."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ToolError(f"the result is not a real number ({type(v).__name__})")
    if isinstance(v, int) and v.bit_length() > MAX_INT_BITS:
        raise ToolError(f"an integer over {MAX_INT_BITS} bits (~{int(MAX_INT_BITS * 0.30103)} digits)")
    if isinstance(v, float) and not math.isfinite(v):
        raise ToolError("the result is too large or undefined (not a finite number)")
    return v


def fmt(v: int | float) -> str:
    """Integers exactly, floats to 10 significant digits without a trailing ".0" (5.0 -> "5",
    11.999999999999998 -> "12", 1/3 -> "0.3333333333")."""
    if isinstance(v, int):
        return str(v)
    return "0" if v == 0 else f"{v:.10g}"
