"""math-verify accuracy over a table of answer forms, through the real reward function."""

import pytest

from grpo_megatron.rewards.base import RewardSample
from grpo_megatron.rewards.math_accuracy import math_accuracy, wrap_latex

# (gold label as a dataset would store it, the model's final answer, expected verdict)
TABLE = [
    # integers and formatting
    ("42", "42", True),
    ("42", "42.0", True),
    ("42", "43", False),
    ("1000", "1,000", True),
    ("-3", "-3", True),
    ("10^{3}", "1000", True),
    ("1.5\\times10^{3}", "1500", True),
    # fractions
    ("0.5", "\\frac{1}{2}", True),
    ("\\frac{1}{2}", "0.5", True),
    ("1/2", "\\frac12", True),
    ("\\frac{3}{4}", "\\dfrac{3}{4}", True),
    ("\\frac{1}{2}", "\\frac{1}{3}", False),
    ("\\frac{2}{3}", "0.67", False),
    ("\\frac{1}{3}", "0.333333", True),
    # decimals
    ("3.14", "3.140", True),
    ("0.1", "0.10", True),
    ("3", "3.01", False),
    # percentages
    ("50\\%", "50", True),
    ("50\\%", "50\\%", True),
    ("25\\%", "0.25", True),
    ("0.5", "50\\%", True),
    ("12\\%", "13\\%", False),
    # intervals
    ("[1, 2)", "[1,2)", True),
    ("[1, 2)", "(1, 2)", False),
    ("(-\\infty, 3]", "(-\\infty,3]", True),
    ("x \\in [2, 5]", "[2,5]", True),
    # tuples and sets
    ("(1, 2)", "(1,2)", True),
    ("(1, 2)", "(2, 1)", False),
    ("(1, 2, 3)", "(1,2,3)", True),
    ("\\{1, 2\\}", "\\{2, 1\\}", True),
    ("\\{1,2\\}", "\\{1,3\\}", False),
    ("2, 3", "3, 2", True),
    # LaTeX expressions
    ("\\sqrt{2}", "2^{1/2}", True),
    ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}", True),
    ("2\\pi", "6.28", False),
    ("(x+1)^2", "x^2+2x+1", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("x+1", "x+2", False),
    ("x = 5", "5", True),
    ("5", "x=5", True),
    ("30^\\circ", "30", True),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    # plain text and units
    ("Monday", "Monday", True),
    ("Monday", "Tuesday", False),
    ("\\text{Monday}", "Monday", True),
    ("yes", "Yes", True),
    ("B", "B", True),
    ("B", "C", False),
    ("\\text{(A)}", "A", True),
    ("6 \\text{ cm}", "6", True),
    ("\\$5.50", "5.5", True),
    ("ab", "ba", False),  # words, not the product a*b
]


@pytest.mark.parametrize("gold,pred,expected", TABLE, ids=[f"{g}|{p}" for g, p, _ in TABLE])
def test_boxed_answer_forms(gold, pred, expected):
    sample = RewardSample(
        prompt="q", response=f"Some reasoning. The answer is \\boxed{{{pred}}}.", label=gold
    )
    assert math_accuracy(sample) == (1.0 if expected else 0.0)


def test_table_is_large_enough():
    assert len(TABLE) >= 30 and any(not e for _, _, e in TABLE)


def test_answer_tags_and_no_answer():
    gold = "\\frac{1}{2}"
    assert math_accuracy(RewardSample("q", "<think>hm</think><answer>0.5</answer>", gold)) == 1.0
    assert math_accuracy(RewardSample("q", "<answer>so \\boxed{0.5}</answer>", gold)) == 1.0
    assert math_accuracy(RewardSample("q", "the answer is 0.5", gold)) == 0.0  # no \boxed, no tags
    assert math_accuracy(RewardSample("q", "\\boxed{0.5}", None)) == 0.0
    # the LAST boxed answer counts
    assert math_accuracy(RewardSample("q", "\\boxed{3} no wait \\boxed{0.5}", gold)) == 1.0


def test_gold_wrapping_is_needed():
    # Without $...$, math-verify reads the gold "(1, 2)" as the number 2 (GUIDE section 1).
    from math_verify import parse

    assert parse("(1, 2)")[0] == 2
    assert wrap_latex("(1, 2)") == "$(1, 2)$"
    assert wrap_latex("42") == "42" and wrap_latex("$x$") == "$x$"
