"""A safe arithmetic evaluator for the `tool_calc` workflow: numbers and + - * / // % ** , nothing else.

What: `calc("3 * (4 + 5)") -> "27"`; `calc("1/0") -> CalcError`. The expression is parsed with `ast` and
walked node by node over an allow-list (numbers, the binary operators above, unary + and -, parentheses);
every other node (names, calls, attributes, subscripts, comprehensions, strings) is refused. Exact rational
arithmetic (fractions.Fraction); bounds on the text length, the nesting depth, every intermediate's size and
the exponent keep a hostile expression ("9**9**9", a 10k-deep nest) from eating memory or time.
Why never eval(): the expression is model output, i.e. untrusted text.
Run: python -c "from areal_mq.workflows.calc import calc; print(calc('2**10 // 3'))"
"""
from __future__ import annotations

import ast
import operator
from fractions import Fraction

from areal_mq.grading import format_number

MAX_CHARS = 200
MAX_DEPTH = 32
MAX_ABS = 10 ** 18
MAX_EXPONENT = 64

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """The expression is not plain bounded arithmetic, or has no value (division by zero)."""


def calc(expr: str) -> str:
    """The value of `expr` as a canonical number string (integers plain, fractions as decimals)."""
    text = expr.strip().replace("×", "*").replace("÷", "/").replace(",", "")
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("not an arithmetic expression") from None
    return format_number(_value(tree.body, 0))


def _value(node: ast.AST, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise CalcError(f"expression nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        try:
            return _bounded(Fraction(node.value))
        except (OverflowError, ValueError):  # 1e999 parses as inf
            raise CalcError("number too large") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _value(node.left, depth + 1), _value(node.right, depth + 1)
        return _bounded(_apply(node.op, left, right))
    raise CalcError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def _apply(op: ast.operator, left: Fraction, right: Fraction) -> Fraction:
    if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
        raise CalcError("division by zero")
    if isinstance(op, ast.Pow):
        if right.denominator != 1 or abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponents must be integers of at most {MAX_EXPONENT}")
        if left == 0 and right < 0:
            raise CalcError("division by zero")
        if abs(left.numerator) > MAX_ABS or left.denominator > MAX_ABS:
            raise CalcError("number too large")
    return Fraction(_BINOPS[type(op)](left, right))


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) > MAX_ABS ** 2 or value.denominator > MAX_ABS:
        raise CalcError("number too large")
    return value
