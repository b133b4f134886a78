"""Logprob phases (``time/ref_logprob``, ``time/old_logprob``): forward-only logprobs of this rank's
samples under the frozen reference or under pi_old (the policy before this iteration's update)."""

from __future__ import annotations

import torch

from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.models.routing import RoutingPass
from grpo_megatron.training.batching import LogprobKind, Sample, collate, scatter_logprobs
from grpo_megatron.training.forward_backward import forward_logprobs
from grpo_megatron.training.phases.advantages import UpdatePlan


def logprob_pass(
    model: torch.nn.Module,
    samples: list[Sample],
    plan: UpdatePlan,
    kind: LogprobKind,
    *,
    ps: ParallelState,
    pad_id: int,
    vocab_size: int,
    temperature: float,
    routing: RoutingPass | None = None,
    routes: str | None = None,
) -> None:
    """Fill in ``Sample.ref_logprobs_s`` (kind "ref") or ``Sample.old_logprobs_s`` ("old") of this
    rank's samples with ``model``'s logprobs at ``temperature`` (the rollout's). ``routing`` /
    ``routes``: the pass's MoE routing and which ``Sample.routes`` it replays or compares against
    (training/route_replay.py)."""
    rows = plan.all_rows
    microbatches = [collate(samples, r, pad_id, routes, packed=plan.packed) for r in rows]
    outputs = forward_logprobs(
        model, microbatches, ps, vocab_size=vocab_size, temperature=temperature, routing=routing
    )
    scatter_logprobs(samples, rows, [o.logprobs_bs for o in outputs], kind)
