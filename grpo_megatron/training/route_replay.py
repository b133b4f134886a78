"""Which MoE routing each trainer pass of a GRPO iteration uses (``algorithm.routing_replay``), and
the routing metrics of the iteration. The mechanics (taps in megatron's routers, token order,
statistics) are ``models/routing.py``; this module only decides, per pass:

| mode | reference pass | old-policy pass | training passes |
|---|---|---|---|
| off | own routing | own routing | own routing |
| r2 | own routing | own routing, recorded onto the samples | replay the old-policy pass's routes |
| r3 | replay the engine's routes | replay the engine's routes | replay the engine's routes |

In every mode the first pass of the current policy over the batch (the old-policy pass when it runs,
else the training pass) compares its routers' own top-k with the engine's routes where the samples
carry them (under r3 only: the GRPO loop fetches the engine's routes only for replay):
``routing/disagreement`` is the fraction of (token, MoE layer) pairs whose expert sets differ. Under
replay the router's own choice is taken on hidden states that earlier replayed layers produced, so it
is "the experts this layer would pick", before its own replay. The same pass gives the expert load
(``routing/load_*``, tokens per expert of the routes actually used, prompt and response tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from grpo_megatron.algorithm.routing_metrics import load_metrics
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.models.routing import RoutingPass, reduce_routing_stats
from grpo_megatron.training.batching import Sample

Role = Literal["ref", "old", "train"]

# Per-layer load keys only for models with at most this many MoE layers (metrics.jsonl stays readable).
PER_LAYER_MAX = 16


@dataclass(frozen=True)
class RoutingReplay:
    """``algorithm.routing_replay`` for one job: the routing each trainer pass uses (``begin``) and
    what it leaves behind (``end``). Every pass of an iteration takes the same object."""

    mode: str
    """off, r2 or r3 (``algorithm.routing_replay``)."""
    ps: ParallelState
    num_experts: int | None
    """The policy's routed experts; None or 0 for a dense model (nothing to replay or measure)."""

    def begin(
        self, model: torch.nn.Module, role: Role, samples: Sequence[Sample]
    ) -> tuple[RoutingPass | None, str | None]:
        """The routing of pass ``role`` over ``model`` and which ``Sample.routes`` its micro-batches
        carry; ``(None, None)`` for a dense model or where nothing is replayed or measured."""
        return routing_pass(self.mode, self.ps, self.num_experts, model, role, samples)

    def end(
        self,
        routing: RoutingPass | None,
        samples: list[Sample],
        rows: Sequence[Sequence[int]],
        *,
        measure: bool,
    ) -> dict[str, float]:
        """Collective, after the pass (``finish_pass``): r2's old-policy routes stored on the samples,
        and with ``measure`` the iteration's routing metrics."""
        return finish_pass(self.mode, self.ps, routing, samples, rows, measure=measure)


def routing_pass(
    mode: str,
    ps: ParallelState,
    num_experts: int | None,
    model: torch.nn.Module,
    role: Role,
    samples: Sequence[Sample],
) -> tuple[RoutingPass | None, str | None]:
    """The routing of pass ``role`` over ``model`` under ``algorithm.routing_replay=mode`` and which
    ``Sample.routes`` its micro-batches carry; ``(None, None)`` for a dense model or where nothing is
    replayed or measured."""
    if not num_experts or ps.cp > 1:
        return None, None
    if mode == "r3":
        missing = sum("engine" not in s.routes for s in samples)
        if missing:
            raise RuntimeError(
                f"algorithm.routing_replay=r3: the rollout engine reported no routes for {missing} of "
                f"{len(samples)} responses (Completion.routed_experts); r3 cannot replay them"
            )
        return RoutingPass(model, ps, replay=True), "engine"
    if role == "ref":
        return None, None
    if mode == "r2" and role == "train":
        return RoutingPass(model, ps, replay=True), "old"
    return RoutingPass(model, ps, replay=False), "engine"


def finish_pass(
    mode: str,
    ps: ParallelState,
    routing: RoutingPass | None,
    samples: list[Sample],
    rows: Sequence[Sequence[int]],
    *,
    measure: bool,
) -> dict[str, float]:
    """Collective. After a pass: with R2's old-policy pass, store its routes on the samples as
    ``routes["old"]``; with ``measure``, the iteration's routing metrics."""
    if routing is None:
        return {}
    try:
        if mode == "r2" and not routing.replay:
            store_own_routes(routing, samples, rows)
        return routing_metrics(routing, ps) if measure else {}
    finally:
        routing.close()


def store_own_routes(routing: RoutingPass, samples: list[Sample], rows: Sequence[Sequence[int]]) -> None:
    """Each sample's own routes from the pass, ``[M, S, K]`` (-1 on other pipeline stages' layers)."""
    for i, mb_rows in enumerate(rows):
        own = routing.own_routes(i)
        for b, k in enumerate(mb_rows):
            sample = samples[k]
            routes_msk = torch.full(
                (routing.num_moe_layers, sample.length, routing.top_k), -1, dtype=torch.int16
            )
            for m, routes_bsk in own.items():
                routes_msk[m] = routes_bsk[b, : sample.length]
            sample.routes["old"] = routes_msk


def routing_metrics(routing: RoutingPass, ps: ParallelState) -> dict[str, float]:
    """Collective: ``routing/disagreement`` and the expert-load metrics of a pass, over all ranks."""
    compare_m2, counts_me = reduce_routing_stats(*routing.stats(), ps)
    out: dict[str, float] = {}
    compared = float(compare_m2[:, 1].sum())
    if compared > 0:
        out["routing/disagreement"] = float(compare_m2[:, 0].sum()) / compared
    out |= load_metrics(counts_me, per_layer=counts_me.shape[0] <= PER_LAYER_MAX)
    return out
