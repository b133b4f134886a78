"""Which trainer ranks form a colocated SGLang engine, and where the parts of an engine across nodes meet.

A colocated engine is ``rollout.sglang.tp`` consecutive trainer ranks (``colocated_layout``), led by
the first of them: inside one node (a divisor of its GPUs) or over whole nodes (a multiple of them).
An engine wider than a node (``rollout.sglang.tp`` a multiple of the GPUs per node) uses SGLang's
own multi-node launch (facts from SGLang 0.5.23's source, paths under ``python/sglang/srt/``):

- ``ServerArgs`` fields ``nnodes``, ``node_rank``, ``dist_init_addr`` (``arg_groups/fields/parallel.py``)
  and ``base_gpu_id`` (``arg_groups/fields/device.py``). ``sglang.Engine`` is started once per node,
  each with the same ``tp_size`` and its ``node_rank``; node ``k`` runs the schedulers of TP ranks
  ``[k * tp / nnodes, (k + 1) * tp / nnodes)``, TP rank ``i`` on GPU ``base_gpu_id + i % (tp /
  nnodes)`` (``entrypoints/engine.py``: ``_calculate_rank_ranges``, ``_launch_scheduler_processes``).
  With ``base_gpu_id=0`` and ranks laid out node-major, SGLang TP rank ``i`` runs on trainer rank
  ``leader + i``'s GPU, as on one node.
- ``dist_init_addr`` (``host:port``) is the TCP init method of SGLang's own torch.distributed group
  (``distributed/bootstrap.py:_resolve_dist_init_method``): every node must name the same address,
  on the first node's host. The group's ranks agree on it over torch.distributed
  (``agree_engine_address``): the leader picks a free port on its host.
- An Engine with ``node_rank >= 1`` launches only its node's schedulers, no tokenizer manager and
  no detokenizer (``entrypoints/engine.py:_launch_subprocesses``: "Non-zero-rank nodes do not run
  tokenizer processes"), and by default blocks in its constructor until the schedulers exit unless
  the environment has ``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0`` (then it returns, with
  ``tokenizer_manager`` None): so the starters on other nodes set it, keep their Engine alive, and
  call nothing on it but ``shutdown``.
- Every request goes through the first node: the tokenizer manager sends it to TP rank 0's
  scheduler, which broadcasts it to every TP rank over the TP group's CPU (gloo) group, across
  nodes (``managers/scheduler_components/request_receiver.py:_broadcast_reqs_across_ranks``). That
  holds for ``update_weights_from_tensor``: the leader's list of per-TP-rank payloads reaches every
  scheduler, and each deserializes only its own entry (``managers/tp_worker.py:deserialize_own_rank``),
  a CUDA IPC handle made by the trainer rank on its own GPU and node: only the small handle strings
  cross nodes, the bytes stay on each GPU. It holds as well for ``release_memory_occupation`` /
  ``resume_memory_occupation`` and ``flush_cache``, scheduler requests handled on every TP rank
  (``managers/scheduler_components/weight_updater.py``): the leader alone releases and resumes the
  memory of every node of its engine.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from grpo_megatron.distributed.bootstrap import free_port
from grpo_megatron.rollout.placement import RolloutPlacement, width_choices

if TYPE_CHECKING:
    from grpo_megatron.distributed.bootstrap import ParallelState


def colocated_group(rank: int, tp: int) -> tuple[int, list[int]]:
    """``(leader, members)`` of the colocated engine group that trainer ``rank`` belongs to."""
    leader = rank - rank % tp
    return leader, list(range(leader, leader + tp))


@dataclasses.dataclass(frozen=True)
class ColocatedLayout:
    """Where trainer ``rank`` stands in its colocated SGLang engine (``colocated_layout``)."""

    leader: int
    """The engine's first global rank: it starts the engine's first node and drives it (generation,
    ``update_weights_from_tensor``, memory release/resume)."""
    members: tuple[int, ...]
    """The engine's ``rollout.sglang.tp`` consecutive global ranks; SGLang TP rank ``i`` is on
    ``members[i]``'s GPU. Every one is a weight-sync destination."""
    nnodes: int
    """Nodes the engine spans (1: inside one node)."""
    node_rank: int
    """This rank's node within the engine (SGLang's ``node_rank``), 0 .. nnodes - 1."""
    starter: bool
    """This rank calls ``sglang.Engine``: the leader, and on a multi-node engine also local rank 0
    of each further node (which only keeps its node's schedulers alive)."""
    base_gpu_id: int
    """SGLang's ``base_gpu_id`` on this rank's node: the engine's first GPU there."""

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


