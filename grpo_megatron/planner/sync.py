"""Weight-sync time on paper: the bytes each rank sends and receives per sync, and a time estimate.

The model (docs/planner.md states it with its assumptions):

- every engine GPU needs ``M_gpu`` per sync (below; ``M = parameters x export bytes`` is the whole
  model); the sources are the trainer ranks holding each slice, chosen on the engine's node first,
  the rest spread evenly over every copy (``bridge/export_plan.py``), so a trainer rank sends
  ``engine GPUs x M_gpu / world``;
- the share of ``M`` an engine finds on its own node travels over NVLink, the rest over the
  network (InfiniBand, one NIC per GPU); a rank's send and receive time is its bytes over its link;
- a GPU receiving and sending at once is limited by the slower of its two directions (full duplex);
- copies on the device run at ``copy_gbps``: at the receiver the round buffer flattened into the
  engine's bucket and the engine loader's copy of its share (``M / G``); none at the sender (slices of
  ``DIRECT_MIN_BYTES`` and more are sent from the weights themselves, smaller ones are noise);
- a fixed latency per wait (transfer round, the sync's two small all-reduces) and a fixed overhead
  per message, ``latency_s`` and ``message_s`` of ``transfer_seconds``: measured on the CPU
  benchmark, left out of the GPU figures (a few dozen rounds and a few thousand messages per GPU of
  ~20 us each, against transfers of seconds);
- phases add up (no credit for overlap between rounds: an upper bound on a quiet cluster).

The delivery estimated is the one the sync does (``rollout/sglang/shards.py``): every engine GPU
is a destination and receives what its SGLang rank loads, the dense tensors in full (SGLang's
loaders narrow them by TP rank themselves) and ``1 / engine_ep`` of the experts (the block of its
MoE EP rank), ``M_gpu = dense + experts / engine_ep`` bytes, straight from the trainer ranks. An
engine without expert parallelism (``engine_ep = 1``, and every embedded engine) receives the whole
model on each GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Links:
    """Bandwidths of one GPU, in GB/s per direction (defaults: H100 SXM nodes with NDR InfiniBand)."""

    nvlink_gbps: float = 370.0
    """GPU-to-GPU inside a node: NVLink 4 is 450 GB/s per direction; NCCL point-to-point reaches ~370."""
    pcie_gbps: float = 50.0
    """GPU to its NIC and host: PCIe Gen5 x16, 64 GB/s nominal. Used where a node has no NVLink
    (``nvlink_gbps=0``)."""
    ib_gbps: float = 45.0
    """Between nodes: one 400 Gb/s NDR NIC per GPU, 50 GB/s nominal, ~45 achieved."""
    copy_gbps: float = 1300.0
    """Device-to-device copy of HBM (H100: 3.35 TB/s read + write, ~1.3 TB/s copied)."""

    @property
    def intra_gbps(self) -> float:
        return self.nvlink_gbps or self.pcie_gbps


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank moves per sync."""

    sent: float
    received: float
    copied: float  # packed, assembled and loaded on its device
    waits: int = 0
    """Points where the rank waits on its peers (transfer rounds, the sync's two small all-reduces):
    each costs a fixed latency however few bytes move."""
    messages: int = 0
    """Point-to-point messages it sends and receives: each costs a fixed overhead on top of its bytes."""


def transfer_seconds(
    ranks: Sequence[RankBytes],
    link_gbps: float,
    copy_gbps: float,
    latency_s: float = 0.0,
    message_s: float = 0.0,
) -> float:
    """The slowest rank's time: its busier link direction, then its copies, ``latency_s`` per wait and
    ``message_s`` per message (phases add up)."""
    return max(
        max(r.sent, r.received) / (link_gbps * GB)
        + r.copied / (copy_gbps * GB)
        + r.waits * latency_s
        + r.messages * message_s
        for r in ranks
    )


@dataclass(frozen=True)
class SyncEstimate:
    delivery: str
    model_bytes: float
    engines: int
    gpus_per_engine: int
    trainer_rank: RankBytes
    engine_gpu: RankBytes
    seconds: float
    bottleneck: str


def node_fraction(
    dense: float, expert: float, tp: int, pp: int, ep: int, etp: int, gpus_per_node: int
) -> float:
    """Share of the model's distinct bytes held on one node (consecutive ranks: TP innermost, then
    EP for experts): a node holds a full copy of what its ``gpus_per_node`` ranks hold together."""
    dense_on_node = min(1.0, gpus_per_node / (tp * pp)) * dense
    expert_on_node = min(1.0, gpus_per_node / (etp * ep * pp)) * expert
    return (dense_on_node + expert_on_node) / max(dense + expert, 1.0)


