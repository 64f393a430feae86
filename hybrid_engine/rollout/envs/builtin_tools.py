"""Tools the built-in environments offer: plain functions with type hints and a docstring
(their JSON schema comes from transformers' `get_json_schema`). Standard library only: the
tool runner's child process imports this module and nothing heavier."""

from __future__ import annotations

import ast
import operator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


MAX_BITS = 4096  # the largest integer the calculator computes (1233 digits)


def _bounded(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError(f"a result past {MAX_BITS} bits")
    return value


def _evaluate(node: ast.AST) -> int | float:
    """The value of an arithmetic AST; integers stay within MAX_BITS, so every operation is
    quick (a `**` is refused before it is computed when its result would be larger)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if (
            isinstance(node.op, ast.Pow)
            and isinstance(left, int)
            and isinstance(right, int)
            and abs(left) > 1
            and right * (abs(left).bit_length() - 1) > MAX_BITS
        ):
            raise ValueError(f"{ast.unparse(node)!r}: a result past {MAX_BITS} bits")
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses (integers up
    to 4096 bits).

    Args:
        expression: the expression, for example "12 * (3 + 4)"
    """
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
