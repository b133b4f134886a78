"""GSM8K-style numeric reward: the final number of the response equals the gold number."""

import re
from fractions import Fraction

from grpo_megatron.rewards.base import RewardSample, extract_final_answer, last_number

__all__ = ["gsm8k_reward", "parse_number"]

_HASH_RE = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUM_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")


def parse_number(text: str) -> Fraction | None:
    """Exact value of a plain number like "1,234", "$5.50", "-3", "12%" (as 12); else None."""
    s = text.strip().replace(",", "").replace("$", "").replace("\\%", "").rstrip("%").rstrip(".").strip()
    s = s.removeprefix("\\text{").removesuffix("}") if s.startswith("\\text{") else s
    if not _NUM_RE.match(s):
        return None
    return Fraction(s)


def _gold_number(label: str) -> Fraction | None:
    # GSM8K's reference solutions end with "#### <answer>"; a bare label is the answer itself.
    found = _HASH_RE.findall(label)
    return parse_number(found[-1] if found else label)


def gsm8k_reward(sample: RewardSample) -> float:
    """1.0 if the response's answer equals the gold number exactly (as fractions), else 0.0.

    The response's answer is, in order: the number after the last "####" in the tail, the
    \\boxed{}/<answer> content, the last number in the last 512 characters."""
    if sample.label is None:
        return 0.0
    gold = _gold_number(str(sample.label))
    if gold is None:
        return 0.0
    tail = sample.response[-2048:]
    found = _HASH_RE.findall(tail)
    candidate = found[-1] if found else extract_final_answer(sample.response)
    pred = parse_number(candidate) if candidate is not None else None
    if pred is None:
        number = last_number(tail if candidate is None else candidate) or last_number(tail)
        pred = parse_number(number) if number is not None else None
    return 1.0 if pred is not None and pred == gold else 0.0
