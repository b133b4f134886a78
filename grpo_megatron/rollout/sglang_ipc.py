"""Colocated SGLang engines and their weight transport: CUDA IPC, one payload per GPU.

One ``sglang.Engine`` per group of ``rollout.sglang_tp`` consecutive trainer ranks, started by the
group's first rank (the leader) on the group's GPUs with ``enable_memory_saver`` so that it can give
its memory to the trainer and take it back; SGLang's TP rank ``i`` runs on trainer rank
``leader + i``'s GPU. Every GPU of the group is a destination of the weight sync and receives
exactly what its SGLang rank loads (``rollout/sglang_shards.py``). Each round, every GPU makes its
bucket one ``FlattenedTensorBucket`` on its own device and serializes it once with
``MultiprocessingSerializer`` (a CUDA IPC handle: the SGLang rank on that GPU opens it locally);
the payloads are gathered to the leader (``EngineGroupFeed``), which loads them with one
``update_weights_from_tensor(payloads_in_tp_rank_order, load_format="flattened_bucket")``, and
tells the group how it went.
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


def rank_payload(bucket: Bucket, sglang_classes: tuple[type, Any], device: torch.device | str | None = None) -> str:
    """One TP rank's element of ``update_weights_from_tensor(payloads, load_format="flattened_bucket")``:
    ``bucket`` as one ``FlattenedTensorBucket`` on ``device``, serialized (base64 string, which every
    0.5.x release accepts; on a GPU the tensor travels as a CUDA IPC handle). An empty bucket (this
    rank has nothing in this round) is still a valid payload: a one-byte tensor with no metadata,
    which SGLang's updater turns into no tensors (``FlattenedTensorBucket`` refuses to be built from
    an empty list of tensors, not from a flat tensor with empty metadata; a zero-byte CUDA tensor
    would have no IPC handle)."""
    flattened_cls, serializer = sglang_classes
    if bucket:
        flat = flattened_bucket(bucket, flattened_cls, device)
        payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    else:
        payload = {"flattened_tensor": torch.zeros(1, dtype=torch.uint8, device=device), "metadata": []}
    return serializer.serialize(payload, output_str=True)


def flattened_bucket_payloads(
    bucket: Bucket, tp_size: int, sglang_classes: tuple[type, Any], device: torch.device | str | None = None
) -> list[str]:
    """An engine fed through one rank (no engine group bound, e.g. an engine driven outside the
    fleet): the same full bucket for every TP rank, serialized once per rank so the producer's IPC
    reference counts drop as each rank loads."""
    return [rank_payload(bucket, sglang_classes, device) for _ in range(tp_size)]


Contribution = tuple[str | None, bool, str | None]
"""(payload, whether it carries any tensor, error) of one GPU for one round; the payload or the
error is set. A payload without tensors is made anyway: when any GPU of the engine has tensors in
the round, SGLang takes one payload per TP rank, each opened on that rank's own GPU."""


class EngineGroupFeed:
    """The GPUs of one colocated engine loading one round together: each hands its payload (or its
    error) to the leader, the leader loads them all in one call and tells everyone the verdict, so
    every GPU of the engine raises at the same call (none waits for a peer that stopped)."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = tuple(ranks)
        self.group: Any = None

    def gather(self, mine: Contribution) -> list[Contribution] | None:
        """Collective over the group: every GPU's contribution in TP-rank order on the leader."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * len(self.ranks) if dist.get_rank() == self.ranks[0] else None
        dist.gather_object(mine, out, dst=self.ranks[0], group=self.group)
        return out

    def verdict(self, error: str | None) -> str | None:
        """Collective over the group: the leader's verdict (None = loaded) on every GPU."""
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
        return box[0]

    def contribute(self, mine: Contribution) -> None:
        """A non-leader GPU's side of a round: hand over, wait for the verdict, raise on failure.
        The payload's tensor stays referenced until the leader's load is done."""
        self.gather(mine)
        error = self.verdict(None)
        if error is not None:
            raise RuntimeError(error)


class CudaIpcTransport:
    """``WeightTransport`` into one colocated ``sglang.Engine`` (``servers`` holds exactly it), on
    the engine's leader. With ``feed`` bound (the fleet's engine group), every call is a round of the
    group: one payload per GPU, each made on its own GPU. Without one, the leader's full bucket goes
    to every TP rank."""

    def __init__(
        self, servers: Sequence[Any], tp_size: int, sglang_classes: tuple[type, Any], device: torch.device | str
    ):
        self.servers = servers
        self.tp_size = tp_size
        self.sglang_classes = sglang_classes
        self.device = device
        self.feed: EngineGroupFeed | None = None

    def send(self, bucket: Bucket, *, last: bool, version: int) -> None:
        (engine,) = self.servers
        if self.feed is None or self.feed.group is None:
            if not bucket:
                if last:
                    engine.flush_cache()
                return
            payloads = flattened_bucket_payloads(bucket, self.tp_size, self.sglang_classes, self.device)
            result = engine.update_weights_from_tensor(payloads, load_format="flattened_bucket", flush_cache=last)
            raise_on_failure(result, "update_weights_from_tensor")
            return
        try:
            mine: Contribution = (rank_payload(bucket, self.sglang_classes, self.device), bool(bucket), None)
        except Exception as exc:
            mine = (None, False, f"{type(exc).__name__}: {exc}")
        everyone = self.feed.gather(mine) or []
        error = "; ".join(f"engine GPU {i}: {e}" for i, (_, _, e) in enumerate(everyone) if e is not None) or None
        if error is None:
            try:
                if any(full for _, full, _ in everyone):
                    result = engine.update_weights_from_tensor(
                        [p for p, _, _ in everyone], load_format="flattened_bucket", flush_cache=last
                    )
                    raise_on_failure(result, "update_weights_from_tensor")
                elif last:  # nothing left to load: the flush the last payloads would have carried
                    engine.flush_cache()
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        self.feed.verdict(error)
        if error is not None:
            raise RuntimeError(f"SGLang update_weights_from_tensor of version {version}: {error}")

    def refuse(self, reason: str) -> None:
        """The leader refused its own bucket: the group's round still runs, and fails everywhere."""
        if self.feed is not None and self.feed.group is not None:
            self.feed.gather((None, False, reason))
            self.feed.verdict(f"engine GPU 0: {reason}")

    def reset(self) -> None:
        return None  # no connection: every bucket carries its own IPC handles

