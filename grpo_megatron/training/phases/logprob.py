"""Logprob phases (``time/ref_logprob``, ``time/old_logprob``): forward-only logprobs of this rank's
samples under the frozen reference or under pi_old (the policy before this iteration's update).

``PassSettings`` is what every trainer pass of an iteration shares (reference, old policy and the
training passes of phases/train.py): each pass is one call taking it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_megatron.algorithm.truncation import Truncation
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.training.batching import LogprobKind, Sample, collate, scatter_logprobs
from grpo_megatron.training.forward_backward import forward_logprobs
from grpo_megatron.training.phases.advantages import UpdatePlan
from grpo_megatron.training.route_replay import RoutingReplay


@dataclass(frozen=True)
class PassSettings:
    """The settings every trainer pass of a GRPO iteration takes."""

    ps: ParallelState
    pad_id: int
    vocab_size: int
    """The model's vocabulary (logits beyond it are padding)."""
    temperature: float
    """The rollout's sampling temperature: logprobs are of the logits divided by it."""
    replay: RoutingReplay
    """Each pass's MoE routing (training/route_replay.py)."""
    truncation: Truncation = Truncation()
    """The rollout's top-k / top-p / min-p: logprobs are of the truncated distribution it samples from
    (``algorithm/truncation.py``); inactive by default."""


@dataclass
class Logprobs:
    """What a logprob pass computed: the ``[B, S]`` logprobs of each micro-batch of ``rows`` (this
    rank's samples, by index), and the routing metrics it measured (the old-policy pass: the
    iteration's first policy pass; empty otherwise)."""

    kind: LogprobKind
    rows: list[list[int]]
    logprobs_bs: list[torch.Tensor]
    routing_metrics: dict[str, float]

    def store(self, samples: list[Sample]) -> None:
        """Each sample's logprobs as ``Sample.ref_logprobs_s`` or ``old_logprobs_s`` (masked to the
        response positions), where the training passes read them."""
        scatter_logprobs(samples, self.rows, self.logprobs_bs, self.kind)


def logprob_pass(
    model: torch.nn.Module, samples: list[Sample], plan: UpdatePlan, kind: LogprobKind, settings: PassSettings
) -> Logprobs:
    """Collective: ``model``'s logprobs of this rank's samples at the rollout's temperature, for
    ``Sample.ref_logprobs_s`` (kind "ref") or ``old_logprobs_s`` ("old": measures the routing too;
    with r2 its routes are recorded onto the samples as ``Sample.routes["old"]``)."""
    rows = plan.all_rows
    routing, routes = settings.replay.begin(model, kind, [samples[i] for r in rows for i in r])
    microbatches = [collate(samples, r, settings.pad_id, routes, packed=plan.packed) for r in rows]
    outputs = forward_logprobs(
        model,
        microbatches,
        settings.ps,
        vocab_size=settings.vocab_size,
        temperature=settings.temperature,
        truncation=settings.truncation,
        routing=routing,
    )
    routing_metrics = settings.replay.end(routing, samples, rows, measure=kind == "old")
    return Logprobs(kind, rows, [o.logprobs_bs for o in outputs], routing_metrics)
