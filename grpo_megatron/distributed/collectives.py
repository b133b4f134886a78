"""Small object collectives over the default process group, shared by the trainer and checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class Rank0Failure(RuntimeError):
    """Raised on every rank by ``on_rank0`` when the work failed on rank 0 (rank 0 reports it; the
    others only echo it)."""


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must live for a collective on ``group``: nccl moves device tensors only (a CPU
    tensor raises "No backend type associated with device type cpu"), gloo moves CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` from rank ``src`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def on_rank0(fn: Callable[[], T], what: str = "work on rank 0") -> T:
    """Run ``fn`` on global rank 0 only (file work, reward scoring) and return its result on every
    rank. If it raises, every rank raises, naming ``what``: the others would otherwise wait in the
    next collective until the process-group timeout."""
    if not dist.is_initialized():
        return fn()
    outcome: tuple[bool, Any] = (True, None)
    if dist.get_rank() == 0:
        try:
            outcome = (True, fn())
        except Exception as exc:  # re-raised below, on every rank
            if dist.get_world_size() == 1:
                raise
            outcome = (False, f"{type(exc).__name__}: {exc}")
    ok, value = broadcast_object(outcome)
    if not ok:
        raise Rank0Failure(f"{what} failed on rank 0: {value}")
    return value
