"""Capped reasoning-length reward: longer reasoning earns more, up to a cap."""

from grpo_megatron.rewards.base import RewardSample

__all__ = ["length_reward"]


def length_reward(sample: RewardSample, target_chars: int = 1000, max_reward: float = 1.0) -> float:
    """max_reward * min(len(reasoning) / target_chars, 1), where the reasoning is the text in
    <think>...</think> (or the whole response when the tags are absent), in characters.

    The cap is the point: without it a length bonus rewards padding without bound. Use a
    small weight next to an accuracy reward; counting characters keeps it tokenizer-free."""
    if target_chars < 1:
        raise ValueError(f"target_chars={target_chars} must be >= 1")
    text = sample.response
    start, end = text.find("<think>"), text.find("</think>")
    if start >= 0 and end > start:
        text = text[start + len("<think>") : end]
    return max_reward * min(len(text.strip()) / target_chars, 1.0)
