"""Planning the export stream (bridge/export.py): the metadata exchange, the source of every slice,
the buckets and rounds, and this rank's messages of every round (``plan_export`` -> ``ExportPlan``);
and ``TransferStats``, the bytes the stream's transport holds, sends and receives."""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.bridge.bucket_io import aligned, dtype_named
from grpo_megatron.bridge.fp8 import Fp8Weights
from grpo_megatron.bridge.layout import (
    MergedShard,
    adapter_tensors,
    local_tensors,
    merged_shards,
    rules_by_name,
    tp_group_of,
)
from grpo_megatron.bridge.transforms import hf_shapes
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.models.weight_rules import WeightRule, lora_rules

ROUNDS_PER_BUCKET = 4
"""Transfer rounds per bucket: with ``rounds_in_flight`` rounds posted ahead, the bytes in flight
beside the bucket being filled stay a fraction of a bucket."""
ROUNDS_IN_FLIGHT = 2
"""Default rounds posted ahead of the one being waited on (bytes on the wire vs memory held)."""
MIN_ROUNDS = 16
"""Rounds an export is cut into at least, whatever its bucket size (rounds shrink for a model
smaller than ``MIN_ROUNDS`` quarter buckets): a destination assembles round k while round k + 1 is
on the wire and reuses the buffers of round k for round k + 2, so an export in one or two rounds
overlaps nothing and allocates (on CPU: page-faults) a buffer for every byte. On the CPU bench
(146 MB, 512 MiB buckets) the sync went from 2 rounds to 16. Large models keep quarter buckets."""
MIN_ROUND_BYTES = 4 << 20
"""Bytes a round holds at least (within a bucket's quarter): each round costs a posted batch of
sends and receives and a wait, about half a millisecond on CPU whatever its size, so splitting a small
model ``MIN_ROUNDS`` ways buys no overlap. The demo's 3.7 MB went from 16 rounds (20 with the bucket
edges) to 1: its sync from 15 to 6 ms per iteration (bench/overhead.py). Models of more than
``MIN_ROUNDS`` x 4 MiB are cut as before."""


@dataclass(frozen=True)
class ExportItem:
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


Shard = torch.Tensor | MergedShard
"""A local shard of the stream: the tensor itself, or a LoRA-adapted weight merged when read."""


def read_shard(shard: Shard) -> torch.Tensor:
    """The bytes a shard exports now (a ``MergedShard`` is merged at this call)."""
    return shard() if isinstance(shard, MergedShard) else shard


Entry = tuple[str, tuple[int, ...], str, int | None, bool, int, int]
"""(canonical name, local shape, dtype, split dim or None, GLU, slices, this slice's index)."""


def _announce(
    model: torch.nn.Module, ps: ParallelState, rules: Mapping[str, WeightRule], *, adapters: bool = False
) -> tuple[list[Entry], dict[str, Shard]]:
    """This rank's metadata entries for every shard it holds and its local tensors by canonical name
    (a LoRA-adapted weight as its ``MergedShard``; ``adapters``: the LoRA adapters' tensors instead of
    the model's). Every copy is announced (data-parallel replicas, TP ranks' copies of unsplit
    tensors): each is a possible source, and the source choice spreads the load over them."""
    entries: list[Entry] = []
    mine: dict[str, Shard] = {}
    merged = merged_shards(model)
    tensors = adapter_tensors(model, ps) if adapters else local_tensors(model, ps, rules)
    for _, tensor, layout in tensors:
        _, size, slot = tp_group_of(layout, ps)
        split = layout.partition_dim is not None and size > 1
        mine[layout.canonical_name] = merged.get(id(tensor), tensor.detach())
        entries.append(
            (
                layout.canonical_name,
                tuple(tensor.shape),
                str(tensor.dtype),
                layout.partition_dim if split else None,
                layout.glu,
                size if split else 1,
                slot if split else 0,
            )
        )
    return entries, mine


def _items(
    rules: Mapping[str, WeightRule],
    everyone: Sequence[Sequence[Entry]],
    dtype: torch.dtype | None,
    model_type: Any,
) -> list[ExportItem]:
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
        # A rule's own dtype wins (the fp32 router bias); else the export's, else the training dtype.
        out_dtype = dtype_named(rule.dtype) if rule.dtype else dtype or dtype_named(dt)
        hf_bytes = _hf_numel(rule, full_shape) * out_dtype.itemsize
        items.append(
            ExportItem(
                rule,
                tuple(full_shape),
                dim,
                glu,
                out_dtype,
                tuple(shapes[r] for r in range(size)),
                tuple(tuple(by_slot[r]) for r in range(size)),
                hf_bytes,
            )
        )
    return items


Needs = Callable[[str], bool]
"""Which HF tensors a destination receives, by HF name (an item goes to it when any of its HF names
is needed); None = every tensor."""


