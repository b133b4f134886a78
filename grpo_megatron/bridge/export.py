"""Streaming export: megatron shards -> Hugging Face-named full tensors, in byte-budgeted buckets.

This is the resharding core: the per-iteration weight sync to rollout engines, the mcore-to-hf
converter and the tests all consume the same stream.

How the bytes travel (every rank derives the same plan from one metadata exchange, so the
point-to-point messages line up without further negotiation):
1. metadata: each rank announces the shards it holds in the first data-parallel copy (name, shape,
   dtype, TP/ETP slice) in one ``all_gather_object``. Every slice of a canonical tensor then has one
   source: the destination if it holds a copy, else the lowest rank holding one (of the
   expert-data-parallel copies, one is sent; tensors TP does not split come from TP rank 0 only);
2. plan: the adapter's export rules, in HF order, are cut into buckets (a bucket closes once it
   holds ``bucket_bytes``) and each bucket into ``ROUNDS_PER_BUCKET`` transfer rounds;
3. per round, every rank packs its slices into one flat byte buffer, cast to the export dtype there
   (a bf16 export of fp32 weights moves half the bytes), and sends it to the destination: one
   message per rank per round, however many tensors the round holds. Nothing is all-gathered:
   each byte travels once, from its owner to the destination, which covers the TP/ETP gather, the
   EP gather of experts and the PP hand-off in one pattern;
4. the destination posts the receives of the next round before it assembles the current one, and
   writes every slice straight into its place in the new HF tensors (``assemble_hf``: one copy per
   byte; QKV de-interleaving, GLU halves and vocabulary padding are handled slice by slice).

Memory: only the destination materialises full tensors. It holds the bucket being filled plus at
most two rounds of received bytes (about 1.5 buckets in all); other ranks hold at most two rounds of
their own packed slices. ``broadcast_bucket`` then fans a bucket out from one rank to many (e.g.
from the first rank of a rollout engine to its other ranks) as one byte buffer plus its metadata.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.bridge.layout import is_first_replica, local_tensors, rules_by_name, tp_group_of
from grpo_megatron.bridge.transforms import hf_shapes, to_hf
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.models.weight_rules import WeightRule

Bucket = list[tuple[str, torch.Tensor]]
Consumer = Callable[[Bucket], None]

ROUNDS_PER_BUCKET = 4
"""Transfer rounds per bucket: bounds the received bytes held beside the bucket (two rounds)."""
_ALIGN = 16  # byte offset alignment in flat buffers, so any dtype can view its slice in place


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


@dataclass(frozen=True)
class _Slice:
    """One rank's slice of a canonical tensor (the whole tensor when TP/ETP does not split it)."""

    rank: int  # global rank it is sent from
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class _Item:
    """One canonical megatron tensor of the stream, as every rank sees it after the metadata exchange."""

    rule: WeightRule
    shape: tuple[int, ...]  # canonical (unsharded) megatron shape
    dim: int | None  # dimension its slices split; None: one slice holds it all
    glu: bool  # slices hold [gate_r; up_r] (see bridge/layout.py)
    dtype: torch.dtype  # exported dtype
    slices: tuple[_Slice, ...]  # in TP/ETP rank order
    hf_bytes: int  # bytes of its HF tensors (vocabulary padding stripped)


def _announce(
    model: torch.nn.Module, ps: ParallelState, rules: Mapping[str, WeightRule]
) -> tuple[list, dict]:
    """This rank's metadata entries and its local tensors by canonical name."""
    entries: list[tuple[str, tuple[int, ...], str, int | None, bool, int, int]] = []
    mine: dict[str, torch.Tensor] = {}
    for _, tensor, layout in local_tensors(model, ps, rules):
        if not is_first_replica(layout, ps):
            continue
        _, size, slot = tp_group_of(layout, ps)
        split = layout.partition_dim is not None and size > 1
        if not split and slot != 0:
            continue  # a replica of TP rank 0's copy
        mine[layout.canonical_name] = tensor.detach()
        entries.append((
            layout.canonical_name, tuple(tensor.shape), str(tensor.dtype),
            layout.partition_dim if split else None, layout.glu, size if split else 1, slot if split else 0,
        ))  # fmt: skip
    return entries, mine


