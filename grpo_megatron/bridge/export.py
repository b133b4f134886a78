"""Streaming export: megatron shards -> Hugging Face-named full tensors, in byte-budgeted buckets,
delivered to one or many destination ranks at once.

This is the resharding core: the per-iteration weight sync to rollout engines (every engine rank is
a destination), the mcore-to-hf converter (one destination) and the tests all consume this stream.

How the bytes travel (every rank derives the same plan from one metadata exchange, so the
point-to-point messages line up without further negotiation):
1. metadata: each rank announces every shard it holds (name, shape, dtype, TP/ETP slice), data-
   parallel copies included, with its host, in one ``all_gather_object``;
2. sources (``_choose_sources``): for each destination and each slice of a canonical tensor, the
   destination itself if it holds a copy (nothing to send), else a rank holding one, chosen in this
   order: on the destination's node, then the fewest bytes assigned so far (so every rank carries
   about its share), then in the destination's data-parallel replica, then the lowest rank;
3. plan: the adapter's export rules, in HF order, are cut into buckets (a bucket closes once it
   holds ``bucket_bytes``) and each bucket into ``ROUNDS_PER_BUCKET`` transfer rounds;
4. per round, every rank packs, for each destination it feeds, its small slices into one flat byte
   buffer, cast to the export dtype there (a bf16 export of fp32 weights moves half the bytes), sends
   each slice of ``DIRECT_MIN_BYTES`` or more as a message of its own (from the shard itself when it
   is already in the export dtype: no copy), and posts all its sends and receives of the round in
   one ``batch_isend_irecv``: every destination receives at once. Nothing is all-gathered: each byte travels
   once per destination, from a holder to the destination, which covers the TP/ETP gather, the EP
   gather of experts and the PP hand-off in one pattern;
5. ``rounds_in_flight`` rounds are posted ahead (a rank posts round k + n only after round k is
   done; every rank posts its round-k ops before waiting on any of them, so no cycle of waits can
   form); a destination writes every received slice straight into its place in the new HF tensors
   (``assemble_hf``: one copy per byte; QKV de-interleaving, GLU halves and vocabulary padding are
   handled slice by slice) and yields each bucket once its last round is in. The weight sync goes
   further (``borrow``, ``into``): the HF tensors are written straight into the engine's weights,
   whole slices are even received there, and what needs no assembly is handed on as views.

Memory (``TransferStats`` measures it): a rank holds the packed sends and the receive buffers of at
most ``rounds_in_flight`` rounds, plus, on a destination, the bucket being filled; no rank holds a
whole version unless a consumer keeps the buckets.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.bridge.layout import local_tensors, rules_by_name, tp_group_of
from grpo_megatron.bridge.transforms import hf_shapes, to_hf
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.models.weight_rules import WeightRule

Bucket = list[tuple[str, torch.Tensor]]
Consumer = Callable[[Bucket], None]

ROUNDS_PER_BUCKET = 4
"""Transfer rounds per bucket: with ``rounds_in_flight`` rounds posted ahead, the bytes in flight
beside the bucket being filled stay a fraction of a bucket."""
ROUNDS_IN_FLIGHT = 2
"""Default rounds posted ahead of the one being waited on (bytes on the wire vs memory held)."""
_ALIGN = 16  # byte offset alignment in flat buffers, so any dtype can view its slice in place


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


@dataclass(frozen=True)
class _Item:
    """One canonical megatron tensor of the stream, as every rank sees it after the metadata exchange."""

    rule: WeightRule
    shape: tuple[int, ...]  # canonical (unsharded) megatron shape
    dim: int | None  # dimension its slices split; None: one slice holds it all
    glu: bool  # slices hold [gate_r; up_r] (see bridge/layout.py)
    dtype: torch.dtype  # exported dtype
    slice_shapes: tuple[tuple[int, ...], ...]  # in TP/ETP rank order
    holders: tuple[tuple[int, ...], ...]  # ranks holding each slice (data-parallel copies included)
    hf_bytes: int  # bytes of its HF tensors (vocabulary padding stripped)

    def slice_bytes(self, slot: int) -> int:
        return math.prod(self.slice_shapes[slot]) * self.dtype.itemsize


@dataclass(frozen=True)
class _RankInfo:
    """What every rank announces about itself: where it runs and which data-parallel replica it is in."""

    host: str
    replica: int  # dense data-parallel rank (with CP rank): ranks of one model copy share it


Entry = tuple[str, tuple[int, ...], str, int | None, bool, int, int]
"""(canonical name, local shape, dtype, split dim or None, GLU, slices, this slice's index)."""


def _announce(
    model: torch.nn.Module, ps: ParallelState, rules: Mapping[str, WeightRule]
) -> tuple[list[Entry], dict[str, torch.Tensor]]:
    """This rank's metadata entries for every shard it holds and its local tensors by canonical name.
    Every copy is announced (data-parallel replicas, TP ranks' copies of unsplit tensors): each is a
    possible source, and the source choice spreads the load over them."""
    entries: list[Entry] = []
    mine: dict[str, torch.Tensor] = {}
    for _, tensor, layout in local_tensors(model, ps, rules):
        _, size, slot = tp_group_of(layout, ps)
        split = layout.partition_dim is not None and size > 1
        mine[layout.canonical_name] = tensor.detach()
        entries.append((
            layout.canonical_name, tuple(tensor.shape), str(tensor.dtype),
            layout.partition_dim if split else None, layout.glu, size if split else 1, slot if split else 0,
        ))  # fmt: skip
    return entries, mine


def _items(
    rules: Mapping[str, WeightRule],
    everyone: Sequence[Sequence[Entry]],
    dtype: torch.dtype | None,
    model_type: Any,
) -> list[_Item]:
    """The stream's tensors in HF order, each with the ranks holding each of its slices."""
    holders: dict[str, dict[int, list[int]]] = {}
    info: dict[str, tuple[int | None, bool, int, str, dict[int, tuple[int, ...]]]] = {}
    for rank, entries in enumerate(everyone):
        for canonical, shape, dt, dim, glu, size, slot in entries:
            holders.setdefault(canonical, {}).setdefault(slot, []).append(rank)
            info.setdefault(canonical, (dim, glu, size, dt, {}))[4].setdefault(slot, tuple(shape))
    unmapped = sorted(set(info) - set(rules))
    missing = sorted(r.mcore for r in rules.values() if r.mcore not in info and r.export)
    if unmapped or missing:
        raise RuntimeError(
            f"model and {model_type} adapter disagree: megatron tensors without a rule "
            f"{unmapped[:5]}, rules without a megatron tensor {missing[:5]}"
        )
    items = []
    for rule in rules.values():
        if not rule.export:
            continue
        dim, glu, size, dt, shapes = info[rule.mcore]
        by_slot = holders[rule.mcore]
        if sorted(by_slot) != list(range(size)):
            raise RuntimeError(
                f"{rule.mcore}: TP/ETP slices {sorted(by_slot)} announced, expected 0..{size - 1}"
            )
        full_shape = list(shapes[0])
        if dim is not None:
            full_shape[dim] *= size
        out_dtype = dtype or _dtype(dt)
        hf_bytes = _hf_numel(rule, full_shape) * out_dtype.itemsize
        items.append(_Item(
            rule, tuple(full_shape), dim, glu, out_dtype, tuple(shapes[r] for r in range(size)),
            tuple(tuple(by_slot[r]) for r in range(size)), hf_bytes,
        ))  # fmt: skip
    return items


def _choose_sources(
    items: Sequence[_Item], dst_ranks: Sequence[int], ranks: Sequence[_RankInfo]
) -> tuple[dict[int, list[tuple[int, ...]]], list[int]]:
    """For every destination, the rank sending each slice of each item (``[item][slot]``), and the
    bytes each rank sends in all.

    A destination holding a slice takes its own (nothing moves). Otherwise, among the holders: one on
    the destination's node (NVLink rather than the network), then the one with the fewest bytes
    assigned so far (the load spreads over every copy, so no rank carries more than its share), then
    one in the destination's data-parallel replica, then the lowest rank: deterministic, so every
    rank computes the same choice.
    """
    sent = [0] * len(ranks)
    sources: dict[int, list[tuple[int, ...]]] = {d: [] for d in dst_ranks}
    for item in items:
        for d in dst_ranks:
            here = ranks[d]
            chosen = []
            for slot, holders in enumerate(item.holders):
                if d in holders:
                    chosen.append(d)
                    continue
                src = min(
                    holders,
                    key=lambda r: (ranks[r].host != here.host, sent[r], ranks[r].replica != here.replica, r),
                )
                sent[src] += item.slice_bytes(slot)
                chosen.append(src)
            sources[d].append(tuple(chosen))
    return sources, sent


def _hf_numel(rule: WeightRule, shape: Sequence[int]) -> int:
    """Elements of the HF tensors of a canonical tensor: all of it (QKV and GLU only regroup rows)
    but the vocabulary padding. Arithmetic, not ``hf_shapes``: it runs once per tensor per export."""
    if rule.kind == "vocab":
        assert rule.vocab_size is not None
        return rule.vocab_size * math.prod(shape[1:])
    return math.prod(shape)


def _schedule(sizes: Sequence[int], bucket_bytes: int) -> list[list[list[int]]]:
    """Item indices cut into buckets (closed once they hold ``bucket_bytes``), each cut into rounds of
    about a ``ROUNDS_PER_BUCKET``-th of a bucket (a tensor is never split). ``sizes``: the HF
    bytes of each item."""
    round_bytes = max(bucket_bytes // ROUNDS_PER_BUCKET, 1)
    buckets: list[list[list[int]]] = []
    rounds: list[list[int]] = []
    rnd: list[int] = []
    filled = in_round = 0
    for index, nbytes in enumerate(sizes):
        if rnd and in_round + nbytes > round_bytes:
            rounds.append(rnd)
            rnd, in_round = [], 0
        rnd.append(index)
        in_round += nbytes
        filled += nbytes
        if filled >= bucket_bytes:
            buckets.append([*rounds, rnd])
            rounds, rnd, filled, in_round = [], [], 0, 0
    if rnd:
        rounds.append(rnd)
    if rounds:
        buckets.append(rounds)
    return buckets


Part = tuple[int, int, int]  # (item index, slice index, byte offset in the message)


@dataclass(frozen=True)
class _Message:
    """One point-to-point message of one round: the slices it carries and its size."""

    peer: int  # the destination (a send) or the source (a receive)
    parts: tuple[Part, ...]
    nbytes: int
    direct: bool = False
    """One slice alone (``_travels_alone``): sent from the shard itself when it is already in the
    export dtype; a whole (unsplit) slice is received straight into the consumer's place where it
    offers one laid out as the slice (``into``)."""


DIRECT_MIN_BYTES = 128 << 10
"""Slices of at least this many bytes travel in messages of their own (sent from the shard, no
packing); smaller ones share one packed message per pair and round (a message costs a fixed
latency however small)."""


def _travels_alone(item: _Item, slot: int) -> bool:
    """Whether slice ``slot`` of ``item`` travels as its own message: large enough to be worth one."""
    return item.slice_bytes(slot) >= DIRECT_MIN_BYTES


def _messages(
    rounds: Sequence[Sequence[int]], items: Sequence[_Item], sources: Mapping[int, Sequence[tuple[int, ...]]], me: int
) -> tuple[list[list[_Message]], list[list[_Message]]]:
    """This rank's sends and receives of every round: per pair, one packed message of the small
    and split slices, then one message per slice that travels alone, in item order (both ends
    derive the same order, which is how point-to-point messages between a pair are matched)."""
    sends: list[list[_Message]] = []
    recvs: list[list[_Message]] = []
    for rnd in rounds:
        out: dict[int, list[Part]] = {}
        into: dict[int, list[Part]] = {}
        alone: dict[tuple[str, int], list[_Message]] = {}
        sizes: dict[tuple[str, int], int] = {}
        for d, per_item in sources.items():
            for index in rnd:
                for slot, src in enumerate(per_item[index]):
                    if src == d or me not in (src, d):
                        continue
                    box, peer = (out, d) if src == me else (into, src)
                    key = ("send" if src == me else "recv", peer)
                    if _travels_alone(items[index], slot):
                        msg = _Message(peer, ((index, slot, 0),), items[index].slice_bytes(slot), direct=True)
                        alone.setdefault(key, []).append(msg)
                        continue
                    offset = sizes.get(key, 0)
                    box.setdefault(peer, []).append((index, slot, offset))
                    sizes[key] = offset + _aligned(items[index].slice_bytes(slot))
        for kind, box, result in (("send", out, sends), ("recv", into, recvs)):
            peers = sorted({p for k, p in [*sizes, *alone] if k == kind})
            result.append([
                msg
                for p in peers
                for msg in (
                    [_Message(p, tuple(box[p]), sizes[(kind, p)])] if (kind, p) in sizes else []
                ) + alone.get((kind, p), [])
            ])  # fmt: skip
    return sends, recvs


def _view(flat_u8: torch.Tensor, offset: int, item: _Item, slot: int) -> torch.Tensor:
    nbytes = item.slice_bytes(slot)
    return flat_u8[offset : offset + nbytes].view(item.dtype).view(item.slice_shapes[slot])


@dataclass
class TransferStats:
    """Bytes of the buffers an export allocates (packed sends, receive buffers, the bucket being
    filled), tracked as they are made and dropped: ``peak_bytes`` is what the transport held at most
    at any time on this rank (the weight sync reports it; the tests compare it with the bound)."""

    live_bytes: int = 0
    peak_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    in_place_bytes: int = 0
    """Of ``received_bytes``, those received straight into the consumer's places (``into``)."""

    def hold(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def drop(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


@dataclass(frozen=True)
class ExportPlan:
    """The outcome of the metadata exchange: every tensor of the stream, who sends which slice of it
    to which destination, cut into buckets and rounds, and this rank's messages of every round. It
    depends only on the model's layout (not on the weights), so one plan serves every export of the
    same model at the same layout, destinations, bucket size and dtype (the per-iteration weight sync
    computes it once instead of gathering every rank's metadata each time)."""

    items: list[_Item]
    buckets: list[list[list[int]]]
    """Item indices by bucket and round."""
    bucket_bytes: int
    dst_ranks: tuple[int, ...]
    dtype: torch.dtype | None
    world_size: int
    rounds_in_flight: int
    sources: list[tuple[int, ...]] | None
    """On a destination: the rank sending each slice of each item (itself for slices it holds)."""
    sends: list[list[_Message]]
    """This rank's outgoing messages of each round."""
    recvs: list[list[_Message]]
    """This rank's incoming messages of each round."""
    pair_bytes: dict[tuple[int, int], int]
    """Bytes (src, dst) moves per export, for every pair of the world (benchmarks, metrics)."""
    local: dict[str, torch.Tensor] = field(repr=False)
    """This rank's shards by canonical name: detached views that share the parameters' storage, so
    they follow every optimizer step and offload round trip (offload resizes storage in place)."""

    @property
    def dst_rank(self) -> int:
        return self.dst_ranks[0]

    def manifest(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(HF name, shape, dtype) of every tensor the stream delivers, in stream order: what a
        destination receives, known before any byte moves (the weight sync's engines check it)."""
        return [
            (name, shape, item.dtype)
            for item in self.items
            for name, shape in zip(item.rule.hf, hf_shapes(item.rule, item.shape), strict=True)
        ]


def plan_export(
    model: torch.nn.Module,
    ps: ParallelState,
    hf: Mapping[str, Any],
    *,
    bucket_bytes: int = 512 << 20,
    dst_rank: int = 0,
    dst_ranks: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    rounds_in_flight: int = ROUNDS_IN_FLIGHT,
) -> ExportPlan:
    """Collective: exchange shard metadata (names, shapes, dtypes, slices, hosts; no weights) and plan
    the stream to ``dst_ranks`` (default: ``[dst_rank]``)."""
    dsts = tuple(dst_ranks) if dst_ranks is not None else (dst_rank,)
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    if rounds_in_flight < 1:
        raise ValueError(f"rounds_in_flight={rounds_in_flight} must be >= 1")
    if not dsts or len(set(dsts)) != len(dsts) or not all(0 <= d < ps.world_size for d in dsts):
        raise ValueError(f"destination ranks {list(dsts)} must be distinct ranks of this world of {ps.world_size}")
    rules = rules_by_name(hf)
    entries, mine = _announce(model, ps, rules)
    everyone: list[Any] = [None] * ps.world_size
    me = (entries, _RankInfo(socket.gethostname(), ps.dp_rank * ps.cp + ps.cp_rank))
    dist.all_gather_object(everyone, me)
    items = _items(rules, [e for e, _ in everyone], dtype, hf.get("model_type"))
    sources, _ = _choose_sources(items, dsts, [info for _, info in everyone])
    buckets = _schedule([item.hf_bytes for item in items], bucket_bytes)
    rounds = [rnd for bucket in buckets for rnd in bucket]
    sends, recvs = _messages(rounds, items, sources, ps.rank)
    pair_bytes: dict[tuple[int, int], int] = {}
    for d, per_item in sources.items():
        for item, srcs in zip(items, per_item, strict=True):
            for slot, src in enumerate(srcs):
                if src != d:
                    pair_bytes[(src, d)] = pair_bytes.get((src, d), 0) + item.slice_bytes(slot)
    return ExportPlan(
        items, buckets, bucket_bytes, dsts, dtype, ps.world_size, rounds_in_flight,
        sources.get(ps.rank), sends, recvs, pair_bytes, mine,
    )  # fmt: skip


def export_hf_stream(
    model: torch.nn.Module,
    ps: ParallelState,
    hf: Mapping[str, Any],
    *,
    bucket_bytes: int = 512 << 20,
    dst_rank: int = 0,
    dst_ranks: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    plan: ExportPlan | None = None,
    device: torch.device | str = "cpu",
    stats: TransferStats | None = None,
    borrow: bool = False,
    into: Callable[[str], torch.Tensor | None] | None = None,
) -> Iterator[Bucket]:
    """Yield buckets of (HF name, full tensor on ``device``) on every destination rank (``dst_ranks``,
    default ``[dst_rank]``), all of them receiving at once; the other ranks yield nothing but must
    iterate the generator to the end (they send their slices from inside it), and so must every
    destination (its sends to the others run inside it too).

    ``device``: where the HF tensors are assembled and the bytes travel. "cpu" for writers; the
    weight sync passes the engine's device, so on GPU the bytes go device-to-device (NCCL between
    ranks) and never through host memory.

    ``bucket_bytes``: a bucket is yielded once it holds at least this many bytes (a tensor is
    never split). ``dtype``: cast on export, on the sending rank (None keeps the training dtype).
    ``plan``: a ``plan_export`` result made with these same settings, to skip the metadata exchange;
    None = plan now. ``stats``: filled with the bytes this rank's transport held, sent and received.
    Every yielded tensor owns its memory: a consumer may keep any of them, unless ``borrow``.

    ``borrow=True`` (the weight sync, whose engines copy every tensor into their live weights at
    once): a tensor that needs no assembly (one slice, already in the export dtype on ``device``)
    is yielded as a view of where it already is (this rank's own shard, or the received message),
    so each byte is copied once, by the consumer; and each round is yielded as soon as it is in (a
    "bucket" of a quarter bucket's bytes). Borrowed views are valid only until the consumer returns
    to the generator: copy them, never keep them.

    ``into`` (with ``borrow``; the weight sync passes its engine's ``load_target``): where the
    consumer will copy each HF tensor, or None. A slice that travels alone (``_travels_alone``) and
    whose HF tensors' places are laid out exactly as the slice (contiguous, adjacent, in the export
    dtype on ``device``) is received straight into them; its names are then yielded with their
    places themselves (the consumer has nothing left to copy).
    """
    dsts = tuple(dst_ranks) if dst_ranks is not None else (dst_rank,)
    if plan is None:
        plan = plan_export(model, ps, hf, bucket_bytes=bucket_bytes, dst_ranks=dsts, dtype=dtype)
    elif (plan.bucket_bytes, plan.dst_ranks, plan.dtype, plan.world_size) != (
        bucket_bytes, dsts, dtype, ps.world_size
    ):
        raise ValueError(
            f"export plan made for bucket_bytes={plan.bucket_bytes}, destinations {list(plan.dst_ranks)}, "
            f"dtype={plan.dtype}, world {plan.world_size}; asked for {bucket_bytes}, {list(dsts)}, {dtype}, "
            f"{ps.world_size}: make a new plan with plan_export"
        )
    stats = stats if stats is not None else TransferStats()
    out_device = torch.device(device)
    mine = plan.local  # views of this rank's shards: they see the weights as they are now
    items = plan.items

    def post(k: int) -> tuple[list, list[tuple[torch.Tensor, _Message, bool]], int]:
        """Pack this rank's sends of round k, allocate its receives, and post them all in one batch."""
        ops, inbox, held = [], [], 0
        for msg in plan.sends[k]:
            stats.sent_bytes += msg.nbytes
            if msg.direct:
                index, _, _ = msg.parts[0]
                shard = mine[items[index].rule.mcore]
                if shard.dtype == items[index].dtype and shard.device == out_device and shard.is_contiguous():
                    ops.append(dist.P2POp(dist.isend, shard.reshape(-1).view(torch.uint8), msg.peer))
                    continue  # sent from the weights themselves: no copy
            flat_u8 = torch.empty(msg.nbytes, dtype=torch.uint8, device=out_device)
            for index, slot, offset in msg.parts:
                _view(flat_u8, offset, items[index], slot).copy_(mine[items[index].rule.mcore])
            ops.append(dist.P2POp(dist.isend, flat_u8, msg.peer))
            held += msg.nbytes
        for msg in plan.recvs[k]:
            stats.received_bytes += msg.nbytes
            whole = msg.direct and items[msg.parts[0][0]].dim is None and items[msg.parts[0][0]].rule.kind != "qkv"
            place = _place_of(items[msg.parts[0][0]], into, out_device) if whole and into else None
            if place is not None:
                ops.append(dist.P2POp(dist.irecv, place, msg.peer))
                inbox.append((place, msg, True))
                stats.in_place_bytes += msg.nbytes
                continue  # received straight where the consumer wants it: no copy
            flat_u8 = torch.empty(msg.nbytes, dtype=torch.uint8, device=out_device)
            ops.append(dist.P2POp(dist.irecv, flat_u8, msg.peer))
            inbox.append((flat_u8, msg, False))
            held += msg.nbytes
        stats.hold(held)
        return (dist.batch_isend_irecv(ops) if ops else []), inbox, held

    rounds = [rnd for bucket in plan.buckets for rnd in bucket]
    last_of_bucket = {sum(len(b) for b in plan.buckets[: i + 1]) - 1 for i in range(len(plan.buckets))}
    sources = plan.sources
    bucket: Bucket = []
    bucket_held = 0

    def finish(
        k: int, works: list, inbox: list[tuple[torch.Tensor, _Message, bool]], held: int
    ) -> Iterator[Bucket]:
        """Wait for round k; on a destination, write its slices into the bucket (yielded when full)."""
        nonlocal bucket, bucket_held
        for work in works:
            work.wait()
        if sources is not None:
            received: dict[tuple[int, int], torch.Tensor] = {}
            landed: set[int] = set()
            for flat_u8, msg, in_place in inbox:
                if in_place:
                    landed.add(msg.parts[0][0])
                    continue
                for index, slot, offset in msg.parts:
                    received[(index, slot)] = _view(flat_u8, offset, items[index], slot)
            for index in rounds[k]:
                item = items[index]
                if index in landed:  # already in the consumer's place: hand on its names and places
                    bucket += [(name, into(name)) for name in item.rule.hf]  # type: ignore[misc]
                    continue
                shards = [
                    mine[item.rule.mcore] if src == ps.rank else received[(index, slot)]
                    for slot, src in enumerate(sources[index])
                ]
                if borrow and _borrowable(item, shards[0], out_device):
                    bucket += to_hf(item.rule, shards[0])  # views: the consumer's copy is the only one
                    continue
                places = _places(item, into, out_device) if into is not None else None
                if places is not None:  # assembled straight into the consumer's places
                    bucket += assemble_hf(
                        item.rule, item.shape, item.dim, item.glu, shards, item.dtype, out_device, outs=places
                    )
                    continue
                bucket += assemble_hf(item.rule, item.shape, item.dim, item.glu, shards, item.dtype, out_device)
                bucket_held += item.hf_bytes
                stats.hold(item.hf_bytes)
            received.clear()
        if borrow and bucket:  # handed on while the round's buffers it views are alive
            out, bucket = bucket, []
            yield out
            stats.drop(bucket_held)
            bucket_held = 0
        works.clear()  # the round's buffers are freed here, before the bucket is handed on
        inbox.clear()
        stats.drop(held)
        if sources is not None and k in last_of_bucket and bucket:
            out, bucket = bucket, []
            stats.drop(bucket_held)
            bucket_held = 0
            yield out

    in_flight: deque[tuple[int, list, list, int]] = deque()
    for k in range(len(rounds)):
        if len(in_flight) == plan.rounds_in_flight:
            yield from finish(*in_flight.popleft())
        in_flight.append((k, *post(k)))
    while in_flight:
        yield from finish(*in_flight.popleft())


def _place_of(
    item: _Item, into: Callable[[str], torch.Tensor | None], device: torch.device
) -> torch.Tensor | None:
    """A flat byte view of the consumer's places of ``item``'s HF tensors when they are laid out
    exactly as its one slice (so the slice can be received straight into them), else None."""
    pieces = to_hf(item.rule, torch.empty(item.slice_shapes[0], dtype=item.dtype, device="meta"))
    places = [into(name) for name, _ in pieces]
    first = places[0]
    if first is None:
        return None
    base = first.data_ptr()
    for (_, piece), place in zip(pieces, places, strict=True):
        if (
            place is None or place.dtype != item.dtype or place.device != device or not place.is_contiguous()
            or tuple(place.shape) != tuple(piece.shape) or not piece.is_contiguous()
            or place.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or place.data_ptr() - base != piece.storage_offset() * item.dtype.itemsize
        ):  # fmt: skip
            return None
    if sum(p.numel() for _, p in pieces) * item.dtype.itemsize != item.slice_bytes(0):
        return None  # the slice holds more than its HF tensors (vocabulary padding)
    storage = first.untyped_storage()
    flat_u8 = torch.empty(0, dtype=torch.uint8, device=device)
    return flat_u8.set_(storage, first.storage_offset() * item.dtype.itemsize, (item.slice_bytes(0),), (1,))


def _places(
    item: _Item, into: Callable[[str], torch.Tensor | None], device: torch.device
) -> list[torch.Tensor] | None:
    """The consumer's places of ``item``'s HF tensors when every one exists, is contiguous and in the
    export dtype on ``device`` (then the tensor is assembled straight there), else None."""
    places = [into(name) for name in item.rule.hf]
    if all(p is not None and p.dtype == item.dtype and p.device == device and p.is_contiguous() for p in places):
        return places  # type: ignore[return-value]
    return None


def _borrowable(item: _Item, shard: torch.Tensor, device: torch.device) -> bool:
    """Whether ``item``'s HF tensors can be handed on as views of its one slice ``shard``: no cast,
    no move, and no regrouping that needs a copy (QKV's per-group split is not a view of its rows)."""
    return item.dim is None and item.rule.kind != "qkv" and shard.dtype == item.dtype and shard.device == device


# ---- assembling HF tensors from TP/ETP slices -----------------------------------------------------
def _segments(shards: Sequence[torch.Tensor], dim: int | None, glu: bool) -> list[tuple[int, torch.Tensor]]:
    """(offset along the split dimension of the canonical tensor, piece) for every piece of the slices."""
    if dim is None:
        return [(0, shards[0])]
    if not glu:
        width = shards[0].shape[dim]
        return [(r * width, s) for r, s in enumerate(shards)]
    # A GLU slice r holds [gate_r; up_r]: the canonical tensor is [gate_0 .. gate_n-1; up_0 .. up_n-1].
    halves = [s.chunk(2, dim=dim) for s in shards]
    width = halves[0][0].shape[dim]
    n = len(shards)
    return [(j * n * width + r * width, half[j]) for j in range(2) for r, half in enumerate(halves)]


Placement = tuple[int, int, int, int, torch.Tensor]  # (HF tensor index, dim, start, length, piece)


def _placements(
    rule: WeightRule, shape: Sequence[int], dim: int, segments: list[tuple[int, torch.Tensor]]
) -> list[Placement] | None:
    """Where each canonical segment (rows ``start:start+len`` along ``dim``) lands in the HF tensors;
    None when a segment does not map onto whole HF slices (then the caller assembles the canonical
    tensor first)."""
    if rule.kind == "copy":
        return [(0, dim, start, seg.shape[dim], seg) for start, seg in segments]
    if dim != 0:
        return None
    out: list[Placement] = []
    for start, seg in segments:
        rows = seg.shape[0]
        if rule.kind == "vocab":
            assert rule.vocab_size is not None
            keep = max(0, min(rows, rule.vocab_size - start))  # padding rows are dropped
            if keep:
                out.append((0, 0, start, keep, seg[:keep]))
        elif rule.kind == "glu":
            half = shape[0] // 2
            gate = max(0, min(rows, half - start))
            if gate:
                out.append((0, 0, start, gate, seg[:gate]))
            if gate < rows:
                out.append((1, 0, start + gate - half, rows - gate, seg[gate:]))
        else:  # qkv: rows of query group g are [q heads of g; k_g; v_g]
            g = rule.qkv
            assert g is not None
            per_group = (g.heads_per_group + 2) * g.head_dim
            if start % per_group or rows % per_group:
                return None
            groups, first = rows // per_group, start // per_group
            q_rows = g.heads_per_group * g.head_dim
            q, k, v = seg.reshape(groups, per_group, *seg.shape[1:]).split(
                [q_rows, g.head_dim, g.head_dim], dim=1
            )
            # Pieces are [groups, rows of the group, ...]: the destination rows are viewed alike.
            out += [
                (0, 0, first * q_rows, groups * q_rows, q),
                (1, 0, first * g.head_dim, groups * g.head_dim, k),
                (2, 0, first * g.head_dim, groups * g.head_dim, v),
            ]
    return out


def assemble_hf(
    rule: WeightRule,
    shape: Sequence[int],
    dim: int | None,
    glu: bool,
    shards: Sequence[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    outs: Sequence[torch.Tensor] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one canonical megatron tensor of ``shape``, written from its TP/ETP slices
    (``shards[r]`` is slice r along ``dim``; one shard and ``dim=None`` when unsplit; ``glu``: each
    slice holds ``[gate_r; up_r]``) into new tensors of ``dtype`` on ``device``, or into ``outs`` (one
    contiguous tensor per HF name, of its HF shape: the weight sync's engine weights): each byte is
    copied once."""
    if outs is not None:
        wanted = hf_shapes(rule, shape)
        if len(outs) != len(wanted) or any(tuple(o.shape) != w for o, w in zip(outs, wanted, strict=False)):
            raise ValueError(f"{rule.hf}: places of shapes {[tuple(o.shape) for o in outs]}, expected {wanted}")
        if dim is None and rule.kind != "qkv":
            for out, (_, view) in zip(outs, to_hf(rule, shards[0]), strict=True):
                out.copy_(view)
            return list(zip(rule.hf, outs, strict=True))
    elif dim is None and rule.kind != "qkv":
        # Fast path (most tensors at world 1, experts at ETP 1): the HF tensors are views of the
        # shard (whole, GLU halves along dim 0, the real vocabulary rows): one copying op each.
        return [
            (name, view.to(device=device, dtype=dtype, copy=True, memory_format=torch.contiguous_format))
            for name, view in to_hf(rule, shards[0])
        ]
    if outs is None:
        outs = [torch.empty(s, dtype=dtype, device=device) for s in hf_shapes(rule, shape)]
    if len(shape) == 0:  # a scalar: nothing to place
        outs[0].copy_(shards[0])
        return list(zip(rule.hf, outs, strict=True))
    split_dim = 0 if dim is None else dim
    segments = _segments(shards, dim, glu)
    placements = _placements(rule, shape, split_dim, segments)
    if placements is None:
        full = torch.empty(tuple(shape), dtype=dtype, device=device)
        for start, seg in segments:
            full.narrow(split_dim, start, seg.shape[split_dim]).copy_(seg)
        for out, (_, view) in zip(outs, to_hf(rule, full), strict=True):
            out.copy_(view)
    else:
        for index, along, start, length, piece in placements:
            outs[index].narrow(along, start, length).view(piece.shape).copy_(piece)
    return list(zip(rule.hf, outs, strict=True))


# ---- one bucket from one rank to many --------------------------------------------------------------
BucketMeta = list[tuple[str, str, tuple[int, ...], int]]  # (HF name, dtype, shape, byte offset)


def flatten_bucket(
    bucket: Bucket, device: torch.device | str | None = None
) -> tuple[torch.Tensor, BucketMeta]:
    """One uint8 buffer holding every tensor of ``bucket`` (offsets aligned to 16 bytes, so any
    dtype views its slice in place) and the metadata ``unflatten_bucket`` needs."""
    meta: BucketMeta = []
    total = 0
    for name, t in bucket:
        meta.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), total))
        total += _aligned(t.numel() * t.element_size())
    flat_u8 = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), (_, _, shape, offset) in zip(bucket, meta, strict=True):
        flat_u8[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(shape).copy_(t)
    return flat_u8, meta


def unflatten_bucket(flat_u8: torch.Tensor, meta: BucketMeta) -> Bucket:
    """The tensors of a flattened bucket: non-overlapping views of ``flat_u8`` (no copy)."""
    out: Bucket = []
    for name, dt, shape, offset in meta:
        dtype = _dtype(dt)
        nbytes = math.prod(shape) * dtype.itemsize
        out.append((name, flat_u8[offset : offset + nbytes].view(dtype).view(shape)))
    return out


def broadcast_bucket(
    bucket: Bucket | None,
    src: int,
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | str | None = None,
) -> Bucket:
    """Send ``bucket`` from global rank ``src`` to every rank of ``group``: its metadata as one
    object, its bytes as one flat buffer (one collective however many tensors it holds).

    Call it on every rank of ``group``; ``bucket`` is read on ``src`` only (pass None elsewhere).
    ``device``: where the buffer travels and the received tensors live (None: the current CUDA
    device for an NCCL group, else the CPU). Returns ``bucket`` itself on ``src``; elsewhere
    non-overlapping views of one received buffer (clone a tensor to keep it without the rest).
    """
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    is_src = dist.get_rank() == src
    if is_src:
        if bucket is None:
            raise ValueError(f"broadcast_bucket: rank {src} is the source and must pass its bucket, not None")
        flat_u8, meta = flatten_bucket(bucket, device)
        total = flat_u8.numel()
    header: list[Any] = [(meta, total) if is_src else None]
    dist.broadcast_object_list(header, src=src, group=group, device=torch.device(device))
    meta, total = header[0]
    if not is_src:
        flat_u8 = torch.empty(total, dtype=torch.uint8, device=device)
    if total:
        dist.broadcast(flat_u8, src=src, group=group)
    return bucket if is_src else unflatten_bucket(flat_u8, meta)  # type: ignore[return-value]


def write_hf_checkpoint(
    model: torch.nn.Module,
    ps: ParallelState,
    hf: Mapping[str, Any],
    out_dir: str | Path,
    *,
    hf_config: Mapping[str, Any] | None = None,
    extra_files: tuple[Path, ...] = (),
    bucket_bytes: int = 512 << 20,
    dst_rank: int = 0,
) -> None:
    """Collective: stream ``model`` into a Hugging Face directory that ``dst_rank`` writes atomically
    (safetensors shards, index, ``hf_config`` or ``hf`` as config.json, ``extra_files`` such as the
    tokenizer); nothing is left at ``out_dir`` if the export fails. Used by ``convert mcore-to-hf``,
    the SFT output and the trainer's final export."""
    writer = SafetensorsWriter(out_dir, hf_config or hf, extra_files=extra_files) if ps.rank == dst_rank else None
    stream = export_hf_stream(model, ps, hf, bucket_bytes=bucket_bytes, dst_rank=dst_rank)
    if writer is None:
        for _ in stream:  # this rank only sends its slices
            pass
        return
    with writer:
        for bucket in stream:
            writer(bucket)


class SafetensorsWriter:
    """Consumer that writes each bucket as one safetensors shard, then the index and config.json.

    Everything goes to a temporary sibling directory that replaces ``out_dir`` only in
    ``close()``, so a failed export leaves nothing half-written at ``out_dir``. Use as a context
    manager: an exception inside the block removes the temporary directory.
    """

    def __init__(
        self, out_dir: str | Path, hf_config: Mapping[str, Any], *, extra_files: tuple[Path, ...] = ()
    ) -> None:
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and any(self.out_dir.iterdir()):
            raise FileExistsError(f"{self.out_dir} exists and is not empty: choose a new output directory")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.partial-", dir=self.out_dir.parent))
        self.hf_config = dict(hf_config)
        self.extra_files = extra_files  # e.g. tokenizer files, copied as they are
        self.files: list[tuple[str, list[str], int]] = []  # (temporary file name, keys, bytes)

    def __call__(self, bucket: Bucket) -> None:
        from safetensors.torch import save_file

        name = f"part-{len(self.files):05d}.safetensors"
        save_file(dict(bucket), str(self.tmp / name), metadata={"format": "pt"})
        self.files.append(
            (name, [k for k, _ in bucket], sum(t.numel() * t.element_size() for _, t in bucket))
        )

    def close(self) -> Path:
        n = len(self.files)
        weight_map: dict[str, str] = {}
        for i, (tmp_name, keys, _) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.tmp / tmp_name, self.tmp / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {
            "metadata": {"total_size": sum(b for _, _, b in self.files)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (self.tmp / "config.json").write_text(json.dumps(self.hf_config, indent=2, sort_keys=True) + "\n")
        for path in self.extra_files:
            shutil.copy2(path, self.tmp / path.name)
        if self.out_dir.exists():
            self.out_dir.rmdir()  # empty (checked in __init__)
        os.replace(self.tmp, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
