"""Eval phase (``time/eval``): held-out greedy pass@1 and, optionally, mean@k of sampled responses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from grpo_megatron.training.phases.reward import Scorer
from grpo_megatron.training.phases.rollout import Rollout, rollout_seed

if TYPE_CHECKING:
    from grpo_megatron.data import PromptRecord


def evaluate(
    rollout: Rollout,
    scorer: Scorer,
    records: Sequence[PromptRecord],
    *,
    train_seed: int,
    iteration: int,
    samples: int,
) -> dict[str, float]:
    """Held-out accuracy: greedy pass@1 (``eval/accuracy``) and, with ``samples`` = k > 0
    (train.eval_samples), mean@k of sampled responses (``eval/mean@k``). No records: no metrics."""
    if not records:
        return {}
    seed = rollout_seed(train_seed, iteration)
    # Only rank 0 reads the responses (it scores them): the other ranks get their headers.
    greedy = rollout.generate(records, rollout.params(n=1, seed=seed, greedy=True), payload="collector")
    groups = scorer.score(records, greedy).groups
    metrics = {"eval/accuracy": sum(g.rewards[0] for g in groups) / len(groups)}
    if samples > 0:
        sampled = rollout.generate(records, rollout.params(n=samples, seed=seed + 1), payload="collector")
        groups = scorer.score(records, sampled).groups
        metrics[f"eval/mean@{samples}"] = sum(sum(g.rewards) / samples for g in groups) / len(groups)
    return metrics
