"""Rollout results between ranks as fixed-layout tensors (no pickled objects): the completions of
each engine to the ranks that need them, and the engines' routed experts to the ranks that train them.

Per engine, two tensors carry all its completions of one ``generate`` call:

- ``ints`` (int64): a header of 9 numbers per completion — response tokens, finish (1 = stop,
  0 = length), whether it has a ``loss_mask`` (multi-turn), its ``weight_version``, the routes'
  shape ``[M, L, K]`` and dtype code (0: no routes), and its sampled tokens (the loss tokens) —
  then every response's token ids, end to end, then the loss masks of those that have one, end to
  end;
- ``logprobs`` (float64: the engines' logprobs as Python floats, bit for bit), end to end.

Who receives what (``RolloutFleet.generate``'s ``payload``): "everywhere", every rank the whole
batch; otherwise every rank only the headers (what the batch-wide decisions read: lengths, finish,
versions; 72 bytes per completion) and ``COLLECTOR`` (global rank 0: it scores the rewards and logs
samples) the whole batch, and with "owners" each engine's rank keeps its completions
(``HeldCompletions``) until the trainer knows which data-parallel replica trains which sample:
``HeldCompletions.deliver`` then sends each its share, nothing else. Without that, each of 1024
ranks would receive and unpack every response of the batch. "engines" (the partial rollouts'
segments) keeps each completion whole on its engine's rank only; ``send_completions`` moves any
completions from one rank to another, point to point (what ``HeldCompletions.deliver`` and the partial
rollouts' pool use).

Routes (``Completion.routed_experts``, ``[M, L, K]`` integers per completion, the largest part of a
rollout by far) never travel with them: the engine's rank keeps them (``HeldRoutes``) until the
trainer knows which ranks train which sample, then ``HeldRoutes.deliver`` sends each one to exactly
those ranks, one flat tensor per (engine rank, receiving rank) pair.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from grpo_megatron.rollout.engine import Completion

if TYPE_CHECKING:
    from grpo_megatron.distributed.bootstrap import ParallelState

HEADER = 9
"""int64 numbers per completion in the header: tokens, finish, has loss mask, weight version, route
M, L, K, dtype code, sampled tokens."""
COLLECTOR = 0
"""The global rank that receives every completion whole whatever ``payload`` (reward scoring and
the sample log run there)."""
ROUTE_DTYPES: tuple[torch.dtype, ...] = (torch.uint8, torch.int16, torch.int32, torch.int64)
"""Route dtypes by code - 1 (code 0: the completion has no routes)."""


def pack(completions: Sequence[Completion]) -> tuple[torch.Tensor, torch.Tensor]:
    """One engine's completions -> (ints, logprobs) in the layout above (routes: shape only)."""
    ints: list[int] = []  # Python numbers until one tensor at the end (an element write costs microseconds)
    for c in completions:
        ints += header_of(c, routes=True)
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
    for n, stop, has_mask, version, m, length, k, code, _ in header:
        mask = rest[mask_at : mask_at + n] if has_mask else None
        mask_at += n if has_mask else 0
        out.append(
            Completion(
                rest[at : at + n],
                values[at : at + n],
                "stop" if stop else "length",
                loss_mask=mask,
                weight_version=version,
            )
        )
        shapes.append(((m, length, k), ROUTE_DTYPES[code - 1]) if code else None)
        at += n
    return out, shapes


Payload = Literal["everywhere", "collector", "owners", "engines"]
"""Where ``RolloutFleet.generate`` puts the completions' tokens, logprobs and loss masks: on every rank;
on ``COLLECTOR`` only (every other rank gets each completion's header: its sizes, finish and
version); as "collector" with each engine's rank keeping its own until ``HeldCompletions.deliver``
sends each to the ranks that train it; or on their engine's rank only, every other rank (``COLLECTOR``
too) getting the headers (the partial rollouts' segments, training/partial.py: a response's tokens stay
with the engine that continues it, and reach ``COLLECTOR`` and the replica that trains it when it is
taken)."""


