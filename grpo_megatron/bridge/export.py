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
   smaller for a model of fewer than ``MIN_ROUNDS`` quarter buckets, so its transfer still pipelines);
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
most ``rounds_in_flight`` rounds (``_BufferPool``: reused from round to round, never more buffers than
were in use at once), plus, on a destination, the bucket being filled; no rank holds a whole version
unless a consumer keeps the buckets.

Where each part lives: this module runs the stream (``export_hf_stream``: steps 4 and 5); the
metadata exchange, the source choice and the plan of buckets, rounds and messages (steps 1 to 3:
``plan_export``, ``ExportPlan``, ``TransferStats``) are in bridge/export_plan.py; the assembly of HF
tensors from slices (``assemble_hf``) in bridge/assemble.py; one bucket as one flat buffer
(``Bucket``, ``broadcast_bucket``) in bridge/bucket_io.py; the Hugging Face directory writer
(``write_hf_checkpoint``, ``SafetensorsWriter``) in bridge/safetensors_writer.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.bridge.assemble import assemble_hf, views_of_one_slice
from grpo_megatron.bridge.bucket_io import Bucket
from grpo_megatron.bridge.export_plan import ExportPlan, TransferStats, _Item, _Message, plan_export
from grpo_megatron.bridge.transforms import to_hf
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
    plan: ExportPlan | None = None,
    device: torch.device | str = "cpu",
    stats: TransferStats | None = None,
    borrow: bool = False,
    into: Callable[[str], torch.Tensor | None] | None = None,
    every_round: bool = False,
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

    ``every_round`` (with ``borrow``): a destination yields once per round even when the round
    brings it nothing (an empty bucket), so destinations with different ``needs`` yield the same
    number of buckets (the GPUs of one SGLang engine load each round in one call together).
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
    pool = _BufferPool(out_device, stats)

    def post(k: int) -> tuple[list, list[tuple[torch.Tensor, _Message, bool]], list[torch.Tensor]]:
        """Pack this rank's sends of round k, take buffers for its receives, and post them all in one
        batch; returns the round's works, its receives and the pool's buffers it took."""
        ops, inbox, taken = [], [], []
        for msg in plan.sends[k]:
            stats.sent_bytes += msg.nbytes
            if msg.direct:
                index, _, _ = msg.parts[0]
                shard = mine[items[index].rule.mcore]
                if shard.dtype == items[index].dtype and shard.device == out_device and shard.is_contiguous():
                    ops.append(dist.P2POp(dist.isend, shard.reshape(-1).view(torch.uint8), msg.peer))
                    continue  # sent from the weights themselves: no copy
            taken.append(pool.take(msg.nbytes))
            flat_u8 = taken[-1][: msg.nbytes]
            for index, slot, offset in msg.parts:
                _view(flat_u8, offset, items[index], slot).copy_(mine[items[index].rule.mcore])
            ops.append(dist.P2POp(dist.isend, flat_u8, msg.peer))
        for msg in plan.recvs[k]:
            stats.received_bytes += msg.nbytes
            first = items[msg.parts[0][0]]
            whole = msg.direct and views_of_one_slice(first.rule, first.dim)
            place = _place_of(first, into, out_device) if whole and into else None
            if place is not None:
                ops.append(dist.P2POp(dist.irecv, place, msg.peer))
                inbox.append((place, msg, True))
                stats.in_place_bytes += msg.nbytes
                continue  # received straight where the consumer wants it: no copy
            taken.append(pool.take(msg.nbytes))
            flat_u8 = taken[-1][: msg.nbytes]
            ops.append(dist.P2POp(dist.irecv, flat_u8, msg.peer))
            inbox.append((flat_u8, msg, False))
        return (dist.batch_isend_irecv(ops) if ops else []), inbox, taken

    rounds = [rnd for bucket in plan.buckets for rnd in bucket]
    last_of_bucket = {sum(len(b) for b in plan.buckets[: i + 1]) - 1 for i in range(len(plan.buckets))}
    sources = plan.sources
    bucket: Bucket = []
    bucket_held = 0

    def finish(
        k: int, works: list, inbox: list[tuple[torch.Tensor, _Message, bool]], taken: list[torch.Tensor]
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
                if not sources[index]:  # not among what this destination receives (``needs``)
                    continue
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
        if borrow and (bucket or (every_round and sources is not None)):  # while the round's buffers live
            out, bucket = bucket, []
            yield out
            stats.drop(bucket_held)
            bucket_held = 0
        works.clear()  # the round's buffers go back to the pool here, before the bucket is handed on
        inbox.clear()
        pool.give(taken)
        if sources is not None and k in last_of_bucket and bucket:
            out, bucket = bucket, []
            stats.drop(bucket_held)
            bucket_held = 0
            yield out

    in_flight: deque[tuple[int, list, list, list]] = deque()
    for k in range(len(rounds)):
        if len(in_flight) == plan.rounds_in_flight:
            yield from finish(*in_flight.popleft())
        in_flight.append((k, *post(k)))
    while in_flight:
        yield from finish(*in_flight.popleft())
    pool.close()


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
    return views_of_one_slice(item.rule, item.dim) and shard.dtype == item.dtype and shard.device == device



def _view(flat_u8: torch.Tensor, offset: int, item: _Item, slot: int) -> torch.Tensor:
    nbytes = item.slice_bytes(slot)
    return flat_u8[offset : offset + nbytes].view(item.dtype).view(item.slice_shapes[slot])
