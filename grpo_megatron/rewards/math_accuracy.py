"""Accuracy reward: math-verify equivalence of the model's final answer with the gold answer.

The answer is the content of the last \\boxed{} (inside <answer> tags if present) or of the
<answer> tags; both are searched in a bounded tail of the response (base.py). The gold answer
is wrapped in $...$ unless it is a plain number, because math-verify's parser otherwise
reads e.g. "(1, 2)" as 2 and "(x+1)^2" as nothing (../shared/GUIDE.md section 1).
"""

import re
import threading

from grpo_megatron.rewards.base import MAX_ANSWER_CHARS, RewardSample, extract_final_answer, is_math_bomb

__all__ = ["math_accuracy", "wrap_latex", "answers_match"]

_PLAIN_NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
_PLAIN_WORDS_RE = re.compile(r"^[A-Za-z][A-Za-z ]*[A-Za-z]$")


def wrap_latex(answer: str) -> str:
    """`answer` as math-verify should parse it: plain numbers as they are, strings that are
    already delimited ($...$, \\(...\\), \\[...\\], \\boxed{...}) as they are, plain words of two
    or more letters as $\\text{...}$ (else "ab" would parse as the product a*b and equal "ba"),
    anything else in $...$."""
    s = answer.strip()
    if _PLAIN_NUMBER_RE.match(s):
        return s
    if _PLAIN_WORDS_RE.match(s):
        return f"$\\text{{{s}}}$"
    if s.startswith("$") or s.startswith("\\(") or s.startswith("\\[") or "\\boxed" in s:
        return s
    return f"${s}$"


def answers_match(gold: str, pred: str) -> bool:
    """math-verify's verdict on whether `pred` is equivalent to `gold` (both bare answers). A
    `pred` that would make sympy build an astronomically large number (base.is_math_bomb, e.g.
    9^{9^{9}}) is refused before parsing: it cannot be right, and evaluating it would cost the
    pool's whole timeout and a worker restart."""
    from math_verify import parse, verify  # lazy: sympy import costs ~0.3 s

    if not gold.strip() or not pred.strip() or len(pred) > MAX_ANSWER_CHARS or is_math_bomb(pred):
        return False
    # math-verify enforces its own time limits with SIGALRM, which only works in the main
    # thread; elsewhere the pool's per-sample timeout is the only limit.
    in_main = threading.current_thread() is threading.main_thread()
    limit = 5 if in_main else None
    gold_parsed = parse(wrap_latex(gold), parsing_timeout=limit)
    pred_parsed = parse(wrap_latex(pred), parsing_timeout=limit)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=limit))


def math_accuracy(sample: RewardSample) -> float:
    """1.0 if the final answer (\\boxed{} or <answer>) is math-verify-equivalent to
    `sample.label`, else 0.0 (also when there is no answer or no label)."""
    if sample.label is None:
        return 0.0
    pred = extract_final_answer(sample.response)
    if pred is None:
        return 0.0
    return 1.0 if answers_match(str(sample.label), pred) else 0.0