def _plan(
    rules: Mapping[str, WeightRule],
    everyone: Sequence[list | None],
    dtype: torch.dtype | None,
    model_type: Any,
    dst: int,
) -> list[_Item]:
    """The stream's tensors in HF order, each with the rank sending each of its slices: the
    destination when it holds a copy (nothing to send), else the lowest rank holding one."""
    slices: dict[str, dict[int, _Slice]] = {}
    info: dict[str, tuple[int | None, bool, int, str]] = {}
    for rank, entries in enumerate(everyone):
        for canonical, shape, dt, dim, glu, size, slot in entries or []:
            by_slot = slices.setdefault(canonical, {})
            if slot not in by_slot or rank == dst:
                by_slot[slot] = _Slice(rank, tuple(shape))
            info.setdefault(canonical, (dim, glu, size, dt))
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
        dim, glu, size, dt = info[rule.mcore]
        by_slot = slices[rule.mcore]
        if sorted(by_slot) != list(range(size)):
            raise RuntimeError(
                f"{rule.mcore}: TP/ETP slices {sorted(by_slot)} announced, expected 0..{size - 1}"
            )
        shape = list(by_slot[0].shape)
        if dim is not None:
            shape[dim] *= size
        out_dtype = dtype or _dtype(dt)
        slices_in_order = tuple(by_slot[r] for r in range(size))
        hf_bytes = _hf_numel(rule, shape) * out_dtype.itemsize
        items.append(_Item(rule, tuple(shape), dim, glu, out_dtype, slices_in_order, hf_bytes))
    return items


def _hf_numel(rule: WeightRule, shape: Sequence[int]) -> int:
    """Elements of the HF tensors of a canonical tensor: all of it (QKV and GLU only regroup rows)
    but the vocabulary padding. Arithmetic, not ``hf_shapes``: it runs once per tensor per export."""
    if rule.kind == "vocab":
        assert rule.vocab_size is not None
        return rule.vocab_size * math.prod(shape[1:])
    return math.prod(shape)


def _schedule(items: list[_Item], bucket_bytes: int) -> list[list[list[_Item]]]:
    """Buckets (closed once they hold ``bucket_bytes``), each cut into rounds of about a
    ``ROUNDS_PER_BUCKET``-th of a bucket (a tensor is never split)."""
    round_bytes = max(bucket_bytes // ROUNDS_PER_BUCKET, 1)
    buckets: list[list[list[_Item]]] = []
    rounds: list[list[_Item]] = []
    rnd: list[_Item] = []
    filled = in_round = 0
    for item in items:
        if rnd and in_round + item.hf_bytes > round_bytes:
            rounds.append(rnd)
            rnd, in_round = [], 0
        rnd.append(item)
        in_round += item.hf_bytes
        filled += item.hf_bytes
        if filled >= bucket_bytes:
            buckets.append([*rounds, rnd])
            rounds, rnd, filled, in_round = [], [], 0, 0
    if rnd:
        rounds.append(rnd)
    if rounds:
        buckets.append(rounds)
    return buckets


def _message(rnd: list[_Item], rank: int) -> tuple[list[tuple[_Item, int, int]], int]:
    """(tensor, slice index, byte offset) of every slice ``rank`` sends in round ``rnd``, and the
    message's size in bytes."""
    parts, total = [], 0
    for item in rnd:
        for slot, sl in enumerate(item.slices):
            if sl.rank == rank:
                parts.append((item, slot, total))
                total += _aligned(sl.numel * item.dtype.itemsize)
    return parts, total


def _view(flat_u8: torch.Tensor, offset: int, sl: _Slice, dtype: torch.dtype) -> torch.Tensor:
    return flat_u8[offset : offset + sl.numel * dtype.itemsize].view(dtype).view(sl.shape)


def _send_round(
    rnd: list[_Item], ps: ParallelState, mine: Mapping[str, torch.Tensor], dst: int
) -> tuple[list, Any]:
    """Pack this rank's slices of ``rnd`` (cast to the export dtype) and start sending them."""
    parts, total = _message(rnd, ps.rank)
    if not parts:
        return [], None
    flat_u8 = torch.empty(total, dtype=torch.uint8, device=ps.device)
    for item, slot, offset in parts:
        _view(flat_u8, offset, item.slices[slot], item.dtype).copy_(mine[item.rule.mcore])
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, flat_u8, dst)]), flat_u8


