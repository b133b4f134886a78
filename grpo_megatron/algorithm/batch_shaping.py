"""Batch shaping from DAPO (Yu et al. 2025): dynamic sampling and soft overlong punishment.

Shape legend: B = responses (P * G), P = prompts (groups), G = responses per prompt; the G
responses of a prompt are contiguous.
"""

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__ = ["informative_groups", "dynamic_sampling", "overlong_penalty"]

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


def dynamic_sampling(
    sample_round: Callable[[int], Sequence[GroupT]],
    group_rewards: Callable[[GroupT], Sequence[float]],
    num_groups: int,
    *,
    max_tries: int,
    std_threshold: float = 0.0,
) -> tuple[list[GroupT], dict[str, float]]:
    """DAPO dynamic sampling: over-sample and keep only groups with reward variance.

    Each round calls `sample_round(n)` with n = the number of groups still missing; it
    returns up to n groups (prompts with their G scored responses; the type is the caller's).
    Groups whose rewards (`group_rewards(group)`) have std <= std_threshold (all equal for 0)
    are dropped. Rounds repeat until `num_groups` groups are kept or `max_tries` rounds ran;
    surplus kept groups are cut. When the cap is reached the batch is returned smaller than
    requested (DAPO would keep sampling; a cap keeps an iteration's cost bounded) and
    `dynamic_sampling/short` is 1.

    Metrics: dynamic_sampling/rounds, /groups_sampled, /groups_dropped, /kept_frac (of the
    sampled groups), /short (1 if fewer than num_groups were kept), /num_groups (returned).
    """
    if max_tries < 1:
        raise ValueError(f"algorithm.dynamic_sampling.max_tries={max_tries} must be >= 1")
    kept: list[GroupT] = []
    sampled = dropped = rounds = 0
    while len(kept) < num_groups and rounds < max_tries:
        rounds += 1
        groups = list(sample_round(num_groups - len(kept)))
        sampled += len(groups)
        for group in groups:
            rewards = torch.tensor([float(r) for r in group_rewards(group)])
            if bool(informative_groups(rewards, rewards.numel(), std_threshold)[0]):
                kept.append(group)
            else:
                dropped += 1
        if not groups:
            break  # the prompt source is exhausted
    kept = kept[:num_groups]
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/groups_sampled": float(sampled),
        "dynamic_sampling/groups_dropped": float(dropped),
        "dynamic_sampling/kept_frac": (sampled - dropped) / sampled if sampled else 0.0,
        "dynamic_sampling/short": float(len(kept) < num_groups),
        "dynamic_sampling/num_groups": float(len(kept)),
    }
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