def estimate_sync(
    *,
    dense_params: float,
    expert_params: float,
    export_bytes: int,
    world_size: int,
    gpus_per_node: int,
    gpus_per_engine: int,
    tp: int,
    pp: int,
    ep: int,
    etp: int,
    links: Links,
    engine_ep: int = 1,
) -> list[SyncEstimate]:
    """Bytes per rank and time of the per-GPU delivery, for engines of ``gpus_per_engine`` GPUs on
    the trainer's GPUs (colocated: one engine per ``gpus_per_engine`` ranks) with expert parallelism
    ``engine_ep`` inside each engine."""
    if engine_ep < 1 or gpus_per_engine % engine_ep:
        raise ValueError(
            f"engine EP {engine_ep} must be >= 1 and divide the GPUs per engine ({gpus_per_engine})"
        )
    m = (dense_params + expert_params) * export_bytes
    received = (dense_params + expert_params / engine_ep) * export_bytes
    engines = max(1, world_size // gpus_per_engine)
    local = node_fraction(dense_params, expert_params, tp, pp, ep, etp, gpus_per_node)
    multi_node = world_size > gpus_per_node
    sent = engines * gpus_per_engine * received / world_size  # every rank's even share
    near = received * local
    far = received - near if multi_node else 0.0
    near = received - far
    receive_s = max(near / (links.intra_gbps * GB), far / (links.ib_gbps * GB))
    send_s = sent / ((links.ib_gbps if multi_node else links.intra_gbps) * GB)
    # SGLang's path: received into round buffers, flattened into its bucket, its loader copies its
    # share. A trainer rank sends large slices from its weights (no packing): nothing copied.
    copied = received + m / gpus_per_engine
    copy_s = copied / (links.copy_gbps * GB)
    seconds = max(receive_s, send_s) + copy_s
    parts = {"receive": receive_s, "send": send_s, "copies": copy_s}
    delivery = (
        f"per engine GPU (dense in full + experts / engine EP {engine_ep})"
        if expert_params and engine_ep > 1
        else "per engine GPU (the whole model)"
    )
    return [
        SyncEstimate(
            delivery,
            m,
            engines,
            gpus_per_engine,
            RankBytes(sent, 0.0, 0.0),
            RankBytes(sent, received, copied),
            seconds,
            max(parts, key=lambda k: parts[k]),
        )
    ]


def plan_sync(
    hf: Mapping[str, Any],
    layout: Any,
    *,
    gpus_per_node: int,
    gpus_per_engine: int,
    export_bytes: int,
    links: Links,
    engine_ep: int | None = None,
) -> list[SyncEstimate]:
    """``estimate_sync`` for a model (its HF config) at a resolved ``planner.memory.Layout``."""
    from grpo_megatron.planner.model_states import ModelDims, canonical_tensors

    d = ModelDims.from_hf(hf)
    tensors = canonical_tensors(hf, padded_vocab=d.vocab)
    expert = float(sum(s.numel for s in tensors if s.is_expert))
    dense = float(sum(s.numel for s in tensors if not s.is_expert))
    if engine_ep is None:  # how SGLang MoE deployments run: experts split over every engine GPU
        engine_ep = gpus_per_engine if expert else 1
    return estimate_sync(
        dense_params=dense,
        expert_params=expert,
        export_bytes=export_bytes,
        world_size=layout.world_size,
        gpus_per_node=gpus_per_node,
        gpus_per_engine=gpus_per_engine,
        tp=layout.tp,
        pp=layout.pp,
        ep=layout.ep,
        etp=layout.etp,
        links=links,
        engine_ep=engine_ep,
    )


def render(estimates: Sequence[SyncEstimate], links: Links) -> str:
    lines = [
        f"weight sync per iteration (links per GPU: NVLink {links.nvlink_gbps:g} GB/s, PCIe {links.pcie_gbps:g}, "
        f"InfiniBand {links.ib_gbps:g}, device copy {links.copy_gbps:g}; model in docs/planner.md):"
    ]
    for e in estimates:
        lines.append(
            f"  {e.delivery}: model {e.model_bytes / GB:.1f} GB, {e.engines} engine(s) of {e.gpus_per_engine} "
            f"GPU(s) | a trainer rank sends {e.trainer_rank.sent / GB:.2f} GB | an engine GPU receives "
            f"{e.engine_gpu.received / GB:.2f} GB | "
            f"~{e.seconds:.2f} s (most: {e.bottleneck})"
        )
    return "\n".join(lines)
