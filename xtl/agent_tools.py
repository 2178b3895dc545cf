"""Built-in tools for agent loops: :func:`calculator` (exact arithmetic, in process) and :func:`python` (runs code:
declare it with ``subprocess: true`` so each call runs in a limited process that is killed at its time-out).

Kept outside :mod:`xtl.rl` so that a tool's subprocess imports only this small module.
"""

from __future__ import annotations

import ast
import contextlib
import io
import operator
import warnings


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Integers or decimals with + - * / // % ** and parentheses, e.g. "123 * 456".
    """
    with warnings.catch_warnings():  # a model's "0x1for 2" is a bad expression, not a warning in the trainer's log
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(expression.strip(), mode="eval")
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def python(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: A Python program; print the values you need.
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<tool>", "exec"), {"__name__": "__tool__"})  # noqa: S102 - the point of the tool
    return out.getvalue()


# ---- private ---------------------------------------------------------------------------------------------------

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_MAX_EXPONENT = 64


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")
