"""Reward phase (``time/reward``): rank 0 scores every response in sandboxed workers and broadcasts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_megatron.distributed.collectives import on_rank0
from grpo_megatron.rewards.base import RewardSample, attach_groups
from grpo_megatron.rewards.pool import report_failures
from grpo_megatron.rollout.engine import Completion

if TYPE_CHECKING:
    from grpo_megatron.data import PromptRecord
    from grpo_megatron.rewards.config import RewardConfig
    from grpo_megatron.rewards.pool import RewardPool


@dataclass
class Group:
    """One prompt with its G scored responses."""

    record: PromptRecord
    completions: list[Completion]
    rewards: list[float]
    texts: list[str]
    """The decoded responses on rank 0 (the sample log); empty strings elsewhere."""


@dataclass
class Scored:
    """The reward phase's result: groups in prompt order and the reward metrics
    (``reward/<component>``, ``reward/<component>/error_frac``)."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Scorer:
    """What the reward phase acts on: the tokenizer that decodes responses, rank 0's reward pool."""

    tokenizer: Any
    pool: RewardPool | None
    """Only on global rank 0 (it scores for everyone and broadcasts); None elsewhere."""
    cfg: RewardConfig

    def score(self, records: Sequence[PromptRecord], completions: list[list[Completion]]) -> Scored:
        """Rewards of every completion (rank 0's reward pool, broadcast), grouped per prompt. The
        responses are decoded on rank 0 only (``Group.texts`` is empty elsewhere): the others may hold
        only the completions' headers (``RolloutFleet.generate``'s ``payload``)."""
        texts = [
            [
                self.tokenizer.decode(c.token_ids, skip_special_tokens=True) if self.pool is not None else ""
                for c in cs
            ]
            for cs in completions
        ]

        def score_all() -> tuple[list[float], dict[str, float]]:
            assert self.pool is not None  # rank 0 holds the pool
            samples = [
                RewardSample(
                    prompt=r.prompt,
                    response=t,
                    label=r.answer,
                    metadata=dict(r.metadata),
                    response_len_tokens=len(c.token_ids),
                )
                for r, cs, ts in zip(records, completions, texts, strict=True)
                for c, t in zip(cs, ts, strict=True)
            ]
            group_size = len(completions[0]) if completions else 1
            batch = self.pool.score_detailed(attach_groups(samples, group_size))
            report_failures(batch, self.cfg)  # prints the first failure; stops past reward.max_error_frac
            return batch.rewards, batch.metrics

        rewards, metrics = on_rank0(score_all, "reward scoring")
        # A multi-turn environment's own rewards (rollout/multiturn.py) add to the pool's.
        env_rewards = [getattr(c, "env_reward", None) for cs in completions for c in cs]
        if any(r is not None for r in env_rewards):
            rewards = [x + (e or 0.0) for x, e in zip(rewards, env_rewards, strict=True)]
        groups, k = [], 0
        for r, cs, ts in zip(records, completions, texts, strict=True):
            groups.append(Group(r, cs, list(rewards[k : k + len(cs)]), ts))
            k += len(cs)
        return Scored(groups, metrics)
