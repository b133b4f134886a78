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
   holds ``bucket_bytes``) and each bucket into ``ROUNDS_PER_BUCKET`` transfer rounds (rounds are
   smaller for a model of fewer than ``MIN_ROUNDS`` quarter buckets, so its transfer still pipelines,
   but hold ``MIN_ROUND_BYTES`` at least: a tiny model goes in one round);
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
   further (``Landing.borrow``, ``Landing.into``): the HF tensors are written straight into the
   engine's weights, whole slices are even received there, and what needs no assembly is handed on
   as views.

Memory (``TransferStats`` measures it): a rank holds the packed sends and the receive buffers of at
most ``rounds_in_flight`` rounds (``_BufferPool``: reused from round to round, never more buffers than
were in use at once), plus, on a destination, the bucket being filled; no rank holds a whole version
unless a consumer keeps the buckets.

Where each part lives: this module runs the stream (``ExportStream``, one run of a plan: steps 4
and 5; ``export_hf_stream`` plans and runs it); the metadata exchange, the source choice and the
plan of buckets, rounds and messages (steps 1 to 3: ``plan_export``, ``ExportPlan``,
``TransferStats``) are in bridge/export_plan.py; the assembly of HF tensors from slices
(``assemble_hf``) and where a destination lands each tensor (``Landing``) in bridge/assemble.py;
``Bucket`` in bridge/bucket_io.py; the Hugging Face directory writer (``write_hf_checkpoint``,
``SafetensorsWriter``) in bridge/safetensors_writer.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.bridge.assemble import Landing
from grpo_megatron.bridge.bucket_io import Bucket
from grpo_megatron.bridge.export_plan import (
    ExportItem,
    ExportPlan,
    Message,
    TransferStats,
    plan_export,
    read_shard,
)
from grpo_megatron.bridge.fp8 import Fp8Weights
from grpo_megatron.distributed.bootstrap import ParallelState


def export_hf_stream(
    model: torch.nn.Module,
    ps: ParallelState,
    hf: Mapping[str, Any],
    *,
    bucket_bytes: int = 512 << 20,
    dst_rank: int = 0,
    dst_ranks: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    adapters: bool = False,
) -> Iterator[Bucket]:
    """Plan the export (collective, ``plan_export``) and yield its buckets of (HF name, full CPU
    tensor, owning its memory) on every destination rank (``dst_ranks``, default ``[dst_rank]``),
    all of them receiving at once; the other ranks yield nothing but must iterate the generator to
    the end (they send their slices from inside it), and so must every destination.

    ``bucket_bytes``: a bucket is yielded once it holds at least this many bytes (a tensor is never
    split). ``dtype``: cast on export, on the sending rank (None keeps the training dtype). To reuse a
    plan, or to deliver elsewhere than into new CPU tensors, run ``ExportStream`` on the plan.
    ``adapters``: the LoRA adapters instead of the (merged) model (``plan_export``)."""
    plan = plan_export(
        model,
        ps,
        hf,
        bucket_bytes=bucket_bytes,
        dst_rank=dst_rank,
        dst_ranks=dst_ranks,
        dtype=dtype,
        adapters=adapters,
    )
    yield from ExportStream(plan)


@dataclass
class _Round:
    """One posted transfer round: its works, its receives (buffer, message, received in place) and
    the pool's buffers it took."""

    k: int
    works: list[Any]
    inbox: list[tuple[torch.Tensor, Message, bool]] = field(default_factory=list)
    taken: list[torch.Tensor] = field(default_factory=list)


