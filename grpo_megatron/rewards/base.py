"""The reward protocol: what a reward function receives and may return.

A reward function is any picklable-by-reference callable (a module-level function)

    def my_reward(sample: RewardSample, **kwargs) -> float | dict[str, float]

A float is the reward. A dict is a set of named components (logged as `reward/<name>/<key>`);
its reward is the value under "score" if present, else the sum of the values. Anything else
(None, a string, NaN, inf, an exception, a hang) is a failure that the pool replaces with the
configured fallback reward. Functions run in worker processes (pool.py): they must not rely
on state of the trainer process.

Also here: the answer extractors shared by the built-ins. They scan only a bounded tail of the
response, so a megabyte of model output costs the same as a short one.
"""

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

__all__ = [
    "RewardSample",
    "RewardFn",
    "RewardValue",
    "InvalidReward",
    "attach_groups",
    "normalize_reward",
    "extract_boxed",
    "extract_tag",
    "extract_final_answer",
    "ANSWER_TAIL_CHARS",
    "MAX_ANSWER_CHARS",
    "is_math_bomb",
]

# The final answer is searched for in the last ANSWER_TAIL_CHARS characters only.
ANSWER_TAIL_CHARS = 8192
# An extracted answer longer than this is treated as no answer: math-verify (sympy) parsing
# time grows badly with input size, and no real final answer is this long.
MAX_ANSWER_CHARS = 512

RewardValue = float | Mapping[str, float]

# Bounds of `is_math_bomb`: what sympy evaluates in milliseconds, far above any real final answer.
MAX_RESULT_DIGITS = 200_000  # estimated digits of base^exponent
MAX_FACTORIAL_ARG = 10_000  # n! and binomials of larger literals are refused


@dataclass(frozen=True)
class RewardSample:
    """One scored response. Plain data, so it pickles cheaply to a worker."""

    prompt: str
    response: str
    label: str | None = None
    """Gold answer (for verifiable rewards); None for label-free rewards (majority vote)."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Task-specific data, e.g. {"numbers": [3, 5, 7], "target": 24} for countdown."""
    group_responses: tuple[str, ...] = ()
    """All G responses of this sample's prompt (itself included), for group rewards such as
    majority vote; filled by `attach_groups`."""
    response_len_tokens: int | None = None
    """Response length in tokens, if the caller knows it (length rewards)."""


class RewardFn(Protocol):
    def __call__(self, sample: RewardSample, /, **kwargs: Any) -> RewardValue: ...


def attach_groups(samples: Sequence[RewardSample], group_size: int) -> list[RewardSample]:
    """Copies of `samples` with `group_responses` set: the G responses of a prompt are contiguous."""
    if group_size < 1 or len(samples) % group_size:
        raise ValueError(f"group_size={group_size} must divide the number of samples {len(samples)}")
    out: list[RewardSample] = []
    for start in range(0, len(samples), group_size):
        group = tuple(s.response for s in samples[start : start + group_size])
        out.extend(replace(s, group_responses=group) for s in samples[start : start + group_size])
    return out


class InvalidReward(ValueError):
    """A reward function returned something that is not a finite number."""


def _finite_float(value: Any) -> float:
    # bool is an int subclass; True/False as a reward is almost always a bug in user code
    # that still has an obvious meaning, so accept it as 1.0 / 0.0.
    if isinstance(value, bool | int | float):
        out = float(value)
    elif hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        try:  # numpy / torch scalars
            out = float(value.item())
        except (TypeError, ValueError) as err:
            raise InvalidReward(f"reward must be a number, got {type(value).__name__}") from err
    else:
        raise InvalidReward(f"reward must be a number, got {type(value).__name__}")
    if not math.isfinite(out):
        raise InvalidReward(f"reward must be finite, got {out}")
    return out


