"""Rollout results between ranks as fixed-layout tensors (no pickled objects): the completions of
each engine to every rank, and the engines' routed experts to the ranks that train them.

Per engine, two tensors carry all its completions of one ``generate`` call:

- ``ints`` (int64): a header of 8 numbers per completion — response tokens, finish (1 = stop,
  0 = length), whether it has a ``loss_mask`` (multi-turn), its ``weight_version``, and the routes'
  shape ``[M, L, K]`` and dtype code (0: no routes) — then every response's token ids, end to end,
  then the loss masks of those that have one, end to end;
- ``logprobs`` (float64: the engines' logprobs as Python floats, bit for bit), end to end.

Routes (``Completion.routed_experts``, ``[M, L, K]`` integers per completion, the largest part of a
rollout by far) never travel with them: the engine's rank keeps them (``HeldRoutes``) until the
trainer knows which ranks train which sample, then ``HeldRoutes.deliver`` sends each one to exactly
those ranks, one flat tensor per (engine rank, receiving rank) pair.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.rollout.engine import Completion

HEADER = 8
"""int64 numbers per completion in the header: tokens, finish, has loss mask, weight version, route
M, L, K, dtype code."""
ROUTE_DTYPES: tuple[torch.dtype, ...] = (torch.uint8, torch.int16, torch.int32, torch.int64)
"""Route dtypes by code - 1 (code 0: the completion has no routes)."""


def pack(completions: Sequence[Completion]) -> tuple[torch.Tensor, torch.Tensor]:
    """One engine's completions -> (ints, logprobs) in the layout above (routes: shape only)."""
    ints: list[int] = []  # Python numbers until one tensor at the end (an element write costs microseconds)
    for c in completions:
        ints += (len(c.token_ids), int(c.finish_reason == "stop"), int(c.loss_mask is not None), c.weight_version)
        routes = c.routed_experts
        ints += (*routes.shape, ROUTE_DTYPES.index(routes.dtype) + 1) if routes is not None else (0, 0, 0, 0)
    for c in completions:
        ints += c.token_ids
    for c in completions:
        ints += c.loss_mask or ()
    logprobs = torch.tensor([x for c in completions for x in c.logprobs], dtype=torch.float64)
    return torch.tensor(ints, dtype=torch.int64), logprobs


def unpack(ints: torch.Tensor, logprobs: torch.Tensor, count: int) -> tuple[list[Completion], list[Any]]:
    """``pack``'s inverse for ``count`` completions (without routes) and each one's route shape and
    dtype, ``((M, L, K), dtype)`` or None."""
    header = ints[: count * HEADER].view(count, HEADER).tolist()
    rest, values = ints[count * HEADER :].tolist(), logprobs.tolist()
    out, shapes, at, mask_at = [], [], 0, sum(row[0] for row in header)
    for n, stop, has_mask, version, m, length, k, code in header:
        mask = rest[mask_at : mask_at + n] if has_mask else None
        mask_at += n if has_mask else 0
        out.append(Completion(rest[at : at + n], values[at : at + n], "stop" if stop else "length",
                              loss_mask=mask, weight_version=version))  # fmt: skip
        shapes.append(((m, length, k), ROUTE_DTYPES[code - 1]) if code else None)
        at += n
    return out, shapes


def sizes_of(ints: torch.Tensor, logprobs: torch.Tensor, count: int, *, failed: bool = False) -> torch.Tensor:
    """This rank's ``[completions, ints, logprobs, failed]`` (every rank learns every engine's sizes,
    and whether any rank's share failed, in one gather)."""
    return torch.tensor([count, ints.numel(), logprobs.numel(), int(failed)], dtype=torch.int64)


@dataclass
class HeldRoutes:
    """Routes of completions generated with ``SamplingParams.routes``, by route id, until ``deliver``: the
    tensors on their engine's rank, their source rank and shape on every rank."""

    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    source: dict[int, int] = field(default_factory=dict)
    shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    next_id: int = 0

    def add(self, src: int, shape: tuple[tuple[int, ...], torch.dtype], tensor: torch.Tensor | None) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        self.source[rid], self.shapes[rid] = src, shape
        if tensor is not None:
            self.tensors[rid] = tensor
        return rid

    def cut(self, rid: int, positions: int) -> None:
        """Keep the routes of only the first ``positions`` input positions of route ``rid`` (a
        multi-turn turn cut to its budget, ``rollout/multiturn.py``); every rank calls it alike."""
        (m, _, k), dtype = self.shapes[rid]
        self.shapes[rid] = ((m, positions, k), dtype)
        if rid in self.tensors:
            self.tensors[rid] = self.tensors[rid][:, :positions]

    def deliver(
        self, owners: Mapping[int, Sequence[int]], rank: int, group: Any, release: Iterable[int] | None = None
    ) -> dict[int, torch.Tensor]:
        """Collective over ``group`` (every rank, the same ``owners``: route id -> the global ranks
        that need it): this rank's routes by id. Each engine rank sends each receiving rank one flat
        tensor of the routes it needs, in route-id order; nothing else moves. Afterwards the routes
        ``release`` names are dropped; None: every held route (those nobody needs, e.g. groups DAPO
        filtered out or earlier turns of a multi-turn episode, included)."""
        pairs: dict[tuple[int, int], list[int]] = {}
        for rid in sorted(owners):
            for dst in sorted(set(owners[rid])):
                pairs.setdefault((self.source[rid], dst), []).append(rid)
        out: dict[int, torch.Tensor] = {}
        ops, receives = [], []
        for (src, dst), rids in sorted(pairs.items()):
            if src == dst == rank:
                out |= {rid: self.tensors[rid] for rid in rids}
            elif src == rank:
                flat = torch.cat([self.tensors[rid].reshape(-1) for rid in rids])
                ops.append(dist.P2POp(dist.isend, flat, dst, group))
            elif dst == rank:
                dtypes = {self.shapes[r][1] for r in rids}
                if len(dtypes) != 1:
                    raise RuntimeError(f"routes of one engine in several dtypes {sorted(map(str, dtypes))}")
                (dtype,) = dtypes
                flat = torch.empty(sum(_numel(self.shapes[r][0]) for r in rids), dtype=dtype)
                ops.append(dist.P2POp(dist.irecv, flat, src, group))
                receives.append((rids, flat))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for rids, flat in receives:
            at = 0
            for rid in rids:
                shape = self.shapes[rid][0]
                out[rid] = flat[at : at + _numel(shape)].view(shape)
                at += _numel(shape)
        for rid in list(self.source) if release is None else release:
            self.tensors.pop(rid, None)
            self.source.pop(rid, None)
            self.shapes.pop(rid, None)
        return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
