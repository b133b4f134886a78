"""The exact_match reward: the response up to its first end marker equals the label."""

import pytest

from grpo_megatron.rewards.base import RewardSample
from grpo_megatron.rewards.config import BUILTIN_REWARDS, RewardComponentConfig
from grpo_megatron.rewards.exact_match import exact_match
from grpo_megatron.rewards.loader import build_composite, load_reward_fn


def S(response, label="9530", **meta):  # noqa: N802 - short sample factory
    return RewardSample(prompt="042+317=", response=response, label=label, metadata=meta)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("9530", 1.0),
        (" 9530\n", 1.0),  # surrounding whitespace ignored (strip=True)
        ("9530</s>", 1.0),  # decoded with special tokens: cut at eos
        ("9530</s>junk after the end", 1.0),
        ("9530<|im_end|><|endoftext|>", 1.0),
        ("9530<pad><pad>", 1.0),
        ("953", 0.0),
        ("95300", 0.0),  # a prefix match is not a match
        ("0359", 0.0),  # the unreversed sum
        ("", 0.0),
        ("</s>9530", 0.0),  # what follows the end never counts
    ],
)
def test_exact_match(response, expected):
    assert exact_match(S(response)) == expected


def test_strip_stop_and_label_forms():
    assert exact_match(S(" 9530"), strip=False) == 0.0
    assert exact_match(RewardSample(prompt="p", response=" 9530 ", label=" 9530 "), strip=False) == 1.0
    assert exact_match(S("9530;rest"), stop=[";"]) == 1.0  # a list from YAML kwargs
    assert exact_match(S("9530;rest"), stop=";") == 1.0  # a single string
    assert exact_match(S("9530</s>"), stop=()) == 0.0  # no markers: the whole text counts
    assert exact_match(S("9530", label=None)) == 0.0  # nothing to compare with


def test_registered_as_builtin():
    assert "exact_match" in BUILTIN_REWARDS
    assert load_reward_fn("exact_match") is exact_match
    composite = build_composite([RewardComponentConfig(name="correct", function="exact_match", weight=2.0)])
    assert composite(S("9530</s>")) == (2.0, {"correct": 1.0})
    assert composite(S("0359")) == (0.0, {"correct": 0.0})
    RewardComponentConfig(name="correct", function="exact_match").validate("reward.components[0]")
