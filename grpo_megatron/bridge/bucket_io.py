"""One bucket of HF tensors as one flat byte buffer: ``flatten_bucket``/``unflatten_bucket`` and
``broadcast_bucket`` (one rank to many, one collective per bucket); and ``Bucket``, what the export
stream (bridge/export.py) yields."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.distributed.collectives import collective_device

Bucket = list[tuple[str, torch.Tensor]]

_ALIGN = 16  # byte offset alignment in flat buffers, so any dtype can view its slice in place


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the alignment of offsets in flat buffers."""
    return -(-nbytes // _ALIGN) * _ALIGN


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype of ``str(dtype)`` ("torch.float32") or its bare name ("float32")."""
    return getattr(torch, name.removeprefix("torch."))


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
        total += aligned(t.numel() * t.element_size())
    flat_u8 = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), (_, _, shape, offset) in zip(bucket, meta, strict=True):
        flat_u8[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(shape).copy_(t)
    return flat_u8, meta


def unflatten_bucket(flat_u8: torch.Tensor, meta: BucketMeta) -> Bucket:
    """The tensors of a flattened bucket: non-overlapping views of ``flat_u8`` (no copy)."""
    out: Bucket = []
    for name, dt, shape, offset in meta:
        dtype = dtype_named(dt)
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
        device = collective_device(group)
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