def exchange_engine(
    mine: tuple[torch.Tensor, torch.Tensor] | None,
    sizes: Sequence[int],
    *,
    src: int,
    rank: int,
    payload: Payload,
    group: Any,
) -> tuple[list[Completion], list[Any], list[list[int]]]:
    """Collective over ``group``: engine rank ``src``'s completions (``pack``'s tensors, ``mine``, on
    ``src``; ``sizes``: its ``sizes_of``) on this rank, whole where ``payload`` puts them, else their
    headers only (``unpack_headers``); with each one's route shape and its header row. "everywhere":
    one broadcast of each tensor; else one broadcast of the headers and, to ``COLLECTOR`` (not with
    "engines"), one send of each tensor."""
    count, n_ints, n_logprobs = (int(x) for x in sizes[:3])
    if payload == "everywhere":
        ints, logprobs = (
            mine
            if mine is not None
            else (torch.empty(n_ints, dtype=torch.int64), torch.empty(n_logprobs, dtype=torch.float64))
        )
        dist.broadcast(ints, src=src, group=group)
        dist.broadcast(logprobs, src=src, group=group)
        completions, shapes = unpack(ints, logprobs, count)
        return completions, shapes, ints[: count * HEADER].view(count, HEADER).tolist()
    header = (
        mine[0][: count * HEADER].clone()
        if mine is not None
        else torch.empty(count * HEADER, dtype=torch.int64)
    )
    dist.broadcast(header, src=src, group=group)
    rows = header.view(count, HEADER).tolist()
    collector = payload != "engines"
    if collector and mine is not None and src != COLLECTOR:
        dist.send(mine[0], COLLECTOR, group=group)
        dist.send(mine[1], COLLECTOR, group=group)
    if collector and mine is None and rank == COLLECTOR:
        mine = (torch.empty(n_ints, dtype=torch.int64), torch.empty(n_logprobs, dtype=torch.float64))
        dist.recv(mine[0], src, group=group)
        dist.recv(mine[1], src, group=group)
    completions, shapes = unpack(*mine, count) if mine is not None else unpack_headers(header, count)
    return completions, shapes, rows


def received_numel(sizes: Sequence[int], payload: Payload, rank: int) -> int:
    """The int64 and float64 numbers that ``exchange_engine`` of another rank's completions (``sizes``:
    its ``sizes_of``) gives ``rank``: both tensors broadcast ("everywhere"), else the headers' broadcast
    and, on ``COLLECTOR`` (not with "engines"), both tensors again."""
    count, n_ints, n_logprobs = (int(x) for x in sizes[:3])
    if payload == "everywhere":
        return n_ints + n_logprobs
    return count * HEADER + (n_ints + n_logprobs if rank == COLLECTOR and payload != "engines" else 0)


def unpack_headers(header: torch.Tensor, count: int) -> tuple[list[Completion], list[Any]]:
    """``count`` completions from their headers alone (``pack``'s first ``count * HEADER`` numbers):
    each with its finish, weight version and ``sizes`` (tokens, sampled tokens) but no tokens,
    logprobs or loss mask; and each one's route shape and dtype, as ``unpack``."""
    out, shapes = [], []
    for n, stop, _, version, m, length, k, code, sampled in header.view(count, HEADER).tolist():
        out.append(
            Completion([], [], "stop" if stop else "length", weight_version=version, sizes=(n, sampled))
        )
        shapes.append(((m, length, k), ROUTE_DTYPES[code - 1]) if code else None)
    return out, shapes


def header_of(c: Completion, *, routes: bool = False) -> list[int]:
    """``c``'s header row (``HEADER`` numbers, whether or not its tokens are on this rank), as ``pack``
    writes it; without ``routes`` its route shape as none (they travel apart), the same on every rank:
    what ``HeldCompletions.add`` keeps of it."""
    finish, mask = int(c.finish_reason == "stop"), int(c.loss_mask is not None)
    r = c.routed_experts if routes else None
    shape = (*r.shape, ROUTE_DTYPES.index(r.dtype) + 1) if r is not None else (0, 0, 0, 0)
    return [c.num_tokens, finish, mask, c.weight_version, *shape, c.num_sampled]