def colocated_layout(
    rank: int, world_size: int, tp: int, gpus_per_node: int, local_rank: int
) -> ColocatedLayout:
    """Trainer ``rank``'s place in its colocated engine of ``tp`` (``rollout.sglang.tp``) GPUs.

    Inside a node (``tp <= gpus_per_node``): ``tp`` must divide the GPUs per node and the world
    size; the leader starts the engine with ``base_gpu_id`` its local rank. Across nodes: ``tp``
    must be a multiple of the GPUs per node and divide the world size; the engine is ``tp``
    consecutive global ranks, i.e. ``tp / gpus_per_node`` whole nodes when ranks are laid out
    node-major (local rank = rank % gpus_per_node, as torchrun and the launchers here assign them;
    ``engine_address`` checks it with every rank's host and local rank), and local rank 0 of each of
    its nodes starts that node's part with ``base_gpu_id=0``. Depends only on the configuration and
    the launch (the same verdict on every rank, so no rank raises alone before the collective
    ``agree_engine_address``). Raises ``ValueError`` naming ``rollout.sglang.tp`` and the values
    that would work."""
    choices = width_choices(gpus_per_node, world_size)
    if world_size % tp or (gpus_per_node % tp if tp <= gpus_per_node else tp % gpus_per_node):
        raise ValueError(
            f"rollout.sglang.tp={tp} does not fit {world_size} ranks with {gpus_per_node} GPUs per node "
            f"(LOCAL_WORLD_SIZE): an engine spans a divisor of the GPUs per node, or whole nodes (a "
            f"multiple of the GPUs per node), and the engines must tile the world size; set "
            f"rollout.sglang.tp to one of {choices}"
        )
    leader, members = colocated_group(rank, tp)
    if tp <= gpus_per_node:
        return ColocatedLayout(leader, tuple(members), 1, 0, rank == leader, local_rank - (rank - leader))
    node_rank = (rank - leader) // gpus_per_node
    return ColocatedLayout(
        leader, tuple(members), tp // gpus_per_node, node_rank, rank % gpus_per_node == 0, 0
    )


def engine_address(
    layout: ColocatedLayout, ranks: Sequence[tuple[str, int]], port: int, gpus_per_node: int
) -> str:
    """SGLang's ``dist_init_addr`` of ``layout``'s engine, ``host:port`` of its first node, after
    checking with every rank's ``(host name, LOCAL_RANK)`` (``ranks``, by global rank) that each
    ``gpus_per_node`` block of the engine's ranks is one host with local ranks ``0 ..
    gpus_per_node - 1`` in order, and the blocks are different hosts."""
    tp = len(layout.members)
    blocks = [layout.members[k : k + gpus_per_node] for k in range(0, tp, gpus_per_node)]
    hosts = [sorted({ranks[r][0] for r in block}) for block in blocks]
    node_major = all(ranks[r][1] == r % gpus_per_node for r in layout.members)
    if not node_major or any(len(h) != 1 for h in hosts) or len({h[0] for h in hosts}) != len(blocks):
        seen = "; ".join(
            f"ranks {b[0]}-{b[-1]} on {h} with LOCAL_RANK {[ranks[r][1] for r in b]}"
            for b, h in zip(blocks, hosts, strict=True)
        )
        raise ValueError(
            f"rollout.sglang.tp={tp} makes ranks {layout.members[0]}-{layout.members[-1]} one SGLang engine "
            f"over {len(blocks)} whole nodes of {gpus_per_node} GPUs (LOCAL_WORLD_SIZE), but {seen}: every "
            f"node must run {gpus_per_node} consecutive ranks on local GPUs 0..{gpus_per_node - 1} (torchrun "
            f"--nnodes N --nproc-per-node {gpus_per_node}, or srun one task per GPU with block distribution), "
            f"or set rollout.sglang.tp to at most {gpus_per_node}"
        )
    return f"{hosts[0][0]}:{port}"


def agree_engine_address(layout: ColocatedLayout, gpus_per_node: int, local_rank: int) -> str:
    """Collective over the world: the ``dist_init_addr`` of this rank's multi-node engine, from every
    rank's host name and local rank and the port its leader picked (``engine_address``). Every rank
    calls it once while the fleet is built (the leader from ``SGLangEngine.from_config``, the other
    ranks from ``SGLangSyncMember.from_config``), before anything that can fail on one rank alone."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = (socket.gethostname(), local_rank, free_port("") if rank == layout.leader else None)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return engine_address(
        layout, [(h, lr) for h, lr, _ in everyone], everyone[layout.leader][2], gpus_per_node
    )


def layout_of(placement: RolloutPlacement, ps: ParallelState) -> tuple[ColocatedLayout, int, int]:
    """(this rank's ``ColocatedLayout``, GPUs per node, local rank) for the placement's engine width
    (the launcher's LOCAL_RANK; torchrun and the launch scripts set it)."""
    gpus_per_node = placement.gpus_per_node
    local_rank = int(os.environ.get("LOCAL_RANK", ps.rank % gpus_per_node))
    layout = colocated_layout(ps.rank, ps.world_size, placement.gpus_per_engine, gpus_per_node, local_rank)
    return layout, gpus_per_node, local_rank
