"""Routing replay and route recording in the trainer's megatron-core MoE routers.

megatron-core 0.16.1 gives every ``TopKRouter`` a replay slot, ``router.router_replay``, that its
top-k routing calls as ``get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)``
for whatever score function the model uses (softmax before or after top-k, DeepSeek-V3's sigmoid with
``e_score_correction_bias`` and group-limited top-k): the slot returns the chosen experts and the
scores gathered at them, and megatron derives the routing weights from those. We fill that slot with
a ``RouteTap`` per router instead of megatron's own ``RouterReplay``, for one reason: ``RouterReplay``
registers every instance in a process-wide list and is driven through static methods over that list,
so the policy's routers and the reference's (two models in one process) would share it and replay
each other's routes. A ``RouteTap`` belongs to its router only, and each pass (``RoutingPass``) sets
the targets of the model it runs, before each micro-batch's forward.

What a tap does on every forward: it always computes the router's own top-k (recorded, for the
route-disagreement and expert-load metrics and for R2) and, when the pass gave it targets, returns
those instead. Targets follow their tokens: a micro-batch's routes ``[M, B, S, K]`` (MoE layers of the
whole model, rows, positions, top-k; ``-1`` at padding) are transposed to megatron's
sequence-major token order, cut to this rank's sequence-parallel chunk of positions (TP), and only
this pipeline stage's MoE layers are read (PP). Expert parallelism is downstream of the router (the
dispatcher moves tokens after routing), so EP and ETP need nothing.

Shape legend: M MoE layers, B rows, S positions, K top-k, T tokens of a router call (S/tp * B), E experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.algorithm.routing_metrics import expert_counts, route_mismatches
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.distributed.collectives import collective_device


class RouteTap:
    """Sits in one megatron ``TopKRouter.router_replay`` slot (see the module docstring).

    Within a pass, the first router call after ``RoutingPass.before_microbatch`` is that micro-batch's
    forward: it records the router's own top-k and uses the micro-batch's target. Any further call
    is activation recompute (``model.recompute=full`` re-runs each layer's forward in the backward
    pass, micro-batches in their forward order): it records nothing and routes as that micro-batch's
    forward did (the same target under replay, else the router's own choice again), so the gradient
    follows the routing of the forward."""

    def __init__(self, moe_index: int) -> None:
        self.moe_index = moe_index
        """Index of this router's layer among the model's MoE layers (the M axis of routes)."""
        self.target_tk: torch.Tensor | None = None
        """Experts to use for the next forward; None = the router's own choice."""
        self.own: list[torch.Tensor] = []
        """The router's own top-k of each micro-batch's forward since the pass began, ``[T, K]`` each."""
        self.forward_next = False
        """The next call is a micro-batch's forward (set by ``before_microbatch``); else a recompute."""
        self.used: list[torch.Tensor | None] = []
        """The target each forward of the pass used, replayed by its recompute."""
        self.recomputed = 0
        """Recompute calls since the pass began (the index of the micro-batch the next one re-runs)."""

    def reset(self) -> None:
        self.own.clear()
        self.used.clear()
        self.target_tk, self.forward_next, self.recomputed = None, False, 0

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        probs, own_tk = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.forward_next:
            self.forward_next = False
            self.own.append(own_tk.detach())
            target_tk, self.target_tk = self.target_tk, None
            self.used.append(target_tk)
        elif self.recomputed < len(self.used):  # activation recompute of the micro-batch's forward
            target_tk = self.used[self.recomputed]
            self.recomputed += 1
        else:  # outside a pass
            target_tk = None
        if target_tk is None:
            return probs, own_tk
        target_tk = target_tk.to(device=scores.device, dtype=torch.long)
        if target_tk.shape != own_tk.shape:
            raise RuntimeError(
                f"routing replay, MoE layer {self.moe_index}: {tuple(target_tk.shape)} target routes for a "
                f"router call of {tuple(own_tk.shape)} (tokens x top-k): the routes do not follow the batch"
            )
        # A self-routed token takes its own top-k, whose scores gathered are exactly topk's values.
        target_tk = torch.where(target_tk == SELF_ROUTED, own_tk, target_tk)
        return scores.gather(1, target_tk), target_tk


SELF_ROUTED = -2
"""A target route that says "the router's own choice" (``RoutingPass(replay_rows=...)``: rows of a
replayed micro-batch that route themselves)."""


def moe_layer_numbers(config: Any) -> list[int]:
    """megatron's 1-based global layer numbers of the MoE layers (from ``moe_layer_freq``)."""
    freq = config.moe_layer_freq
    pattern = (
        freq if isinstance(freq, list) else [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    )
    return [i + 1 for i, is_moe in enumerate(pattern) if is_moe]


def model_taps(model: torch.nn.Module | list[torch.nn.Module]) -> list[RouteTap]:
    """The taps of ``model``'s routers on this rank (attached on first use), in layer order; empty
    for a dense model."""
    from megatron.core.transformer.moe.router import TopKRouter

    chunks = model if isinstance(model, list) else [model]
    taps: list[RouteTap] = []
    for chunk in chunks:
        for module in chunk.modules():
            if not isinstance(module, TopKRouter):
                continue
            if not hasattr(module, "router_replay") or module.config.moe_router_fusion:
                raise RuntimeError(
                    "this megatron-core has no TopKRouter.router_replay slot (or uses the fused TE router, "
                    "which bypasses it): routes cannot be recorded or replayed; use megatron-core >= 0.16"
                )
            if not isinstance(module.router_replay, RouteTap):
                numbers = moe_layer_numbers(module.config)
                module.router_replay = RouteTap(numbers.index(module.layer_number))
            taps.append(module.router_replay)
    return sorted(taps, key=lambda t: t.moe_index)


def _router_order(x_bs: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """``[B, S, ...]`` -> this rank's router tokens ``[S/tp * B, ...]`` (sequence-major, SP chunk)."""
    x_sb = x_bs.transpose(0, 1)
    if ps.sequence_parallel and ps.tp > 1:
        x_sb = x_sb.chunk(ps.tp, dim=0)[ps.tp_rank]
    return x_sb.reshape(-1, *x_sb.shape[2:])


@dataclass
class _Microbatch:
    shape: tuple[int, int]
    """Padded (B, S) as run."""
    valid_t: torch.Tensor
    """Router-order mask of real tokens (not padding)."""
    given: dict[int, torch.Tensor]
    """Per tap (by position in ``taps``): the micro-batch's routes in router order, -1 at padding."""
    self_t: torch.Tensor | None = None
    """Router-order mask of the tokens that routed themselves in a partly replayed micro-batch
    (``replay_rows``); None: every token replayed, or none."""


class RoutingPass:
    """Routing of one trainer pass over one model (all its micro-batches, over one or several
    ``forward_logprobs`` / ``forward_backward`` calls, in order).

    ``replay``: route every token as ``MicroBatch.routes_lbsk`` says (micro-batches without routes,
    e.g. placeholders, route themselves). Either way the routers' own choices are compared with the
    given routes (``routing/disagreement``) and counted per expert (load metrics).

    ``replay_rows`` (with ``replay``; bool over each micro-batch's rows): only those rows replay; the
    others route themselves, and only they are compared with the given routes (the mismatch probe
    runs its plain and its replayed copy of a batch as one forward, training/phases/sync.py).
    """

    def __init__(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        ps: ParallelState,
        *,
        replay: bool,
        replay_rows: torch.Tensor | None = None,
    ) -> None:
        self.taps = model_taps(model)
        self.ps = ps
        self.replay = replay
        self.replay_rows = replay_rows if replay else None
        self.microbatches: list[_Microbatch] = []
        for tap in self.taps:
            tap.reset()
        config = _first_config(model)
        self.num_experts = int(config.num_moe_experts or 0)
        self.num_moe_layers = len(moe_layer_numbers(config)) if self.num_experts else 0
        self.top_k = int(config.moe_router_topk) if self.num_experts else 0

    def before_microbatch(
        self, routes_lbsk: torch.Tensor | None, padded: tuple[int, int], real: tuple[int, int]
    ) -> None:
        """Called by the runner before each micro-batch's forward on this pipeline stage."""
        if not self.taps:
            return
        rows, length = padded
        given: dict[int, torch.Tensor] = {}
        if routes_lbsk is not None:
            if routes_lbsk.shape[1:3] != (rows, length):
                raise RuntimeError(f"routes {tuple(routes_lbsk.shape)} for a micro-batch of {padded}")
            for j, tap in enumerate(self.taps):
                given[j] = _router_order(routes_lbsk[tap.moe_index], self.ps)
            valid_t = given[0][:, 0] >= 0
        else:
            valid_bs = torch.zeros(rows, length, dtype=torch.bool)
            valid_bs[: real[0], : real[1]] = True
            valid_t = _router_order(valid_bs, self.ps)
        self_t = None  # router-order tokens that route themselves in a partly replayed micro-batch
        if self.replay_rows is not None and given:
            self_bs = torch.ones(rows, length, dtype=torch.bool)
            self_bs[: len(self.replay_rows)] = ~self.replay_rows.bool()[:rows, None]
            self_t = _router_order(self_bs, self.ps)
        for j, tap in enumerate(self.taps):
            target = given.get(j) if self.replay else None
            if target is not None:
                # Padding tokens still pass through the router: give them distinct, harmless experts.
                filler = torch.arange(target.shape[1], dtype=target.dtype).expand_as(target)
                target = torch.where(target >= 0, target, filler)
                if self_t is not None:
                    target = torch.where(self_t[:, None], torch.full_like(target, SELF_ROUTED), target)
            tap.target_tk, tap.forward_next = target, True
        given_cpu = {j: g.cpu() for j, g in given.items()}
        self.microbatches.append(
            _Microbatch(padded, valid_t.cpu(), given_cpu, None if self_t is None else self_t.cpu())
        )

    def _own(self, j: int, i: int) -> torch.Tensor:
        tap = self.taps[j]
        if len(tap.own) != len(self.microbatches):
            raise RuntimeError(
                f"MoE layer {tap.moe_index} routed {len(tap.own)} forwards in a pass of {len(self.microbatches)} "
                "micro-batches: a micro-batch ran without RoutingPass.before_microbatch"
            )
        return tap.own[i].cpu()

    def stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``[M, 2]`` (tokens whose own experts differ from the given ones, tokens
        compared) and ``[M, E]`` tokens per expert of the routes used; zeros outside its layers and
        on ranks whose tokens another rank already counts (TP ranks without sequence parallelism)."""
        compare_m2 = torch.zeros(self.num_moe_layers, 2, dtype=torch.float64)
        counts_me = torch.zeros(self.num_moe_layers, self.num_experts, dtype=torch.float64)
        if self.ps.sequence_parallel or self.ps.tp_rank == 0:
            for j, tap in enumerate(self.taps):
                for i, mb in enumerate(self.microbatches):
                    own_tk = self._own(j, i)
                    given = mb.given.get(j)
                    used_tk = given if (self.replay and given is not None) else own_tk
                    if mb.self_t is not None and given is not None:  # partly replayed
                        used_tk = torch.where(mb.self_t[:, None], own_tk, given)
                    counts_me[tap.moe_index] += expert_counts(used_tk, mb.valid_t, self.num_experts)
                    if given is not None:
                        real_t = mb.valid_t & (given[:, 0] >= 0)
                        if mb.self_t is not None:  # only the rows that routed themselves
                            real_t &= mb.self_t
                        compare_m2[tap.moe_index, 0] += float(route_mismatches(own_tk, given, real_t))
                        compare_m2[tap.moe_index, 1] += float(real_t.sum())
        return compare_m2, counts_me

    def own_routes(self, i: int) -> dict[int, torch.Tensor]:
        """Micro-batch ``i``'s own routes per MoE layer of this stage, ``[B, S, K]`` (padded shape),
        gathered over the sequence-parallel chunks (collective over TP when SP is on)."""
        rows, length = self.microbatches[i].shape
        out: dict[int, torch.Tensor] = {}
        for j, tap in enumerate(self.taps):
            own_sbk = self._own(j, i).view(-1, rows, self.top_k)
            if self.ps.sequence_parallel and self.ps.tp > 1:
                device = collective_device(self.ps.tp_group)
                parts = [torch.empty_like(own_sbk, device=device) for _ in range(self.ps.tp)]
                dist.all_gather(parts, own_sbk.to(device), group=self.ps.tp_group)
                own_sbk = torch.cat([p.cpu() for p in parts])
            out[tap.moe_index] = own_sbk.transpose(0, 1)[:rows, :length]
        return out

    def close(self) -> None:
        """Drop the pass's targets and records from the routers (they outlive the pass)."""
        for tap in self.taps:
            tap.reset()


def _first_config(model: torch.nn.Module | list[torch.nn.Module]) -> Any:
    """The TransformerConfig of a model (through megatron's DDP wrapper)."""
    chunk: Any = model[0] if isinstance(model, list) else model
    while hasattr(chunk, "module") and not hasattr(chunk, "config"):
        chunk = chunk.module
    return chunk.config


def reduce_routing_stats(
    compare_m2: torch.Tensor, counts_me: torch.Tensor, ps: ParallelState
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum every rank's ``RoutingPass.stats`` (layers live on PP stages, tokens on DP / EP ranks and
    SP chunks): collective over all ranks."""
    device = collective_device()
    flat = torch.cat([compare_m2.reshape(-1), counts_me.reshape(-1)]).to(device)
    dist.all_reduce(flat)
    flat = flat.cpu()
    return flat[: compare_m2.numel()].view_as(compare_m2), flat[compare_m2.numel() :].view_as(counts_me)
