"""Advantages phase (``time/advantages``): rewards -> group-relative advantages -> trainer samples,
and the split of the batch into mini-batches, data-parallel shares and micro-batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from grpo_megatron.algorithm.advantages import advantages_from_config
from grpo_megatron.algorithm.batch_shaping import overlong_penalty
from grpo_megatron.algorithm.policy_loss import normalizer_of_counts
from grpo_megatron.rollout.results import fill
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
    """The trainer's samples of one iteration and the advantage metrics (``advantage/abs_mean``,
    DAPO's ``overlong/*``). ``prepare_update``'s: this rank's data-parallel replica's samples only, in
    ``UpdatePlan.mine`` order (its plan's rows index them); ``build_samples``': every sample."""

    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)
    size: int = 0
    """Samples in the whole batch (every replica's)."""
    tokens: int = 0
    """Prompt and response tokens of the whole batch."""


def batch_advantages(
    alg: AlgorithmConfig, max_new_tokens: int, groups: Sequence[Group]
) -> tuple[list[float], dict[str, float]]:
    """Rewards (+ DAPO overlong penalty, whose default length is ``max_new_tokens``) -> group-relative
    advantages, one per response in group order; and their metrics. Reads only the rewards and the
    responses' lengths (a completion's header is enough)."""
    rewards_b = torch.tensor([x for g in groups for x in g.rewards], dtype=torch.float32)
    lengths_b = torch.tensor([c.num_tokens for g in groups for c in g.completions], dtype=torch.float32)
    metrics: dict[str, float] = {}
    if alg.overlong.enabled:
        max_len = alg.overlong.max_len or max_new_tokens
        penalty_b, metrics = overlong_penalty(
            lengths_b, max_len, alg.overlong.buffer_len, alg.overlong.penalty
        )
        rewards_b = rewards_b + penalty_b
    group_size = len(groups[0].completions)
    advantages_b = advantages_from_config(rewards_b, group_size, alg)
    metrics["advantage/abs_mean"] = float(advantages_b.abs().mean())
    return advantages_b.tolist(), metrics


def build_samples(
    alg: AlgorithmConfig,
    max_new_tokens: int,
    groups: Sequence[Group],
    only: Sequence[int] | None = None,
    advantages: tuple[list[float], dict[str, float]] | None = None,
) -> Batch:
    """Rewards -> advantages (``batch_advantages``, unless given) -> trainer samples: of every response
    in group order, or of those ``only`` lists (their tokens must be on this rank)."""
    advantages_b, metrics = advantages or batch_advantages(alg, max_new_tokens, groups)
    pairs = [(g.record.prompt_ids, c) for g in groups for c in g.completions]
    indices = range(len(pairs)) if only is None else only
    chosen = [pairs[i] for i in indices]
    samples = make_samples(
        [p for p, _ in chosen],
        [c.token_ids for _, c in chosen],
        [c.logprobs for _, c in chosen],
        [advantages_b[i] for i in indices],
        [c.routed_experts for _, c in chosen],
        [c.loss_mask for _, c in chosen],
    )
    tokens = sum(len(p) + c.num_tokens for p, c in pairs)
    return Batch(samples, metrics, len(pairs), tokens)


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
    """The data-parallel rank that trains each sample of the batch (the same on every rank)."""
    mine: list[int] | None = None
    """``local()``'s plan: the batch's samples this rank's replica trains, in order; ``rows`` index
    this list (and ``Batch.samples``). None: ``rows`` index the whole batch."""

    @property
    def all_rows(self) -> list[list[int]]:
        return [r for minibatch in self.rows for r in minibatch]

    def local(self) -> UpdatePlan:
        """The same plan with ``rows`` renumbered into this replica's samples (``mine``)."""
        mine = sorted({i for r in self.all_rows for i in r})
        at = {i: k for k, i in enumerate(mine)}
        rows = [[[at[i] for i in r] for r in minibatch] for minibatch in self.rows]
        return dataclasses.replace(self, rows=rows, mine=mine)


def plan_update(
    train: TrainConfig, alg: AlgorithmConfig, ps: ParallelState, samples: Sequence[Sample]
) -> UpdatePlan:
    """Split the batch into mini-batches, DP shares and micro-batches (training/batching.py)."""
    return plan_sizes(train, alg, ps, [s.length for s in samples], [int(s.mask_s.sum()) for s in samples])


def plan_sizes(
    train: TrainConfig,
    alg: AlgorithmConfig,
    ps: ParallelState,
    lengths: Sequence[int],
    loss_tokens: Sequence[int],
) -> UpdatePlan:
    """``plan_update`` from each sample's input positions (prompt + response - 1) and loss tokens
    alone: what every rank knows before the samples' tokens reach the replica that trains them."""
    rows, normalizers, every_rank = [], [], []
    owners = [-1] * len(lengths)
    for minibatch in minibatch_slices(len(lengths), train.updates_per_iteration):
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
        normalizers.append(normalizer_of_counts(alg.loss_agg_mode, [loss_tokens[i] for i in minibatch]))
    return UpdatePlan(
        rows, normalizers, train.packing, batch_metrics(lengths, every_rank, train.packing), owners
    )


def sample_sizes(groups: Sequence[Group]) -> tuple[list[int], list[int]]:
    """Each sample's input positions (prompt + response - 1) and loss tokens, from the completions'
    sizes (their headers suffice); ValueError on every rank alike for an empty prompt or response."""
    lengths, loss_tokens = [], []
    for g in groups:
        for c in g.completions:
            if not g.record.prompt_ids or not c.num_tokens:
                raise ValueError("a training sample needs a non-empty prompt and response")
            lengths.append(len(g.record.prompt_ids) + c.num_tokens - 1)
            loss_tokens.append(c.num_sampled)
    return lengths, loss_tokens


def deliver_completions(
    fleet: RolloutFleet, groups: Sequence[Group], plan: UpdatePlan, *, release: Sequence[int] | None = None
) -> None:
    """Collective: the tokens, logprobs and loss masks of the completions this rank's data-parallel
    replica trains (held on their engines' ranks since ``generate(payload="owners")``), filled into
    them here; the other completions stay headers. Afterwards the held completions ``release`` names
    are dropped; None: every held one (``groups.py:Produced.release_payloads``: the asynchronous
    producer's later batches stay held)."""
    completions = [c for g in groups for c in g.completions]
    owners = {
        c.payload_id: fleet.replica_ranks(plan.owners[k])
        for k, c in enumerate(completions)
        if c.payload_id is not None
    }
    got = fleet.deliver_completions(owners, release)
    for c in completions:
        if c.payload_id in got:
            fill(c, got[c.payload_id])


def prepare_update(
    alg: AlgorithmConfig,
    train: TrainConfig,
    max_new_tokens: int,
    ps: ParallelState,
    fleet: RolloutFleet,
    groups: Sequence[Group],
    *,
    release_payloads: Sequence[int] | None = None,
    release_routes: Sequence[int] | None = None,
) -> tuple[Batch, UpdatePlan]:
    """The advantages phase: advantages and the update's plan from the rewards and the completions'
    sizes (on every rank), then this replica's completions delivered to it and made into its
    samples, and (``RolloutFleet.routes``: routing replay r3) their engine routes. Returns this
    replica's ``Batch`` and the ``local()`` plan indexing it. ``max_new_tokens``: the longest response
    (DAPO's overlong default). ``release_payloads`` / ``release_routes``: the held completions and
    routes to drop afterwards (``Produced``'s); None: every held one."""
    advantages = batch_advantages(alg, max_new_tokens, groups)
    plan = plan_sizes(train, alg, ps, *sample_sizes(groups))
    deliver_completions(fleet, groups, plan, release=release_payloads)
    local = plan.local()
    batch = build_samples(alg, max_new_tokens, groups, only=local.mine, advantages=advantages)
    if fleet.routes:  # each sample's engine routes (r3) to the ranks that train it
        deliver_engine_routes(fleet, groups, batch.samples, local, release=release_routes)
    return batch, local


def deliver_engine_routes(
    fleet: RolloutFleet,
    groups: Sequence[Group],
    samples: Sequence[Sample],
    plan: UpdatePlan,
    *,
    release: Sequence[int] | None = None,
) -> None:
    """Collective (``algorithm.routing_replay=r3``): each sample's engine routes, held on its engine's
    rank since the rollout (``SamplingParams.routes``), sent to the ranks of the data-parallel replica
    that trains it, and set as ``Sample.routes["engine"]`` there only (``samples``: every sample of the
    batch, or with a ``local()`` plan its ``mine``). Afterwards the held routes ``release`` names are
    dropped; None: every held route (``groups.py:Produced.release_routes``: the asynchronous
    producer's later batches' routes stay held)."""
    completions = [c for g in groups for c in g.completions]
    owners = {
        c.route_id: fleet.replica_ranks(plan.owners[k])
        for k, c in enumerate(completions)
        if c.route_id is not None and plan.owners[k] >= 0
    }
    routes = fleet.deliver_routes(owners, release)
    at = (
        {i: i for i in range(len(completions))}
        if plan.mine is None
        else {i: k for k, i in enumerate(plan.mine)}
    )
    for k, c in enumerate(completions):
        if c.route_id in routes:
            set_engine_routes(samples[at[k]], routes[c.route_id])
