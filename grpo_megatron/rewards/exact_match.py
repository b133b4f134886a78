"""Exact-answer reward: the response, up to its first end-of-sequence marker, equals the label.

For tasks whose answer is the whole response (the arithmetic generator's reversed sums). The
trainer decodes responses without special tokens, but a response decoded with them (or a model
that writes an end marker as text) is cut at the first marker in `stop`, so what follows the end
of the answer never counts.
"""

from collections.abc import Sequence

from grpo_megatron.rewards.base import RewardSample

__all__ = ["exact_match", "DEFAULT_STOP_STRINGS"]

# End-of-sequence texts of common tokenizers (ours: "</s>"); pad too, in case padding was decoded.
DEFAULT_STOP_STRINGS: tuple[str, ...] = (
    "</s>",
    "<pad>",
    "<eos>",
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
)


def exact_match(
    sample: RewardSample,
    strip: bool = True,
    stop: Sequence[str] = DEFAULT_STOP_STRINGS,
    after: str | None = None,
) -> float:
    """1.0 if the response's text before the first of `stop` equals `sample.label` (both stripped of
    surrounding whitespace with `strip`), else 0.0. A sample without a label scores 0.0. With `after`
    (a multi-turn transcript, e.g. "</result>"), only the text after its last occurrence counts: the
    final answer that follows the last tool result."""
    if sample.label is None:
        return 0.0
    if isinstance(stop, str):  # a single marker written as a plain string in the YAML
        stop = (stop,)
    text = sample.response
    if after:
        text = text[text.rfind(after) + len(after) :] if after in text else text
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    if cuts:
        text = text[: min(cuts)]
    label = str(sample.label)
    if strip:
        text, label = text.strip(), label.strip()
    return 1.0 if text == label else 0.0
