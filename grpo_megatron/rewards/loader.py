"""Resolve reward functions by name: built-ins or user code by `package.module:function`."""

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from grpo_megatron.rewards.composite import CompositeReward, RewardTerm
from grpo_megatron.rewards.config import BUILTIN_REWARDS, RewardComponentConfig

__all__ = ["BUILTIN_PATHS", "load_reward_fn", "build_composite"]

# Import paths of the built-ins, resolved lazily so that naming one does not import them all.
BUILTIN_PATHS: dict[str, str] = {
    "math_accuracy": "grpo_megatron.rewards.math_accuracy:math_accuracy",
    "format": "grpo_megatron.rewards.format:format_reward",
    "length": "grpo_megatron.rewards.length:length_reward",
    "countdown": "grpo_megatron.rewards.countdown:countdown_reward",
    "gsm8k": "grpo_megatron.rewards.gsm8k:gsm8k_reward",
    "majority": "grpo_megatron.rewards.majority:majority_reward",
    "exact_match": "grpo_megatron.rewards.exact_match:exact_match",
}
assert set(BUILTIN_PATHS) == set(BUILTIN_REWARDS), "config.BUILTIN_REWARDS and BUILTIN_PATHS must agree"


def load_reward_fn(spec: str, field_name: str = "reward.components[].function") -> Callable[..., Any]:
    """The callable named by `spec`: a built-in name or `package.module:function` (the
    attribute path after ':' may be dotted, e.g. `mod:Class.method`). Errors name `field_name`."""
    path = BUILTIN_PATHS.get(spec, spec)
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(
            f"{field_name}={spec!r}: expected a built-in ({', '.join(BUILTIN_PATHS)}) or 'package.module:function'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{field_name}={spec!r}: cannot import module {module_name!r}: {err}") from err
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field_name}={spec!r}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{field_name}={spec!r}: {attr_path!r} is not callable")
    return obj


def build_composite(components: Sequence[RewardComponentConfig]) -> CompositeReward:
    """The CompositeReward of configured components (imports user modules)."""
    terms = tuple(
        RewardTerm(
            name=c.name,
            fn=load_reward_fn(c.function, f"reward.components[{i}].function"),
            weight=float(c.weight),
            kwargs=dict(c.kwargs),
        )
        for i, c in enumerate(components)
    )
    return CompositeReward(terms)
