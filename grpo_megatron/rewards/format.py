"""Format reward: the response is <think>...</think> followed by <answer>...</answer>.

Checked with str.find on fixed markers instead of one regex over the whole response, so a
megabyte of output is a linear scan, with no backtracking.
"""

from grpo_megatron.rewards.base import RewardSample

__all__ = ["format_reward"]


def format_reward(sample: RewardSample, strict: bool = True) -> float:
    """1.0 if the response has the R1 format, else 0.0.

    strict=True: the response (leading/trailing whitespace aside) is exactly
    `<think>` reasoning `</think>` whitespace `<answer>` answer `</answer>`, with one of each
    tag and a non-empty answer. strict=False: the four tags appear once each, in this order,
    anywhere (text around them allowed). When the prompt already ends with `<think>` (a
    common R1-Zero template), the response may start directly with the reasoning.
    """
    text = sample.response.strip()
    if sample.prompt.rstrip().endswith("<think>") and not text.startswith("<think>"):
        text = "<think>" + text
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    if any(text.count(tag) != 1 for tag in tags):
        return 0.0
    pos = [text.find(tag) for tag in tags]
    if pos != sorted(pos):
        return 0.0
    answer = text[pos[2] + len("<answer>") : pos[3]].strip()
    if not answer:
        return 0.0
    if strict:
        between = text[pos[1] + len("</think>") : pos[2]]
        if pos[0] != 0 or between.strip() or not text.endswith("</answer>"):
            return 0.0
    return 1.0