def _post_receives(rnd: list[_Item], ps: ParallelState) -> tuple[list, dict[int, tuple[torch.Tensor, list]]]:
    """Start receiving every other rank's message of ``rnd`` (on the destination)."""
    inbox: dict[int, tuple[torch.Tensor, list]] = {}
    for rank in range(ps.world_size):
        if rank == ps.rank:
            continue
        parts, total = _message(rnd, rank)
        if parts:
            inbox[rank] = (torch.empty(total, dtype=torch.uint8, device=ps.device), parts)
    ops = [dist.P2POp(dist.irecv, buf, rank) for rank, (buf, _) in inbox.items()]
    return (dist.batch_isend_irecv(ops) if ops else []), inbox


@dataclass(frozen=True)
class ExportPlan:
    """The outcome of the metadata exchange: every tensor of the stream, who sends which slice of it,
    cut into buckets and rounds. It depends only on the model's layout (not on the weights), so one
    plan serves every export of the same model at the same layout, destination, bucket size and dtype
    (the per-iteration weight sync computes it once instead of gathering every rank's metadata each
    time)."""

    buckets: list[list[list[_Item]]]
    bucket_bytes: int
    dst_rank: int
    dtype: torch.dtype | None
    world_size: int


def plan_export(
    model: torch.nn.Module,
    ps: ParallelState,
    hf: Mapping[str, Any],
    *,
    bucket_bytes: int = 512 << 20,
    dst_rank: int = 0,
    dtype: torch.dtype | None = None,
) -> ExportPlan:
    """Collective: exchange shard metadata (names, shapes, dtypes, slices; no weights) and plan the stream."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    if not 0 <= dst_rank < ps.world_size:
        raise ValueError(f"dst_rank={dst_rank} is not a rank of this world of {ps.world_size}")
    rules = rules_by_name(hf)
    entries, _ = _announce(model, ps, rules)
    everyone: list[list | None] = [None] * ps.world_size
    dist.all_gather_object(everyone, entries)
    buckets = _schedule(_plan(rules, everyone, dtype, hf.get("model_type"), dst_rank), bucket_bytes)
    return ExportPlan(buckets, bucket_bytes, dst_rank, dtype, ps.world_size)


def export_hf_stream(
    model: torch.nn.Module,
    ps: ParallelState,
    hf: Mapping[str, Any],
    *,
    bucket_bytes: int = 512 << 20,
    dst_rank: int = 0,
    dtype: torch.dtype | None = None,
    plan: ExportPlan | None = None,
) -> Iterator[Bucket]:
    """Yield buckets of (HF name, full CPU tensor) on ``dst_rank``; other ranks yield nothing but
    must iterate the generator to the end (they send their slices from inside it).

    ``bucket_bytes``: a bucket is yielded once it holds at least this many bytes (a tensor is
    never split). ``dtype``: cast on export, on the sending rank (None keeps the training dtype).
    ``plan``: a ``plan_export`` result made with these same settings, to skip the metadata exchange;
    None = plan now. Every yielded tensor owns its memory: a consumer may keep any of them.
    """
    if plan is None:
        plan = plan_export(model, ps, hf, bucket_bytes=bucket_bytes, dst_rank=dst_rank, dtype=dtype)
    elif (plan.bucket_bytes, plan.dst_rank, plan.dtype, plan.world_size) != (
        bucket_bytes, dst_rank, dtype, ps.world_size
    ):
        raise ValueError(
            f"export plan made for bucket_bytes={plan.bucket_bytes}, dst_rank={plan.dst_rank}, "
            f"dtype={plan.dtype}, world {plan.world_size}; asked for {bucket_bytes}, {dst_rank}, {dtype}, "
            f"{ps.world_size}: make a new plan with plan_export"
        )
    _, mine = _announce(model, ps, rules_by_name(hf))  # this rank's tensors as they are now
    buckets = plan.buckets
    rounds = [rnd for bucket in buckets for rnd in bucket]

    if ps.rank != dst_rank:
        # At most two packed rounds alive: round k + 1 is packed while round k is on the wire.
        in_flight: list[tuple[list, Any]] = []
        for rnd in rounds:
            if len(in_flight) == 2:
                for work in in_flight.pop(0)[0]:
                    work.wait()
            in_flight.append(_send_round(rnd, ps, mine, dst_rank))
        for works, _ in in_flight:
            for work in works:
                work.wait()
        return

    cpu = torch.device("cpu")
    pending = _post_receives(rounds[0], ps) if rounds else ([], {})
    index = 0
    for bucket_rounds in buckets:
        bucket: Bucket = []
        for rnd in bucket_rounds:
            works, inbox = pending
            index += 1
            # The next round's bytes arrive while this one is assembled.
            pending = _post_receives(rounds[index], ps) if index < len(rounds) else ([], {})
            for work in works:
                work.wait()
            received: dict[tuple[str, int], torch.Tensor] = {}
            for flat_u8, parts in inbox.values():
                flat_u8 = flat_u8.to(cpu)  # no-op on CPU; one device-to-host copy per message on GPU
                for item, slot, offset in parts:
                    received[(item.rule.mcore, slot)] = _view(flat_u8, offset, item.slices[slot], item.dtype)
            for item in rnd:
                shards = [
                    mine[item.rule.mcore] if sl.rank == dst_rank else received[(item.rule.mcore, slot)]
                    for slot, sl in enumerate(item.slices)
                ]
                bucket += assemble_hf(item.rule, item.shape, item.dim, item.glu, shards, item.dtype)
        yield bucket


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
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one canonical megatron tensor of ``shape``, written from its TP/ETP slices
    (``shards[r]`` is slice r along ``dim``; one shard and ``dim=None`` when unsplit; ``glu``: each
    slice holds ``[gate_r; up_r]``) into new CPU tensors of ``dtype``: each byte is copied once."""
    if dim is None and rule.kind != "qkv":
        # Fast path (most tensors at world 1, experts at ETP 1): the HF tensors are views of the
        # shard (whole, GLU halves along dim 0, the real vocabulary rows): one copying op each.
        return [
            (name, view.to(device="cpu", dtype=dtype, copy=True, memory_format=torch.contiguous_format))
            for name, view in to_hf(rule, shards[0])
        ]
    outs = [torch.empty(s, dtype=dtype) for s in hf_shapes(rule, shape)]
    if len(shape) == 0:  # a scalar: nothing to place
        outs[0].copy_(shards[0])
        return list(zip(rule.hf, outs, strict=True))
    split_dim = 0 if dim is None else dim
    segments = _segments(shards, dim, glu)
    placements = _placements(rule, shape, split_dim, segments)
    if placements is None:
        full = torch.empty(tuple(shape), dtype=dtype)
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


def export_hf(
    model: torch.nn.Module,
    ps: ParallelState,
    hf: Mapping[str, Any],
    consumer: Consumer,
    *,
    bucket_bytes: int = 512 << 20,
    dst_rank: int = 0,
    dtype: torch.dtype | None = None,
) -> None:
    """Run the export stream on every rank; ``consumer(bucket)`` is called on ``dst_rank``."""
    for bucket in export_hf_stream(model, ps, hf, bucket_bytes=bucket_bytes, dst_rank=dst_rank, dtype=dtype):
        consumer(bucket)


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
