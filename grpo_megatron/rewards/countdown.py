"""Countdown verifier: reach the target with the given numbers, each used exactly once, and
only + - * / and parentheses (as in TinyZero's countdown task).

The expression is never passed to eval: it must consist of digits, spaces, + - * / ( ) only,
is parsed with ast.parse(mode="eval"), and is evaluated by a walker that accepts only integer
literals and the four binary operators, in exact rational arithmetic (fractions.Fraction),
so "6 / 4 * 2" equals 3 exactly and there is no float rounding to argue about.
"""

import ast
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

from grpo_megatron.rewards.base import RewardSample, extract_final_answer

__all__ = ["countdown_reward", "safe_arithmetic", "UnsafeExpression"]

MAX_EXPRESSION_CHARS = 200  # a countdown expression over <= 6 numbers is far shorter
_ALLOWED_CHARS_RE = re.compile(r"^[0-9+\-*/() ]+$")
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class UnsafeExpression(ValueError):
    """The expression is not plain integer arithmetic with + - * / and parentheses."""


def _walk(node: ast.AST, literals: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body, literals)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _walk(node.left, literals), _walk(node.right, literals)
        if isinstance(node.op, ast.Div) and right == 0:
            raise UnsafeExpression("division by zero")
        return _OPS[type(node.op)](left, right)
    raise UnsafeExpression(f"{type(node).__name__} is not allowed")


def safe_arithmetic(expression: str) -> tuple[Fraction, list[int]]:
    """Value of `expression` and the integer literals it uses, or UnsafeExpression.
    Unary minus, powers, names, calls, attributes and floats are all rejected."""
    expr = expression.strip()
    if not expr or len(expr) > MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS_RE.match(expr):
        raise UnsafeExpression("only digits, spaces, + - * / and parentheses are allowed")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError) as err:
        raise UnsafeExpression(f"not an expression: {err}") from None
    literals: list[int] = []
    return _walk(tree, literals), literals


def _numbers_and_target(sample: RewardSample) -> tuple[Sequence[int], int]:
    meta = sample.metadata
    if "numbers" not in meta:
        raise ValueError("countdown needs sample.metadata['numbers']")
    target = meta.get("target", sample.label)
    if target is None:
        raise ValueError("countdown needs sample.metadata['target'] or sample.label")
    return [int(n) for n in meta["numbers"]], int(str(target).strip())


def countdown_reward(sample: RewardSample, format_score: float = 0.0) -> float:
    """1.0 if the answer (<answer> or \\boxed{}) is an arithmetic expression over exactly the
    multiset `metadata['numbers']` (each used once) whose value is the target
    (`metadata['target']` or `label`); `format_score` if there is a well-formed expression that
    misses; 0.0 otherwise. A trailing "= <value>" in the answer is ignored."""
    numbers, target = _numbers_and_target(sample)
    answer = extract_final_answer(sample.response)
    if answer is None:
        return 0.0
    expression = answer.split("=")[0]
    try:
        value, used = safe_arithmetic(expression)
    except UnsafeExpression:
        return 0.0
    if Counter(used) != Counter(numbers):
        return format_score
    return 1.0 if value == target else format_score
