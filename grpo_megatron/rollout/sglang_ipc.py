"""Colocated SGLang engines and their weight transport: CUDA IPC.

One ``sglang.Engine`` per group of ``rollout.sglang_tp`` consecutive trainer ranks, started by the
group's first rank on the group's GPUs with ``enable_memory_saver`` so that it can give its memory
to the trainer and take it back. Each bucket of the export stream becomes one
``FlattenedTensorBucket`` on this rank's GPU, serialized once per SGLang TP rank with
``MultiprocessingSerializer`` (each SGLang rank opens its own copy of the handles) and loaded with
``update_weights_from_tensor(load_format="flattened_bucket")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grpo_megatron.rollout.config import RolloutConfig
from grpo_megatron.rollout.engine import Bucket
from grpo_megatron.rollout.sglang_weights import flattened_bucket, raise_on_failure


def colocated_group(rank: int, tp: int) -> tuple[int, list[int]]:
    """``(leader, members)`` of the colocated engine group that trainer ``rank`` belongs to."""
    leader = rank - rank % tp
    return leader, list(range(leader, leader + tp))


def colocated_server_args(
    rollout: RolloutConfig, model_path: str, *, base_gpu_id: int, dtype: str, seed: int, moe: bool
) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments of a colocated engine (``rollout.sglang_server_args`` win)."""
    return {
        "model_path": model_path,
        "tp_size": rollout.sglang_tp,
        "base_gpu_id": base_gpu_id,
        "mem_fraction_static": rollout.gpu_memory_utilization,
        "enable_memory_saver": True,
        "dtype": dtype,
        "random_seed": seed,
        "enable_return_routed_experts": moe and rollout.sglang_routed_experts,
        "log_level": "error",
        **rollout.sglang_server_args,
    }


def flattened_bucket_payloads(
    bucket: Bucket, tp_size: int, sglang_classes: tuple[type, Any], device: torch.device | str | None = None
) -> list[str]:
    """What ``Engine.update_weights_from_tensor(payloads, load_format="flattened_bucket")`` takes:
    one serialized ``{"flattened_tensor", "metadata"}`` per SGLang TP rank (base64 strings, which
    every 0.5.x release accepts). On a GPU the tensor travels as a CUDA IPC handle; each rank gets
    its own serialization so the producer's IPC reference counts drop as each rank loads."""
    flattened_cls, serializer = sglang_classes
    flat = flattened_bucket(bucket, flattened_cls, device)
    payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return [serializer.serialize(payload, output_str=True) for _ in range(tp_size)]


class CudaIpcTransport:
    """``WeightTransport`` into one colocated ``sglang.Engine`` (``servers`` holds exactly it)."""

    def __init__(
        self, servers: Sequence[Any], tp_size: int, sglang_classes: tuple[type, Any], device: torch.device | str
    ):
        self.servers = servers
        self.tp_size = tp_size
        self.sglang_classes = sglang_classes
        self.device = device

    def send(self, bucket: Bucket, *, last: bool, version: int) -> None:
        (engine,) = self.servers
        payloads = flattened_bucket_payloads(bucket, self.tp_size, self.sglang_classes, self.device)
        result = engine.update_weights_from_tensor(payloads, load_format="flattened_bucket", flush_cache=last)
        raise_on_failure(result, "update_weights_from_tensor")

    def reset(self) -> None:
        return None  # no connection: every bucket carries its own IPC handles