class ExportStream:
    """One run of an ``ExportPlan`` on this rank: iterate it (once) to send this rank's slices and,
    on a destination, to get its buckets of (HF name, tensor). Every rank of the plan's world must
    iterate it to the end, destinations included (their sends to the others run inside it).

    The plan is the only carrier of the export's settings (bucket size, destinations, dtype, rounds
    in flight); the stream takes only how a destination lands what it receives (``landing``: where
    the bytes travel and the tensors are made, ``Landing.device``, "cpu" for writers, the engine's
    device for the weight sync, so on GPU they go device-to-device and never through host memory;
    borrowed views, the consumer's places), where to count the transport's bytes (``stats``), and
    ``every_round`` (with ``Landing.borrow``): a destination yields once per round even when the
    round brings it nothing, so destinations with different ``needs`` yield the same number of
    buckets (the GPUs of one SGLang engine load each round in one call together).

    Without ``Landing.borrow`` every yielded tensor owns its memory (a consumer may keep any of
    them) and a bucket is yielded once it holds ``plan.bucket_bytes``. With it (the weight sync,
    whose engines copy every tensor into their live weights at once), each round is yielded as
    soon as it is in, and borrowed views are valid only until the consumer returns to the
    generator: copy them, never keep them.

    Per round k: ``_post`` packs this rank's sends and takes buffers for its receives, all posted in
    one batch, ``plan.rounds_in_flight`` rounds ahead; ``_finish`` waits for round k, ``_receive``
    finds each received slice, ``_land`` lands each tensor of the round (``Landing.land``), and the
    bucket is handed on (``_hand_on``).
    """

    def __init__(
        self,
        plan: ExportPlan,
        landing: Landing | None = None,
        *,
        stats: TransferStats | None = None,
        every_round: bool = False,
    ) -> None:
        self.plan = plan
        self.landing = landing if landing is not None else Landing(torch.device("cpu"))
        if plan.quantize is not None and self.landing.into is not None:
            raise ValueError(
                "a quantized export (ExportPlan.quantize) is made of new FP8 tensors: it lands into no "
                "consumer's places (Landing.into)"
            )
        self.stats = stats if stats is not None else TransferStats()
        self.every_round = every_round
        self.pool = _BufferPool(self.landing.device, self.stats)
        self.rounds = [rnd for bucket in plan.buckets for rnd in bucket]
        self.last_of_bucket = {
            sum(len(b) for b in plan.buckets[: i + 1]) - 1 for i in range(len(plan.buckets))
        }
        self.bucket: Bucket = []
        self.held = 0  # bytes of new tensors (way 4) in ``bucket``

    def __iter__(self) -> Iterator[Bucket]:
        in_flight: deque[_Round] = deque()
        for k in range(len(self.rounds)):
            if len(in_flight) == self.plan.rounds_in_flight:
                yield from self._finish(in_flight.popleft())
            in_flight.append(self._post(k))
        while in_flight:
            yield from self._finish(in_flight.popleft())
        self.pool.close()

    def _post(self, k: int) -> _Round:
        """Pack this rank's sends of round k, take buffers for its receives (or receive straight into
        the consumer's places), and post them all in one batch."""
        plan, stats, mine, items = self.plan, self.stats, self.plan.local, self.plan.items
        device = self.landing.device
        ops: list[dist.P2POp] = []
        rnd = _Round(k, [])
        for msg in plan.sends[k]:
            stats.sent_bytes += msg.nbytes
            if msg.direct:
                index, _, _ = msg.parts[0]
                shard = mine[items[index].rule.mcore]
                if (
                    isinstance(shard, torch.Tensor)  # not a merged LoRA weight, made for this read
                    and shard.dtype == items[index].dtype
                    and shard.device == device
                    and shard.is_contiguous()
                ):
                    ops.append(dist.P2POp(dist.isend, shard.reshape(-1).view(torch.uint8), msg.peer))
                    continue  # sent from the weights themselves: no copy
            rnd.taken.append(self.pool.take(msg.nbytes))
            flat_u8 = rnd.taken[-1][: msg.nbytes]
            for index, slot, offset in msg.parts:
                _view(flat_u8, offset, items[index], slot).copy_(read_shard(mine[items[index].rule.mcore]))
            ops.append(dist.P2POp(dist.isend, flat_u8, msg.peer))
        for msg in plan.recvs[k]:
            stats.received_bytes += msg.nbytes
            place = self.landing.receive_place(items[msg.parts[0][0]], msg.direct)
            if place is not None:
                ops.append(dist.P2POp(dist.irecv, place, msg.peer))
                rnd.inbox.append((place, msg, True))
                stats.in_place_bytes += msg.nbytes
                continue  # received straight where the consumer wants it: no copy
            rnd.taken.append(self.pool.take(msg.nbytes))
            flat_u8 = rnd.taken[-1][: msg.nbytes]
            ops.append(dist.P2POp(dist.irecv, flat_u8, msg.peer))
            rnd.inbox.append((flat_u8, msg, False))
        rnd.works = dist.batch_isend_irecv(ops) if ops else []
        return rnd

    def _finish(self, rnd: _Round) -> Iterator[Bucket]:
        """Wait for round ``rnd.k``; on a destination, land its tensors and hand the bucket on."""
        for work in rnd.works:
            work.wait()
        if self.plan.sources is not None:
            received, landed = self._receive(rnd)
            self._land(rnd.k, received, landed)
            received.clear()
        yield from self._hand_on(rnd)

    def _receive(self, rnd: _Round) -> tuple[dict[tuple[int, int], torch.Tensor], set[int]]:
        """Round ``rnd``'s received slices by (item, slot), and the items received in place."""
        received: dict[tuple[int, int], torch.Tensor] = {}
        landed: set[int] = set()
        for flat_u8, msg, in_place in rnd.inbox:
            if in_place:
                landed.add(msg.parts[0][0])
                continue
            for index, slot, offset in msg.parts:
                received[(index, slot)] = _view(flat_u8, offset, self.plan.items[index], slot)
        return received, landed

    def _land(self, k: int, received: dict[tuple[int, int], torch.Tensor], landed: set[int]) -> None:
        """Land every tensor of round k this destination receives into the bucket (``Landing.land``)."""
        plan = self.plan
        assert plan.sources is not None
        for index in self.rounds[k]:
            item = plan.items[index]
            if not plan.sources[index]:  # not among what this destination receives (``needs``)
                continue
            shards = (
                []
                if index in landed
                else [
                    read_shard(plan.local[item.rule.mcore]) if src == plan.rank else received[(index, slot)]
                    for slot, src in enumerate(plan.sources[index])
                ]
            )
            pieces, held = self.landing.land(item, shards, index in landed)
            if plan.quantize is not None:
                pieces, held = _quantized(plan.quantize, pieces, held, self.stats)
            self.bucket += pieces
            if held:
                self.held += held
                self.stats.hold(held)

    def _hand_on(self, rnd: _Round) -> Iterator[Bucket]:
        """Yield the bucket: with ``borrow``, every round while its buffers live; then the round's
        buffers go back to the pool (before a full bucket is handed on at its bucket's last round)."""
        is_dst = self.plan.sources is not None
        if self.landing.borrow and (self.bucket or (self.every_round and is_dst)):
            out, self.bucket = self.bucket, []
            yield out
            self.stats.drop(self.held)
            self.held = 0
        rnd.works.clear()
        rnd.inbox.clear()
        self.pool.give(rnd.taken)
        if is_dst and rnd.k in self.last_of_bucket and self.bucket:
            out, self.bucket = self.bucket, []
            self.stats.drop(self.held)
            self.held = 0
            yield out


