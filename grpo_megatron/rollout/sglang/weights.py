"""How weights reach a SGLang engine: the interface both transports implement, and the bucket
layout they share.

A ``WeightTransport`` moves one bucket of the export stream (Hugging Face names, full tensors) into
the engine's servers; ``SGLangEngine`` checks the bucket, opens and closes the weight-update
sessions and tracks versions, whatever the transport. One module per transport:

- ``rollout/sglang/ipc.py``: colocated engines, CUDA IPC handles through ``update_weights_from_tensor``;
- ``rollout/sglang/nccl.py``: disaggregated servers, an NCCL broadcast through
  ``update_weights_from_distributed``.

Both send a bucket as SGLang's ``FlattenedTensorBucket`` (one flat byte tensor plus metadata); the
class is passed in, so this module never imports SGLang.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from grpo_megatron.rollout.engine import Bucket


class WeightTransport(Protocol):
    """One way of loading buckets into an engine's servers (inside the session the engine opened)."""

    def send(self, bucket: Bucket, *, last: bool, version: int) -> None:
        """Load ``bucket`` (non-empty, already checked); ``last`` closes the version (the servers
        flush their caches and, where the endpoint takes one, record ``version``)."""
        ...

    def refuse(self, reason: str) -> None:
        """The engine refused a bucket before sending it: let whoever else takes part in this call
        (the other GPUs of a colocated engine) fail with ``reason`` too, instead of waiting."""
        ...

    def reset(self) -> None:
        """Forget any connection to the servers (one restarted): the next ``send`` opens a new one."""
        ...


def raise_on_failure(result: Any, what: str) -> None:
    """SGLang's engine methods return ``(success, message)`` (or a dict) instead of raising."""
    if isinstance(result, tuple) and len(result) >= 2 and result[0] is False:
        raise RuntimeError(f"SGLang {what} failed: {result[1]}")
    if isinstance(result, dict) and result.get("success") is False:
        raise RuntimeError(f"SGLang {what} failed: {result.get('message')}")


def aligned_order(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The bucket sorted by element size, largest first (stable within a size).

    SGLang's flattened bucket packs tensors back to back as bytes and views each slice as its
    dtype again; a slice can only be viewed as a dtype whose size divides its byte offset. Putting
    8-byte before 4-, 2- and 1-byte tensors keeps every offset a multiple of its own element size.
    """
    return sorted(bucket, key=lambda kv: -kv[1].element_size())


def flattened_bucket(
    bucket: Bucket, flattened_bucket_cls: type, device: torch.device | str | None = None
) -> Any:
    """SGLang's ``FlattenedTensorBucket`` of ``bucket`` (aligned, contiguous, on ``device``)."""
    if not bucket:
        raise ValueError("an empty weight bucket cannot be sent")
    named = [(name, t.detach().to(device or t.device).contiguous()) for name, t in aligned_order(bucket)]
    return flattened_bucket_cls(named_tensors=named)