def normalize_reward(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, components) from a reward function's return value, or InvalidReward for a
    non-number, NaN or inf (the caller turns those into the fallback)."""
    if isinstance(value, Mapping):
        if not value:
            raise InvalidReward("reward dict is empty")
        comps = {str(k): _finite_float(v) for k, v in value.items()}
        total = comps["score"] if "score" in comps else sum(comps.values())
        return total, comps
    return _finite_float(value), {}


def extract_boxed(text: str, tail_chars: int = ANSWER_TAIL_CHARS) -> str | None:
    """Content of the LAST \\boxed{...} (or \\fbox{...}) in the tail of `text`, braces balanced."""
    tail = text[-tail_chars:]
    best = None
    for key in ("\\boxed", "\\fbox"):
        pos = tail.rfind(key)
        if pos > (best[0] if best else -1):
            best = (pos, key)
    if best is None:
        return None
    i = best[0] + len(best[1])
    while i < len(tail) and tail[i] == " ":
        i += 1
    if i >= len(tail) or tail[i] != "{":
        return None
    depth, start = 0, i + 1
    for j in range(i, len(tail)):
        if tail[j] == "{":
            depth += 1
        elif tail[j] == "}":
            depth -= 1
            if depth == 0:
                content = tail[start:j].strip()
                return content if len(content) <= MAX_ANSWER_CHARS else None
    return None


def extract_tag(text: str, tag: str = "answer", tail_chars: int = ANSWER_TAIL_CHARS) -> str | None:
    """Content of the LAST <tag>...</tag> in the tail of `text` (str.rfind: linear time)."""
    tail = text[-tail_chars:]
    close = tail.rfind(f"</{tag}>")
    if close < 0:
        return None
    open_ = tail.rfind(f"<{tag}>", 0, close)
    if open_ < 0:
        return None
    content = tail[open_ + len(tag) + 2 : close].strip()
    return content if len(content) <= MAX_ANSWER_CHARS else None


_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str, tail_chars: int = 512) -> str | None:
    """The last number-looking token in the last `tail_chars` characters, commas removed."""
    found = _NUMBER_RE.findall(text[-tail_chars:])
    return found[-1].replace(",", "") if found else None


def extract_final_answer(text: str) -> str | None:
    """The model's final answer: \\boxed{} inside <answer> if any, else <answer> content,
    else the last \\boxed{} anywhere in the tail."""
    tagged = extract_tag(text, "answer")
    if tagged is not None:
        inner = extract_boxed(tagged)
        return inner if inner is not None else tagged
    return extract_boxed(text)


_INT_RE = re.compile(r"\d+")


def _group_after(text: str, i: int) -> tuple[str, int]:
    """The TeX argument starting at text[i] (after spaces): a balanced {...} group's content, a
    digit run, a \\command or one character; and the index after it."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return "", i
    if text[i] == "{":
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j], j + 1
        return text[i + 1 :], len(text)
    match = re.match(r"\d+|\\[A-Za-z]+|.", text[i:])
    assert match is not None
    return match.group(), i + match.end()


def is_math_bomb(answer: str) -> bool:
    """True if parsing `answer` with math-verify would make sympy build an astronomically large
    number: a power tower (an exponent that itself holds ^ or !, e.g. 9^{9^{9}}), a power whose
    estimated size passes MAX_RESULT_DIGITS digits (9^{999999999}), or a factorial or binomial of
    a huge argument ((10^{10})!, 100000000!, \\binom{10^9}{5}). Such answers cannot be a real
    final answer; refusing them up front costs microseconds, where evaluating them costs the
    pool's whole per-sample timeout and a worker restart (sympy's big-integer arithmetic cannot
    be interrupted)."""
    numbers = _INT_RE.findall(answer)
    longest = max((len(x) for x in numbers), default=1)
    literals = [int(x) for x in numbers if len(x) <= 12] or [0]
    if longest > 12 and ("!" in answer or "\\binom" in answer or "\\choose" in answer):
        return True
    for pos in (m.start() for m in re.finditer(r"\^", answer)):
        exponent, _ = _group_after(answer, pos + 1)
        if "^" in exponent or "!" in exponent or "\\binom" in exponent or "\\uparrow" in exponent:
            return True
        exp_numbers = _INT_RE.findall(exponent)
        if any(len(x) > 12 for x in exp_numbers):
            return True
        exp_value = max((int(x) for x in exp_numbers), default=0)
        base = re.search(r"(\d+)\s*$", answer[:pos])  # a literal base: its own size; else the largest literal
        base_digits = math.log10(max(int(base.group(1)), 2)) if base and len(base.group(1)) <= 12 else longest
        if exp_value * base_digits > MAX_RESULT_DIGITS:
            return True
    if "!" in answer or "\\binom" in answer or "\\choose" in answer:
        if "^" in answer or max(literals) > MAX_FACTORIAL_ARG:
            return True
    return False
