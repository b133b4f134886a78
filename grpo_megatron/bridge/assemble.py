"""Assembling the HF tensors of one canonical megatron tensor from its TP/ETP slices
(``assemble_hf``): each byte is copied once, QKV de-interleaving, GLU halves and vocabulary padding
are handled slice by slice; and where the export stream's destinations (bridge/export.py) land
what they receive (``Landing``: the four ways, decided in one place)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from grpo_megatron.bridge.bucket_io import Bucket
from grpo_megatron.bridge.export_plan import ExportItem
from grpo_megatron.bridge.transforms import hf_shapes, to_hf
from grpo_megatron.models.weight_rules import WeightRule

Places = Callable[[str], torch.Tensor | None]
"""Where the consumer will copy each HF tensor, by HF name, or None (the weight sync passes its
engine's ``RolloutEngine.load_target``)."""


def views_of_one_slice(rule: WeightRule, dim: int | None) -> bool:
    """Whether a canonical tensor's HF tensors are views of its one slice: unsplit (``dim`` None),
    and not QKV, whose per-group split into q, k and v is not a view of its rows."""
    return dim is None and rule.kind != "qkv"


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
            raise ValueError(
                f"{rule.hf}: places of shapes {[tuple(o.shape) for o in outs]}, expected {wanted}"
            )
        if views_of_one_slice(rule, dim):
            for out, (_, view) in zip(outs, to_hf(rule, shards[0]), strict=True):
                out.copy_(view)
            return list(zip(rule.hf, outs, strict=True))
    elif views_of_one_slice(rule, dim):
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


@dataclass(frozen=True)
class Landing:
    """Where a destination of the export stream lands each canonical tensor it receives: the one
    place the choice is made. Four ways, tried in this order:

    1. received in place: a whole slice that travels alone (``Message.direct``) whose HF tensors'
       places (``into``) lie exactly as the slice (contiguous, adjacent, in the export dtype on
       ``device``) is received straight into them (``receive_place``, asked before the receive is
       posted); its names are handed on with their places (nothing left to copy);
    2. borrowed (``borrow``): one slice already in the export dtype on ``device`` whose HF tensors are
       views of it is handed on as those views (of this rank's shard or of the received message):
       the consumer's copy is the only one, and the views are valid only until it returns;
    3. assembled into the consumer's places (``into``: each exists, contiguous, in the export dtype
       on ``device``);
    4. assembled into new tensors on ``device``, owned by the bucket (held until it is handed on).
    """

    device: torch.device
    borrow: bool = False
    into: Places | None = None

    def receive_place(self, item: ExportItem, direct: bool) -> torch.Tensor | None:
        """Way 1: a flat byte view of the consumer's places of ``item``'s HF tensors to receive its
        one slice into, when it travels alone (``direct``) and they lie exactly as the slice; else None."""
        if not (direct and views_of_one_slice(item.rule, item.dim) and self.into):
            return None
        pieces = to_hf(item.rule, torch.empty(item.slice_shapes[0], dtype=item.dtype, device="meta"))
        places = [self.into(name) for name, _ in pieces]
        first = places[0]
        if first is None:
            return None
        base = first.data_ptr()
        for (_, piece), place in zip(pieces, places, strict=True):
            if (
                place is None
                or place.dtype != item.dtype
                or place.device != self.device
                or not place.is_contiguous()
                or tuple(place.shape) != tuple(piece.shape)
                or not piece.is_contiguous()
                or place.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or place.data_ptr() - base != piece.storage_offset() * item.dtype.itemsize
            ):
                return None
        if sum(p.numel() for _, p in pieces) * item.dtype.itemsize != item.slice_bytes(0):
            return None  # the slice holds more than its HF tensors (vocabulary padding)
        flat_u8 = torch.empty(0, dtype=torch.uint8, device=self.device)
        return flat_u8.set_(
            first.untyped_storage(),
            first.storage_offset() * item.dtype.itemsize,
            (item.slice_bytes(0),),
            (1,),
        )

    def land(
        self, item: ExportItem, shards: Sequence[torch.Tensor], received_in_place: bool
    ) -> tuple[Bucket, int]:
        """``item``'s (HF name, tensor) pairs from its slices (``shards``, in slice order; unused when
        ``received_in_place``), and the bytes of new tensors they hold (way 4; else 0)."""
        if received_in_place:  # way 1: already in the consumer's places
            assert self.into is not None
            return [(name, _present(self.into(name), name)) for name in item.rule.hf], 0
        if self.borrow and _borrowable(item, shards[0], self.device):  # way 2
            return to_hf(item.rule, shards[0]), 0
        places = self._places(item)
        if places is not None:  # way 3
            return assemble_hf(
                item.rule, item.shape, item.dim, item.glu, shards, item.dtype, self.device, places
            ), 0
        pieces = assemble_hf(
            item.rule, item.shape, item.dim, item.glu, shards, item.dtype, self.device
        )  # way 4
        return pieces, item.hf_bytes

    def _places(self, item: ExportItem) -> list[torch.Tensor] | None:
        """The consumer's places of ``item``'s HF tensors when every one exists, is contiguous and in
        the export dtype on ``device``, else None."""
        if self.into is None:
            return None
        places = [self.into(name) for name in item.rule.hf]
        kept = [
            p
            for p in places
            if p is not None and p.dtype == item.dtype and p.device == self.device and p.is_contiguous()
        ]
        return kept if len(kept) == len(places) else None


def _borrowable(item: ExportItem, shard: torch.Tensor, device: torch.device) -> bool:
    """Whether ``item``'s HF tensors can be handed on as views of its one slice ``shard``: no cast,
    no move, and no regrouping that needs a copy (QKV's per-group split is not a view of its rows)."""
    return views_of_one_slice(item.rule, item.dim) and shard.dtype == item.dtype and shard.device == device


def _present(place: torch.Tensor | None, name: str) -> torch.Tensor:
    if place is None:
        raise RuntimeError(f"{name}: received in place, but the consumer no longer gives a place for it")
    return place
