"""Batch shaping from DAPO (Yu et al. 2025): dynamic sampling and soft overlong punishment.

Shape legend: B = responses (P * G), P = prompts (groups), G = responses per prompt; the G
responses of a prompt are contiguous.
"""

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

__all__ = ["informative_groups", "DynamicSampling", "overlong_penalty"]

GroupT = TypeVar("GroupT")


def informative_groups(rewards_b: torch.Tensor, group_size: int, std_threshold: float = 0.0) -> torch.Tensor:
    """keep_p: True for each group whose reward std is > std_threshold.

    A group whose G rewards are all equal has zero advantage for every response and so
    contributes no policy gradient (only KL); DAPO's dynamic sampling drops it. The test is
    max != min (for std_threshold = 0) rather than std > 0, so float noise cannot keep a
    constant group."""
    if rewards_b.numel() % group_size != 0:
        raise ValueError(f"group_size={group_size} does not divide the number of rewards {rewards_b.numel()}")
    rewards_pg = rewards_b.detach().float().view(-1, group_size)
    spread_p = rewards_pg.amax(dim=1) - rewards_pg.amin(dim=1)
    if std_threshold <= 0 or group_size == 1:
        return spread_p > 0
    return (spread_p > 0) & (rewards_pg.std(dim=1) > std_threshold)


class DynamicSampling(Generic[GroupT]):
    """DAPO dynamic sampling: over-sample and keep only groups with reward variance.

    The caller owns the rollout and asks: ``while (n := ds.needed()): ds.add(<n new scored groups>)``,
    then takes ``ds.result()``. Each round asks for the number of groups still missing. Groups whose
    rewards (``group_rewards(group)``) have std <= std_threshold (all equal for 0) are dropped. Rounds
    repeat until ``num_groups`` groups are kept or ``max_tries`` rounds ran (or a round brought no
    group: the prompt source is exhausted); surplus kept groups are cut. When the cap is reached the
    batch is returned smaller than requested (DAPO would keep sampling; a cap keeps an iteration's cost
    bounded) and ``dynamic_sampling/short`` is 1. When no round kept anything, the last round is
    returned as it is (zero advantages: only the KL term moves the policy) rather than nothing, with
    ``dynamic_sampling/fallback`` = 1.

    ``enabled=False``: one round of ``num_groups``, returned as it is, no metrics.

    Metrics: dynamic_sampling/rounds, /groups_sampled, /groups_dropped, /kept_frac (of the
    sampled groups), /short (1 if fewer than num_groups were kept), /num_groups (returned).
    """

    def __init__(
        self,
        num_groups: int,
        group_rewards: Callable[[GroupT], Sequence[float]],
        *,
        enabled: bool = True,
        max_tries: int = 1,
        std_threshold: float = 0.0,
    ) -> None:
        if max_tries < 1:
            raise ValueError(f"algorithm.dynamic_sampling.max_tries={max_tries} must be >= 1")
        self.num_groups = num_groups
        self.group_rewards = group_rewards
        self.enabled = enabled
        self.max_tries = max_tries if enabled else 1
        self.std_threshold = std_threshold
        self.rounds = 0
        """Rounds added so far (the next round's index)."""
        self.kept: list[GroupT] = []
        self.last_round: list[GroupT] = []
        self.sampled = self.dropped = 0
        self.exhausted = False

    def needed(self) -> int:
        """How many groups the next round must bring; 0 when sampling is done."""
        if self.exhausted or self.rounds >= self.max_tries or len(self.kept) >= self.num_groups:
            return 0
        return self.num_groups - len(self.kept)

    def add(self, groups: Sequence[GroupT]) -> None:
        """One round's scored groups."""
        self.rounds += 1
        self.last_round = list(groups)
        self.sampled += len(groups)
        for group in groups:
            rewards = torch.tensor([float(r) for r in self.group_rewards(group)])
            if not self.enabled or bool(informative_groups(rewards, rewards.numel(), self.std_threshold)[0]):
                self.kept.append(group)
            else:
                self.dropped += 1
        if not groups:
            self.exhausted = True

    def result(self) -> tuple[list[GroupT], dict[str, float]]:
        """The kept groups (at most ``num_groups``) and the dynamic_sampling/* metrics."""
        kept = self.kept[: self.num_groups]
        if not self.enabled:
            return kept, {}
        sampled, dropped = self.sampled, self.dropped
        metrics = {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/groups_sampled": float(sampled),
            "dynamic_sampling/groups_dropped": float(dropped),
            "dynamic_sampling/kept_frac": (sampled - dropped) / sampled if sampled else 0.0,
            "dynamic_sampling/short": float(len(kept) < self.num_groups),
            "dynamic_sampling/num_groups": float(len(kept)),
        }
        if not kept:
            kept = list(self.last_round)
            metrics["dynamic_sampling/fallback"] = 1.0
        return kept, metrics


def overlong_penalty(
    response_lengths_b: torch.Tensor,
    max_len: int,
    buffer_len: int,
    penalty: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO soft overlong punishment (eq. 13), added to each response's reward:

        R_len(L) = 0                                     if L <= L_max - L_cache
                 = ((L_max - L_cache) - L) / L_cache * p if L_max - L_cache < L <= L_max
                 = -p                                    if L > L_max
    with L_max = max_len, L_cache = buffer_len, p = penalty. Returns (penalty_b <= 0,
    metrics: overlong/penalized_frac (L in or beyond the buffer), overlong/truncated_frac
    (L >= L_max: the response was most likely cut by the length limit), overlong/penalty_mean).
    """
    if not 0 < buffer_len < max_len:
        raise ValueError(f"overlong buffer_len={buffer_len} must be in (0, max_len={max_len})")
    lengths_b = response_lengths_b.detach().float()
    start = float(max_len - buffer_len)
    ramp_b = (start - lengths_b) / float(buffer_len) * penalty
    penalty_b = torch.where(lengths_b <= start, torch.zeros_like(lengths_b), ramp_b)
    penalty_b = torch.where(lengths_b > max_len, torch.full_like(lengths_b, -penalty), penalty_b)
    n = max(lengths_b.numel(), 1)
    metrics = {
        "overlong/penalized_frac": float((lengths_b > start).sum()) / n,
        "overlong/truncated_frac": float((lengths_b >= max_len).sum()) / n,
        "overlong/penalty_mean": float(penalty_b.mean()) if lengths_b.numel() else 0.0,
    }
    return penalty_b, metrics