class _BufferPool:
    """The flat byte buffers of one stream's packed sends and receives, reused from round to round.

    Why: a fresh CPU buffer costs a page fault per 4 KiB page on first touch (the kernel maps and
    zeroes it; glibc returns allocations this large to the kernel on free), about 18k faults per sync
    at each engine rank of the CPU bench, more CPU than the copy of the bytes themselves. Reused,
    only the first ``rounds_in_flight`` rounds allocate. ``stats`` counts every buffer the pool owns,
    idle ones included, so the transport's peak stays measured; a pool never holds more buffers than
    its stream used at once."""

    def __init__(self, device: torch.device, stats: TransferStats) -> None:
        self.device, self.stats = device, stats
        self.spare: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes``: the smallest spare that fits, else a new one (a spare too
        small to serve is freed then, so the pool never owns more buffers than were in use at once)."""
        fits = [i for i, b in enumerate(self.spare) if b.numel() >= nbytes]
        if fits:
            return self.spare.pop(min(fits, key=lambda i: self.spare[i].numel()))
        if self.spare:
            self.stats.drop(self.spare.pop().numel())
        self.stats.hold(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buffers: list[torch.Tensor]) -> None:
        """Buffers from ``take`` whose round is done."""
        self.spare += buffers
        buffers.clear()

    def close(self) -> None:
        self.stats.drop(sum(b.numel() for b in self.spare))
        self.spare.clear()


def _quantized(quantize: Fp8Weights, pieces: Bucket, held: int, stats: TransferStats) -> tuple[Bucket, int]:
    """``pieces`` as the destination receives them under ``quantize`` (bridge/fp8.py: a selected tensor
    becomes its FP8 weight and scales, made on its device), and the bytes of new tensors they hold: the
    quantized ones, and the others when ``held`` says they were new (way 4 of ``Landing``). A new
    bf16 tensor and its FP8 form live together while it is quantized (counted in the peak)."""
    out = quantize.quantize(pieces)
    kept = {id(t) for _, t in pieces}
    made = sum(t.numel() * t.element_size() for _, t in out if id(t) not in kept)
    stats.hold(held + made)  # the new bf16 tensors (``held``) and their FP8 forms, momentarily together
    stats.drop(held + made)
    if held:
        return out, sum(t.numel() * t.element_size() for _, t in out)
    return out, made


def _view(flat_u8: torch.Tensor, offset: int, item: ExportItem, slot: int) -> torch.Tensor:
    """Slice ``slot`` of ``item`` in a packed message's bytes at ``offset``."""
    nbytes = item.slice_bytes(slot)
    return flat_u8[offset : offset + nbytes].view(item.dtype).view(item.slice_shapes[slot])
