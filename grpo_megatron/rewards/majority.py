"""Majority-vote self-consistency reward (label-free, as in test-time RL / TTRL).

Each response's final answer is compared with the most common final answer among the G
responses of its prompt (`RewardSample.group_responses`, filled by `attach_groups`).
Answers are compared after a light string normalization, not with math-verify: the vote is
O(G) per sample and a parser in the loop would make it O(G) parses per sample.
"""

from collections import Counter

from grpo_megatron.rewards.base import RewardSample, extract_final_answer, last_number

__all__ = ["majority_reward", "normalize_answer"]


def normalize_answer(answer: str) -> str:
    """Strip spaces, $ delimiters, \\left/\\right, trailing periods and thousands commas in numbers."""
    s = answer.strip().strip("$").strip().rstrip(".")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "")
    s = "".join(s.split())
    if s.replace(",", "").replace(".", "").lstrip("-").isdigit():
        s = s.replace(",", "")
    return s


def _answer(response: str) -> str | None:
    ans = extract_final_answer(response)
    if ans is None:
        ans = last_number(response)
    return normalize_answer(ans) if ans else None


def majority_reward(sample: RewardSample, min_votes: int = 2) -> float:
    """1.0 if this response's answer is the group's majority answer, else 0.0. The majority
    is the most frequent non-empty normalized answer (ties: the first seen); with fewer than
    `min_votes` votes for it there is no consensus and every response gets 0."""
    group = sample.group_responses or (sample.response,)
    votes = Counter(a for a in map(_answer, group) if a)
    if not votes:
        return 0.0
    top, count = votes.most_common(1)[0]
    if count < min_votes:
        return 0.0
    return 1.0 if _answer(sample.response) == top else 0.0
