"""Built-in rewards, the composite, the loader and the reward protocol (in-process)."""

import math
import time
from fractions import Fraction

import pytest

from grpo_megatron.rewards.base import (
    InvalidReward,
    RewardSample,
    attach_groups,
    extract_boxed,
    extract_final_answer,
    extract_tag,
    is_math_bomb,
    normalize_reward,
)
from grpo_megatron.rewards.composite import RewardComponentError
from grpo_megatron.rewards.config import RewardComponentConfig as C
from grpo_megatron.rewards.countdown import UnsafeExpression, countdown_reward, safe_arithmetic
from grpo_megatron.rewards.format import format_reward
from grpo_megatron.rewards.gsm8k import gsm8k_reward
from grpo_megatron.rewards.length import length_reward
from grpo_megatron.rewards.loader import build_composite, load_reward_fn
from grpo_megatron.rewards.majority import majority_reward
from grpo_megatron.rewards.math_accuracy import answers_match


def S(response, label=None, prompt="q", **meta):  # noqa: N802 - short sample factory
    return RewardSample(prompt=prompt, response=response, label=label, metadata=meta)


# ---- extraction ---------------------------------------------------------------------------


def test_extractors():
    assert extract_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_boxed("\\fbox{7}") == "7"
    assert extract_tag("<answer>1</answer> <answer> 2 </answer>") == "2"
    assert extract_tag("<answer>1") is None
    assert extract_final_answer("<answer>The result is \\boxed{5}</answer>") == "5"
    assert extract_final_answer("no answer here") is None
    assert extract_boxed("\\boxed{" + "1" * 5000 + "}") is None  # over MAX_ANSWER_CHARS


def test_normalize_reward():
    assert normalize_reward(1) == (1.0, {})
    assert normalize_reward(True) == (1.0, {})
    assert normalize_reward({"a": 1.0, "b": 2.0}) == (3.0, {"a": 1.0, "b": 2.0})
    assert normalize_reward({"score": 0.5, "x": 9.0})[0] == 0.5
    for bad in (float("nan"), float("inf"), "1.0", None, [1.0], {"a": float("nan")}, {}):
        with pytest.raises(InvalidReward):
            normalize_reward(bad)


def test_attach_groups():
    samples = [S(str(i)) for i in range(4)]
    out = attach_groups(samples, 2)
    assert out[0].group_responses == ("0", "1") and out[3].group_responses == ("2", "3")
    with pytest.raises(ValueError, match="group_size=3"):
        attach_groups(samples, 3)


# ---- format / length ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "response,strict,expected",
    [
        ("<think>reason</think><answer>4</answer>", True, 1.0),
        ("  <think>reason</think>\n<answer>4</answer>\n", True, 1.0),
        ("<think>reason</think><answer> </answer>", True, 0.0),
        ("<answer>4</answer><think>reason</think>", True, 0.0),
        ("<think>a</think><think>b</think><answer>4</answer>", True, 0.0),
        ("hello <think>reason</think> so <answer>4</answer> bye", True, 0.0),
        ("hello <think>reason</think> so <answer>4</answer> bye", False, 1.0),
        ("no tags at all", False, 0.0),
    ],
)
def test_format(response, strict, expected):
    assert format_reward(S(response), strict=strict) == expected


def test_format_prompt_ending_in_think():
    assert format_reward(RewardSample("Q: ... <think>", "reason</think><answer>4</answer>")) == 1.0


def test_length_capped():
    assert length_reward(S("<think>" + "x" * 50 + "</think><answer>1</answer>"), target_chars=100) == 0.5
    assert length_reward(S("<think>" + "x" * 500 + "</think>"), target_chars=100) == 1.0
    assert length_reward(S("y" * 25), target_chars=100, max_reward=0.4) == pytest.approx(0.1)


# ---- countdown ----------------------------------------------------------------------------


def test_safe_arithmetic():
    assert safe_arithmetic("(6 / 4) * 2") == (Fraction(3), [6, 4, 2])
    assert safe_arithmetic("((3))+5") == (Fraction(8), [3, 5])


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('x')",
        "2 ** 100",
        "-3 + 5",
        "1.5 * 2",
        "abs(3)",
        "3 // 2",
        "(1).__class__",
        "1; 2",
        "3 / (2 - 2)",
        "",
        "(" * 150 + "1" + ")" * 150,
    ],
)
def test_safe_arithmetic_rejects(expr):
    with pytest.raises(UnsafeExpression):
        safe_arithmetic(expr)


@pytest.mark.parametrize(
    "answer,expected",
    [
        ("(25 - 1) * (3 - 2)", 1.0),
        ("(25 - 1) * (3 - 2) = 24", 1.0),
        ("25 - 1 + 3 - 2", 0.1),  # valid, uses every number once, wrong value
        ("25 - 1", 0.1),  # does not use every number
        ("(25 - 1) * (3 - 2) * 1", 0.1),  # uses 1 twice
        ("__import__('os').system('x')", 0.0),
        ("24", 0.1),
    ],
)
def test_countdown(answer, expected):
    sample = S(f"<think>...</think><answer>{answer}</answer>", label="24", numbers=[25, 1, 3, 2])
    assert countdown_reward(sample, format_score=0.1) == expected


def test_countdown_target_in_metadata_and_missing_numbers():
    assert countdown_reward(S("<answer>6 / 3</answer>", numbers=[3, 6], target=2)) == 1.0
    with pytest.raises(ValueError, match="numbers"):
        countdown_reward(S("<answer>1</answer>", label="1"))