def payload_numel(headers: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(ints, logprobs) numbers of ``pack`` of the completions with these header rows."""
    tokens = sum(row[0] for row in headers)
    masks = sum(row[0] for row in headers if row[2])
    return len(headers) * HEADER + tokens + masks, tokens


def transfer_pairs(
    needs: Mapping[int, Iterable[int]], source: Mapping[int, int], have: Iterable[int] = ()
) -> dict[tuple[int, int], list[int]]:
    """What moves where: ``needs`` (item id -> ranks that need it) and ``source`` (item id -> the rank
    holding it) -> ``(source rank, receiving rank)`` -> item ids, in id order; a rank that holds the
    item already (its source, or one of ``have``: ranks holding every item) receives nothing. The
    same on every rank, so each knows what it sends and receives without asking."""
    skip = set(have)
    pairs: dict[tuple[int, int], list[int]] = {}
    for item in sorted(needs):
        for dst in sorted(set(needs[item])):
            if dst != source[item] and dst not in skip:
                pairs.setdefault((source[item], dst), []).append(item)
    return dict(sorted(pairs.items()))


def fill(c: Completion, payload: Completion) -> None:
    """Give ``c`` (header only) the tokens, logprobs and loss mask that ``payload`` carries."""
    c.token_ids, c.logprobs, c.loss_mask, c.sizes = (
        payload.token_ids,
        payload.logprobs,
        payload.loss_mask,
        None,
    )


def send_completions(
    pairs: Mapping[tuple[int, int], Sequence[int]],
    completions: Mapping[int, Completion],
    headers: Mapping[int, Sequence[int]],
    rank: int,
    group: Any,
) -> tuple[dict[int, Completion], int]:
    """Collective over ``group`` (every rank, the same ``pairs``: ``transfer_pairs``' (source rank,
    receiving rank) -> item ids): each source sends each receiver the completions it names in
    ``pack``'s layout, two tensors per pair, point to point. ``completions``: this rank's to send, by id;
    ``headers``: every named id's header row (its sizes, on every rank). Returns the completions this
    rank received (tokens, logprobs, loss mask) by id and their bytes."""
    ops, receives = [], []
    for (src, dst), ids in pairs.items():
        if src == rank:
            ints, logprobs = pack([completions[i] for i in ids])
            ops += [dist.P2POp(dist.isend, ints, dst, group), dist.P2POp(dist.isend, logprobs, dst, group)]
        elif dst == rank:
            n_ints, n_logprobs = payload_numel([headers[i] for i in ids])
            ints, logprobs = (
                torch.empty(n_ints, dtype=torch.int64),
                torch.empty(n_logprobs, dtype=torch.float64),
            )
            ops += [dist.P2POp(dist.irecv, ints, src, group), dist.P2POp(dist.irecv, logprobs, src, group)]
            receives.append((ids, ints, logprobs))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    out: dict[int, Completion] = {}
    for ids, ints, logprobs in receives:
        got, _ = unpack(ints, logprobs, len(ids))
        out |= dict(zip(ids, got, strict=True))
    return out, sum(8 * (ints.numel() + logprobs.numel()) for _, ints, logprobs in receives)


def sizes_of(ints: torch.Tensor, logprobs: torch.Tensor, count: int, *, failed: bool = False) -> torch.Tensor:
    """This rank's ``[completions, ints, logprobs, failed]`` (every rank learns every engine's sizes,
    and whether any rank's share failed, in one gather)."""
    return torch.tensor([count, ints.numel(), logprobs.numel(), int(failed)], dtype=torch.int64)


@dataclass
class DataGroup:
    """The host-side (gloo) group of every rank that rollout results travel over (``RolloutFleet.generate``,
    the held completions' and routes' delivery) and engine loss is agreed over, made at its first use
    (collective: every rank gets there together)."""

    ps: ParallelState
    made: Any = None

    def group(self) -> Any:
        if self.made is None:
            self.made = dist.new_group(backend="gloo", timeout=self.ps.timeout, group_desc="ROLLOUT_DATA")
        return self.made

    def gather(self, obj: Any) -> list[Any]:
        """Collective: every rank's ``obj``, by rank."""
        everyone: list[Any] = [None] * self.ps.world_size
        dist.all_gather_object(everyone, obj, group=self.group())
        return everyone


@dataclass
class HeldCompletions:
    """Completions of ``generate(payload="owners")``, by payload id, until ``deliver``: whole on their
    engine's rank, their source rank and header row on every rank."""

    completions: dict[int, Completion] = field(default_factory=dict)
    source: dict[int, int] = field(default_factory=dict)
    headers: dict[int, list[int]] = field(default_factory=dict)
    next_id: int = 0

    def add(self, src: int, header: list[int], completion: Completion | None) -> int:
        pid, self.next_id = self.next_id, self.next_id + 1
        self.source[pid], self.headers[pid] = src, header
        if completion is not None:
            self.completions[pid] = completion
        return pid

    def deliver(
        self, owners: Mapping[int, Sequence[int]], rank: int, group: Any, release: Iterable[int] | None = None
    ) -> dict[int, Completion]:
        """Collective over ``group`` (every rank, the same ``owners``: payload id -> the global ranks
        that train it): the completions this rank receives, by payload id (``COLLECTOR`` and the
        engine's own rank hold theirs already and receive none). Each engine rank sends each
        receiving rank the completions it needs in ``pack``'s layout (two tensors per pair). Afterwards
        the ids ``release`` names are dropped; None: every held one."""
        pairs = transfer_pairs(owners, self.source, (COLLECTOR,))
        out, _ = send_completions(pairs, self.completions, self.headers, rank, group)
        for pid in list(self.source) if release is None else release:
            self.completions.pop(pid, None)
            self.source.pop(pid, None)
            self.headers.pop(pid, None)
        return out


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

    def deliver(
        self, owners: Mapping[int, Sequence[int]], rank: int, group: Any, release: Iterable[int] | None = None
    ) -> dict[int, torch.Tensor]:
        """Collective over ``group`` (every rank, the same ``owners``: route id -> the global ranks
        that need it): this rank's routes by id. Each engine rank sends each receiving rank one flat
        tensor of the routes it needs, in route-id order; nothing else moves. Afterwards the routes
        ``release`` names are dropped; None: every held route (those nobody needs, e.g. groups DAPO
        filtered out or earlier turns of a multi-turn episode, included)."""
        out: dict[int, torch.Tensor] = {
            rid: self.tensors[rid]
            for rid in sorted(owners)
            if rank in owners[rid] and self.source[rid] == rank
        }
        ops, receives = [], []
        for (src, dst), rids in transfer_pairs(owners, self.source).items():
            if src == rank:
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
