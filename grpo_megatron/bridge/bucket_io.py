"""``Bucket``, what the export stream (bridge/export.py) yields, and the byte arithmetic of its
packed messages (bridge/export_plan.py): offsets aligned so any dtype views its slice in place."""

from __future__ import annotations

import torch

Bucket = list[tuple[str, torch.Tensor]]

_ALIGN = 16  # byte offset alignment in flat buffers, so any dtype can view its slice in place


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the alignment of offsets in flat buffers."""
    return -(-nbytes // _ALIGN) * _ALIGN


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype of ``str(dtype)`` ("torch.float32") or its bare name ("float32")."""
    return getattr(torch, name.removeprefix("torch."))
