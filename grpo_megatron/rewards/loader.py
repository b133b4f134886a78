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
    except (Exception, SystemExit) as err:  # module-level code of user modules may raise anything
        raise ValueError(
            f"{field_name}={spec!r}: importing module {module_name!r} raised {type(err).__name__}: {err}"
        ) from err
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field_name}={spec!r}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{field_name}={spec!r}: {attr_path!r} is not callable")
    return obj


def build_composite(
    components: Sequence[RewardComponentConfig], on_import: Callable[[int], None] | None = None
) -> CompositeReward:
    """The CompositeReward of configured components (imports user modules: the reward pool calls
    this only in its sandboxed workers). `on_import(i)` is called before component i is resolved,
    so that a parent watching an import that hangs can name the component."""
    terms = []
    for i, c in enumerate(components):
        if on_import is not None:
            on_import(i)
        fn = load_reward_fn(c.function, f"reward.components[{i}].function")
        terms.append(RewardTerm(name=c.name, fn=fn, weight=float(c.weight), kwargs=dict(c.kwargs)))
    return CompositeReward(tuple(terms))