# ---- gsm8k / majority ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "Janet ... <<3+4=7>>7 apples.\n#### 7", 1.0),
        ("The answer is 1,234.", "1234", 1.0),
        ("So it costs $5.50.", "5.5", 1.0),
        ("\\boxed{72}", "#### 72", 1.0),
        ("It is 72, not 73", "72", 0.0),  # the last number counts
        ("#### 8", "7", 0.0),
        ("no number", "7", 0.0),
        ("12", None, 0.0),
    ],
)
def test_gsm8k(response, label, expected):
    assert gsm8k_reward(S(response, label)) == expected


def test_majority_vote():
    group = ("\\boxed{4}", "\\boxed{ 4 }", "\\boxed{5}", "<answer>$4$</answer>", "nothing")
    samples = attach_groups([S(r) for r in group], len(group))
    assert [majority_reward(s) for s in samples] == [1.0, 1.0, 0.0, 1.0, 0.0]
    no_consensus = attach_groups([S("\\boxed{1}"), S("\\boxed{2}")], 2)
    assert [majority_reward(s) for s in no_consensus] == [0.0, 0.0]


# ---- composite and loader -----------------------------------------------------------------


def test_composite_weights_and_components():
    comp = build_composite(
        [
            C(name="accuracy", function="math_accuracy", weight=1.0),
            C(name="format", function="format", weight=0.5),
            C(name="parts", function="tests.reward_helpers:dict_components", weight=2.0),
        ]
    )
    total, parts = comp(S("<think>t</think><answer>\\boxed{2}</answer>", "2"))
    assert parts == {"accuracy": 1.0, "format": 1.0, "parts": 0.75, "parts/a": 0.25, "parts/b": 0.5}
    assert total == pytest.approx(1.0 + 0.5 + 2.0 * 0.75)


def test_composite_failures_are_flagged():
    with pytest.raises(RewardComponentError) as info:
        build_composite([C(name="n", function="tests.reward_helpers:returns_nan")])(S("x"))
    assert info.value.invalid and "'n'" in str(info.value)
    with pytest.raises(RewardComponentError) as info:
        build_composite([C(name="r", function="tests.reward_helpers:raises")])(S("x"))
    assert not info.value.invalid


def test_loader_paths_and_errors():
    assert load_reward_fn("math_verify:parse").__name__ == "parse"
    assert load_reward_fn("format").__name__ == "format_reward"
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute"):
        load_reward_fn("math:no_such_fn")
    with pytest.raises(ValueError, match=r"reward.components\[1\].function"):
        build_composite([C(), C(name="b", function="math:nope")])
    with pytest.raises(ValueError, match="not callable"):
        load_reward_fn("math:pi")


# ---- robustness of the built-ins on a runaway output --------------------------------------


def test_one_megabyte_output_is_cheap_for_every_builtin():
    junk = ("lorem ipsum ((( {{ \\boxed{ 12 " * 40_000)[:1_000_000]
    response = "<think>" + junk + "</think><answer>\\boxed{24}</answer>"
    sample = RewardSample("q", response, "24", {"numbers": [24]}, group_responses=(response,) * 4)
    start = time.monotonic()
    assert math_accuracy_value(sample) == 1.0
    assert format_reward(sample) == 1.0
    assert countdown_reward(sample) == 1.0
    assert gsm8k_reward(sample) == 1.0
    assert majority_reward(sample) == 1.0
    assert length_reward(sample) == 1.0
    assert time.monotonic() - start < 20  # a loose guard against quadratic scans, not a benchmark
    assert math.isfinite(length_reward(S(junk)))
    tag_junk = "<answer> \\boxed{ <think> " * 80_000  # unbalanced tags everywhere
    for fn in (math_accuracy_value, format_reward, gsm8k_reward, majority_reward):
        assert fn(RewardSample("q", tag_junk, "24", group_responses=(tag_junk,))) == 0.0


def math_accuracy_value(sample):
    from grpo_megatron.rewards.math_accuracy import math_accuracy

    return math_accuracy(sample)


@pytest.mark.parametrize(
    "answer",
    [
        "9^{9^{9}}",
        "10^{10^{10}}",
        "2^{2^{100}}",
        "9^{999999999}",
        "99999999999999999999^{999999}",
        "100000000!",
        "(10^{10})!",
        "10^{10}!",
        "{9^{9}}^{9^{9}}",
        "\\frac{1}{9^{9^9}}",
        "\\sqrt{9^{9^{9}}}",
        "9^{9\\cdot 10^{8}}",
        "\\binom{10^{9}}{10^{8}}",
        "e^{10^{10}}",
        "2^{1000000}",
    ],
)
def test_math_bombs_are_refused_before_parsing(answer):
    assert is_math_bomb(answer)
    assert not answers_match("5", answer)


@pytest.mark.parametrize(
    "answer",
    [
        "2^{100}",
        "10^{1000}",
        "2^{10000}",
        "10^{100000}",
        "x^2+1",
        "(x+1)^{2}",
        "2^{-3}",
        "5!",
        "\\binom{10}{3}",
        "e^{i\\pi}",
        "\\frac{1}{2}",
        "1,000,000",
        "123456789012345678901234567890",
    ],
)
def test_ordinary_answers_are_not_bombs(answer):
    assert not is_math_bomb(answer)
