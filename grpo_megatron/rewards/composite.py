"""Weighted composite of named reward components; every component is logged."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo_megatron.rewards.base import InvalidReward, RewardSample, normalize_reward

__all__ = ["RewardTerm", "CompositeReward", "RewardComponentError"]


class RewardComponentError(RuntimeError):
    """A component raised (`invalid=False`) or returned a non-number/NaN/inf (`invalid=True`)."""

    def __init__(self, name: str, err: BaseException):
        super().__init__(f"reward component {name!r}: {type(err).__name__}: {err}")
        self.component = name
        self.invalid = isinstance(err, InvalidReward)


@dataclass(frozen=True)
class RewardTerm:
    """One resolved component: reward = weight * fn(sample, **kwargs)."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CompositeReward:
    """total = sum_k weight_k * score_k(sample).

    `__call__` returns (total, components) where components maps each term's name to its
    unweighted score, plus `<name>/<key>` for terms that return a dict (their score is the
    dict's "score" entry or the sum of its values, base.normalize_reward). A term that raises
    or returns a non-number makes the whole call raise: the pool then gives the sample its
    fallback reward, so a broken component is never silently read as 0.
    """

    terms: tuple[RewardTerm, ...]

    def __call__(self, sample: RewardSample) -> tuple[float, dict[str, float]]:
        total = 0.0
        components: dict[str, float] = {}
        for term in self.terms:
            try:
                score, sub = normalize_reward(term.fn(sample, **term.kwargs))
            except Exception as err:
                raise RewardComponentError(term.name, err) from err
            components[term.name] = score
            components.update({f"{term.name}/{k}": v for k, v in sub.items()})
            total += term.weight * score
        return total, components
