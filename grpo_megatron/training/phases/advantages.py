"""Advantages phase (``time/advantages``): rewards -> group-relative advantages -> trainer samples,
and the split of the batch into mini-batches, data-parallel shares and micro-batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from grpo_megatron.algorithm.advantages import advantages_from_config
from grpo_megatron.algorithm.batch_shaping import overlong_penalty
from grpo_megatron.algorithm.policy_loss import loss_normalizer
from grpo_megatron.training.batching import (
    Sample,
    all_rank_microbatches,
    batch_metrics,
    make_samples,
    minibatch_slices,
    set_engine_routes,
)

if TYPE_CHECKING:
    from grpo_megatron.algorithm.config import AlgorithmConfig
    from grpo_megatron.distributed.bootstrap import ParallelState
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.config import TrainConfig
    from grpo_megatron.training.phases.reward import Group


@dataclass
class Batch:
    """The trainer's samples of one iteration, in group order, and the advantage metrics
    (``advantage/abs_mean``, DAPO's ``overlong/*``)."""

    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)


def build_samples(alg: AlgorithmConfig, max_new_tokens: int, groups: Sequence[Group]) -> Batch:
    """Rewards (+ DAPO overlong penalty, whose default length is ``max_new_tokens``) -> group-relative
    advantages -> trainer samples."""
    rewards_b = torch.tensor([x for g in groups for x in g.rewards], dtype=torch.float32)
    lengths_b = torch.tensor([len(c.token_ids) for g in groups for c in g.completions], dtype=torch.float32)
    metrics: dict[str, float] = {}
    if alg.overlong.enabled:
        max_len = alg.overlong.max_len or max_new_tokens
        penalty_b, metrics = overlong_penalty(lengths_b, max_len, alg.overlong.buffer_len, alg.overlong.penalty)
        rewards_b = rewards_b + penalty_b
    group_size = len(groups[0].completions)
    advantages_b = advantages_from_config(rewards_b, group_size, alg)
    pairs = [(g.record.prompt_ids, c) for g in groups for c in g.completions]
    samples = make_samples(
        [p for p, _ in pairs], [c.token_ids for _, c in pairs], [c.logprobs for _, c in pairs],
        advantages_b.tolist(), [c.routed_experts for _, c in pairs], [c.loss_mask for _, c in pairs],
    )  # fmt: skip
    metrics["advantage/abs_mean"] = float(advantages_b.abs().mean())
    return Batch(samples, metrics)


@dataclass
class UpdatePlan:
    """This rank's micro-batches (rows into the sample list), per mini-batch, and each mini-batch's
    global loss normaliser (the same on every rank)."""

    rows: list[list[list[int]]]
    normalizers: list[float]
    packed: bool = False
    """Micro-batches are packed sequences (train.packing)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """batch/padding_frac and batch/tokens_per_microbatch over every rank's micro-batches."""
    owners: list[int] = field(default_factory=list)
    """The data-parallel rank that trains each sample (the same on every rank)."""

    @property
    def all_rows(self) -> list[list[int]]:
        return [r for minibatch in self.rows for r in minibatch]


def plan_update(train: TrainConfig, alg: AlgorithmConfig, ps: ParallelState, samples: Sequence[Sample]) -> UpdatePlan:
    """Split the batch into mini-batches, DP shares and micro-batches (training/batching.py)."""
    lengths = [s.length for s in samples]
    rows, normalizers, every_rank = [], [], []
    owners = [-1] * len(samples)
    for minibatch in minibatch_slices(len(samples), train.updates_per_iteration):
        per_rank = all_rank_microbatches(
            lengths,
            minibatch,
            dp_size=ps.dp,
            micro_batch_size=train.micro_batch_size,
            max_tokens=train.max_tokens_per_micro_batch,
            packing=train.packing,
        )
        rows.append(per_rank[ps.dp_rank])
        for dp_rank, microbatches in enumerate(per_rank):
            for i in (i for mb in microbatches for i in mb):
                owners[i] = dp_rank
        every_rank.extend(per_rank)
        # One call over the mini-batch's masks, zero-padded: a count of tokens or sequences, as exact as the sum
        masks = torch.nn.utils.rnn.pad_sequence([samples[i].mask_s for i in minibatch], batch_first=True)
        normalizers.append(loss_normalizer(alg.loss_agg_mode, masks))
    return UpdatePlan(rows, normalizers, train.packing, batch_metrics(lengths, every_rank, train.packing), owners)


def deliver_engine_routes(
    fleet: RolloutFleet, groups: Sequence[Group], samples: Sequence[Sample], plan: UpdatePlan, *,
    release: Sequence[int] | None = None,
) -> None:
    """Collective (``algorithm.routing_replay=r3``): each sample's engine routes, held on its engine's
    rank since the rollout (``SamplingParams.routes``), sent to the ranks of the data-parallel replica
    that trains it, and set as ``Sample.routes["engine"]`` there only. Afterwards the held routes
    ``release`` names are dropped; None: every held route (``groups.py:Produced.release_routes``: the
    asynchronous producer's later batches' routes stay held)."""
    completions = [c for g in groups for c in g.completions]
    owners = {
        c.route_id: fleet.replica_ranks(plan.owners[k])
        for k, c in enumerate(completions)
        if c.route_id is not None and plan.owners[k] >= 0
    }
    routes = fleet.deliver_routes(owners, release)
    for k, c in enumerate(completions):
        if c.route_id in routes:
            set_engine_routes(samples[k], routes[c.route_id])