def _wanted(items: Sequence[ExportItem], needs: Needs | None) -> frozenset[int] | None:
    """Indices of the items a destination with ``needs`` receives (None: all of them)."""
    if needs is None:
        return None
    return frozenset(i for i, item in enumerate(items) if any(needs(name) for name in item.rule.hf))


def _choose_sources(
    items: Sequence[ExportItem],
    dst_ranks: Sequence[int],
    ranks: Sequence[_RankInfo],
    wanted: Mapping[int, frozenset[int] | None] | None = None,
) -> tuple[dict[int, list[tuple[int, ...]]], list[int]]:
    """For every destination, the rank sending each slice of each item (``[item][slot]``; empty for
    an item it does not receive, ``wanted``), and the bytes each rank sends in all.

    A destination holding a slice takes its own (nothing moves). Otherwise, among the holders: one on
    the destination's node (NVLink rather than the network), then the one with the fewest bytes
    assigned so far (the load spreads over every copy, so no rank carries more than its share), then
    one in the destination's data-parallel replica, then the lowest rank: deterministic, so every
    rank computes the same choice.
    """
    sent = [0] * len(ranks)
    sources: dict[int, list[tuple[int, ...]]] = {d: [] for d in dst_ranks}
    wanted = wanted or {}
    for index, item in enumerate(items):
        for d in dst_ranks:
            mine = wanted.get(d)
            if mine is not None and index not in mine:
                sources[d].append(())
                continue
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
    about a ``ROUNDS_PER_BUCKET``-th of a bucket, or of a ``MIN_ROUNDS``-th of the whole export when
    that is smaller but not below ``MIN_ROUND_BYTES`` (a tensor is never split). ``sizes``: the HF
    bytes of each item."""
    round_bytes = max(
        min(bucket_bytes // ROUNDS_PER_BUCKET, max(-(-sum(sizes) // MIN_ROUNDS), MIN_ROUND_BYTES)), 1
    )
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
class Message:
    """One point-to-point message of one round: the slices it carries and its size."""

    peer: int  # the destination (a send) or the source (a receive)
    parts: tuple[Part, ...]
    nbytes: int
    direct: bool = False
    """One slice alone (``_travels_alone``): sent from the shard itself when it is already in the
    export dtype; a whole (unsplit) slice is received straight into the consumer's place where it
    offers one laid out as the slice (``into``)."""


DIRECT_MIN_BYTES = 1 << 20
"""Slices of at least this many bytes travel in messages of their own (sent from the shard, no
packing); smaller ones share one packed message per pair and round. A message costs a fixed
overhead however small, a pack a copy of its bytes at both ends: on the CPU bench (gloo) a message
cost ~40 us, the copy of a 1 MiB slice less than 100 us at both ends together, and at 128 KiB every
expert slice of TP2 x ETP2 travelled alone (393 messages per engine rank per sync, now 3 per round);
on GPUs a pack is a device copy and an NCCL message a few microseconds: the recipes' expert slices
(several MB) still travel alone."""


def _travels_alone(item: ExportItem, slot: int) -> bool:
    """Whether slice ``slot`` of ``item`` travels as its own message: large enough to be worth one."""
    return item.slice_bytes(slot) >= DIRECT_MIN_BYTES


def _messages(
    rounds: Sequence[Sequence[int]],
    items: Sequence[ExportItem],
    sources: Mapping[int, Sequence[tuple[int, ...]]],
    me: int,
) -> tuple[list[list[Message]], list[list[Message]]]:
    """This rank's sends and receives of every round: per pair, one packed message of the small
    and split slices, then one message per slice that travels alone, in item order (both ends
    derive the same order, which is how point-to-point messages between a pair are matched)."""
    sends: list[list[Message]] = []
    recvs: list[list[Message]] = []
    for rnd in rounds:
        out: dict[int, list[Part]] = {}
        into: dict[int, list[Part]] = {}
        alone: dict[tuple[str, int], list[Message]] = {}
        sizes: dict[tuple[str, int], int] = {}
        for d, per_item in sources.items():
            for index in rnd:
                for slot, src in enumerate(per_item[index]):
                    if src == d or me not in (src, d):
                        continue
                    box, peer = (out, d) if src == me else (into, src)
                    key = ("send" if src == me else "recv", peer)
                    if _travels_alone(items[index], slot):
                        msg = Message(peer, ((index, slot, 0),), items[index].slice_bytes(slot), direct=True)
                        alone.setdefault(key, []).append(msg)
                        continue
                    offset = sizes.get(key, 0)
                    box.setdefault(peer, []).append((index, slot, offset))
                    sizes[key] = offset + aligned(items[index].slice_bytes(slot))
        for kind, box, result in (("send", out, sends), ("recv", into, recvs)):
            peers = sorted({p for k, p in [*sizes, *alone] if k == kind})
            result.append(
                [
                    msg
                    for p in peers
                    for msg in ([Message(p, tuple(box[p]), sizes[(kind, p)])] if (kind, p) in sizes else [])
                    + alone.get((kind, p), [])
                ]
            )
    return sends, recvs


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

    items: list[ExportItem]
    buckets: list[list[list[int]]]
    """Item indices by bucket and round."""
    bucket_bytes: int
    dst_ranks: tuple[int, ...]
    dtype: torch.dtype | None
    world_size: int
    rank: int
    """The rank this plan was made on: its ``sources``, ``sends``, ``recvs`` and ``local`` are this rank's."""
    rounds_in_flight: int
    sources: list[tuple[int, ...]] | None
    """On a destination: the rank sending each slice of each item (itself for slices it holds)."""
    sends: list[list[Message]]
    """This rank's outgoing messages of each round."""
    recvs: list[list[Message]]
    """This rank's incoming messages of each round."""
    pair_bytes: dict[tuple[int, int], int]
    """Bytes (src, dst) moves per export, for every pair of the world (benchmarks, metrics)."""
    local: dict[str, Shard] = field(repr=False)
    """This rank's shards by canonical name: detached views that share the parameters' storage, so
    they follow every optimizer step and offload round trip (offload resizes storage in place); a
    LoRA-adapted weight is a ``MergedShard``, merged each time it is read (``read_shard``)."""
    wanted: dict[int, frozenset[int] | None] = field(default_factory=dict)
    """Per destination, the indices of the items it receives (None or absent: every item)."""
    quantize: Fp8Weights | None = None
    """Destinations receive the HF tensors this rule selects as block-wise FP8 weight + scales
    (bridge/fp8.py), quantized on the destination's device once assembled; None: as exported."""

    @property
    def dst_rank(self) -> int:
        return self.dst_ranks[0]

    def receives(self, dst: int, index: int) -> bool:
        """Whether destination ``dst`` receives item ``index``."""
        mine = self.wanted.get(dst)
        return mine is None or index in mine

    def manifest(self, dst: int | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(HF name, shape, dtype) of every tensor destination ``dst`` receives (None: every tensor of
        the stream), in stream order, known before any byte moves (the weight sync's engines check it);
        with ``quantize`` a quantized weight's float8 entry is followed by its scales' float32 one."""
        out = []
        for index, item in enumerate(self.items):
            if dst is not None and not self.receives(dst, index):
                continue
            for name, shape in zip(item.rule.hf, hf_shapes(item.rule, item.shape), strict=True):
                if self.quantize is None:
                    out.append((name, shape, item.dtype))
                else:
                    out += self.quantize.manifest(name, shape, item.dtype)
        return out


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
    needs: Mapping[int, Needs | None] | None = None,
    adapters: bool = False,
    quantize: Fp8Weights | None = None,
) -> ExportPlan:
    """Collective: exchange shard metadata (names, shapes, dtypes, slices, hosts; no weights) and plan
    the stream to ``dst_ranks`` (default: ``[dst_rank]``). ``needs``: per destination, which HF
    tensors it receives (absent or None: all; the same mapping on every rank); each destination's
    bytes come only for those, its manifest lists only those. ``adapters``: stream the LoRA adapters
    (``X_lora.lora_A`` / ``lora_B``, under ``<HF weight>.lora_A.weight`` / ``lora_B.weight``,
    ``models/weight_rules.py:lora_rules``) instead of the (merged) model. ``quantize``: the tensors it
    selects reach the destinations as FP8 weight + scales (``ExportPlan.quantize``)."""
    dsts = tuple(dst_ranks) if dst_ranks is not None else (dst_rank,)
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    if rounds_in_flight < 1:
        raise ValueError(f"rounds_in_flight={rounds_in_flight} must be >= 1")
    if not dsts or len(set(dsts)) != len(dsts) or not all(0 <= d < ps.world_size for d in dsts):
        raise ValueError(
            f"destination ranks {list(dsts)} must be distinct ranks of this world of {ps.world_size}"
        )
    rules = rules_by_name(hf)
    entries, mine = _announce(model, ps, rules, adapters=adapters)
    everyone: list[Any] = [None] * ps.world_size
    me = (entries, _RankInfo(socket.gethostname(), ps.dp_rank * ps.cp + ps.cp_rank))
    dist.all_gather_object(everyone, me)
    if adapters:
        rules = lora_rules(dict(rules), {entry[0] for rank_entries, _ in everyone for entry in rank_entries})
    items = _items(rules, [e for e, _ in everyone], dtype, hf.get("model_type"))
    unknown = sorted(set(needs or {}) - set(dsts))
    if unknown:
        raise ValueError(f"needs given for ranks {unknown} that are not destinations {list(dsts)}")
    wanted = {d: _wanted(items, (needs or {}).get(d)) for d in dsts}
    sources, _ = _choose_sources(items, dsts, [info for _, info in everyone], wanted)
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
        items,
        buckets,
        bucket_bytes,
        dsts,
        dtype,
        ps.world_size,
        ps.rank,
        rounds_in_flight,
        sources.get(ps.rank),
        sends,
        recvs,
        pair_bytes,
        mine,
        wanted,
        quantize,
    )
