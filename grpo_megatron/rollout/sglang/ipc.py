"""Colocated SGLang engines and their weight transport: CUDA IPC, one payload per GPU.

One ``sglang.Engine`` per group of ``rollout.sglang_tp`` consecutive trainer ranks, started by the
group's first rank (the leader) on the group's GPUs with ``enable_memory_saver`` so that it can give
its memory to the trainer and take it back; SGLang's TP rank ``i`` runs on trainer rank
``leader + i``'s GPU. Every GPU of the group is a destination of the weight sync and receives
exactly what its SGLang rank loads (``rollout/sglang/shards.py``). Each round, every GPU makes its
bucket one ``FlattenedTensorBucket`` on its own device and serializes it once with
``MultiprocessingSerializer`` (a CUDA IPC handle: the SGLang rank on that GPU opens it locally);
the payloads are gathered to the leader (``EngineGroupFeed``), which loads them with one
``update_weights_from_tensor(payloads_in_tp_rank_order, load_format="flattened_bucket")``, and
tells the group how it went.

An engine wider than a node (``rollout.sglang_tp`` a multiple of the GPUs per node) uses SGLang's
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

import contextlib
import dataclasses
import functools
import json
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from grpo_megatron.distributed.bootstrap import free_port
from grpo_megatron.rollout.config import RolloutConfig
from grpo_megatron.rollout.engine import Bucket
from grpo_megatron.rollout.placement import width_choices
from grpo_megatron.rollout.sglang.health import sigterm_ignored
from grpo_megatron.rollout.sglang.weights import flattened_bucket, raise_on_failure


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
    """The engine's ``rollout.sglang_tp`` consecutive global ranks; SGLang TP rank ``i`` is on
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


def colocated_layout(rank: int, world_size: int, tp: int, gpus_per_node: int, local_rank: int) -> ColocatedLayout:
    """Trainer ``rank``'s place in its colocated engine of ``tp`` (``rollout.sglang_tp``) GPUs.

    Inside a node (``tp <= gpus_per_node``): ``tp`` must divide the GPUs per node and the world
    size; the leader starts the engine with ``base_gpu_id`` its local rank. Across nodes: ``tp``
    must be a multiple of the GPUs per node and divide the world size; the engine is ``tp``
    consecutive global ranks, i.e. ``tp / gpus_per_node`` whole nodes when ranks are laid out
    node-major (local rank = rank % gpus_per_node, as torchrun and the launchers here assign them;
    ``engine_address`` checks it with every rank's host and local rank), and local rank 0 of each of
    its nodes starts that node's part with ``base_gpu_id=0``. Depends only on the configuration and
    the launch (the same verdict on every rank, so no rank raises alone before the collective
    ``agree_engine_address``). Raises ``ValueError`` naming ``rollout.sglang_tp`` and the values
    that would work."""
    choices = width_choices(gpus_per_node, world_size)
    if world_size % tp or (gpus_per_node % tp if tp <= gpus_per_node else tp % gpus_per_node):
        raise ValueError(
            f"rollout.sglang_tp={tp} does not fit {world_size} ranks with {gpus_per_node} GPUs per node "
            f"(LOCAL_WORLD_SIZE): an engine spans a divisor of the GPUs per node, or whole nodes (a "
            f"multiple of the GPUs per node), and the engines must tile the world size; set "
            f"rollout.sglang_tp to one of {choices}"
        )
    leader, members = colocated_group(rank, tp)
    if tp <= gpus_per_node:
        return ColocatedLayout(leader, tuple(members), 1, 0, rank == leader, local_rank - (rank - leader))
    node_rank = (rank - leader) // gpus_per_node
    return ColocatedLayout(leader, tuple(members), tp // gpus_per_node, node_rank, rank % gpus_per_node == 0, 0)


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
            f"rollout.sglang_tp={tp} makes ranks {layout.members[0]}-{layout.members[-1]} one SGLang engine "
            f"over {len(blocks)} whole nodes of {gpus_per_node} GPUs (LOCAL_WORLD_SIZE), but {seen}: every "
            f"node must run {gpus_per_node} consecutive ranks on local GPUs 0..{gpus_per_node - 1} (torchrun "
            f"--nnodes N --nproc-per-node {gpus_per_node}, or srun one task per GPU with block distribution), "
            f"or set rollout.sglang_tp to at most {gpus_per_node}"
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
    return engine_address(layout, [(h, lr) for h, lr, _ in everyone], everyone[layout.leader][2], gpus_per_node)


_SET_BY_LAYOUT = ("tp_size", "nnodes", "node_rank", "dist_init_addr", "base_gpu_id")

CPU_SERVER_ARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",  # triton fails on CPU; the CPU kernels' "intel_amx" needs AMX
    "disable_cuda_graph": True,
    "enable_memory_saver": False,  # torch_memory_saver needs libcuda: release/resume then free nothing
    "enable_return_routed_experts": False,  # its host buffer is pinned memory, which needs CUDA
    "max_total_tokens": 16384,  # else the KV pool is sized from free host memory
}
"""What SGLang's engine needs on CPU (seen with SGLang 0.5.23, ``SGLANG_USE_CPU_ENGINE=1``;
../shared/GUIDE.md section 9). ``rollout.sglang_server_args`` still win over each."""


def cpu_threads_bind(slots: int, cores: Sequence[int] | None = None) -> str:
    """SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` for CPU engines colocated with ``slots`` trainer ranks
    on this node: the cores split into ``slots`` contiguous groups, one per rank, ``|``-separated.
    SGLang binds the scheduler of "GPU" ``i`` (``base_gpu_id`` + its TP rank, which is the local
    rank of the trainer rank it sits beside) to group ``i``, as a GPU engine uses that rank's GPU.
    With more ranks than cores, ranks share cores round-robin."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    groups = []
    for i in range(slots):
        mine = cores[i * len(cores) // slots : (i + 1) * len(cores) // slots] or [cores[i % len(cores)]]
        groups.append(f"{mine[0]}-{mine[-1]}" if len(mine) > 1 and mine[-1] - mine[0] == len(mine) - 1 else ",".join(map(str, mine)))
    return "|".join(groups)


def colocated_server_args(
    rollout: RolloutConfig,
    model_path: str,
    *,
    base_gpu_id: int,
    dtype: str,
    seed: int,
    moe: bool,
    tp_size: int = 1,
    ep_size: int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    device: str = "cuda",
    weights_on_disk: bool = True,
    hf_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments of a colocated engine (``rollout.sglang_server_args`` win),
    of ``tp_size`` GPUs at expert parallelism ``ep_size`` (``rollout/placement.py``'s decision), on
    node ``node_rank`` of the ``nnodes`` it spans; a multi-node engine also gets SGLang's
    ``nnodes``, ``node_rank`` and ``dist_init_addr`` (the same on every node, seed included).

    Follows from the job, so that ``rollout.engine=sglang`` needs no other setting:
    - ``device="cpu"``: the arguments SGLang's CPU engine requires (``CPU_SERVER_ARGS``);
    - no weight files at ``model_path`` (a model the trainer initialises, like the demo's): SGLang
      starts with random weights (``load_format="dummy"``); the run's first weight sync, before any
      generation, replaces them;
    - ``model.hf_overrides`` reach SGLang's copy of the config (``json_model_override_args``)."""
    if nnodes > 1:
        fixed = sorted(k for k in _SET_BY_LAYOUT if k in rollout.sglang_server_args)
        if fixed:
            raise ValueError(
                f"rollout.sglang_server_args sets {fixed}: an engine across nodes gets them from "
                f"its width ({tp_size} GPUs, rollout.sglang_tp) and the ranks' layout; remove them"
            )
        if dist_init_addr is None:
            raise ValueError("an SGLang engine across nodes needs dist_init_addr (agree_engine_address)")
    args: dict[str, Any] = {
        "model_path": model_path,
        "tp_size": tp_size,
        "ep_size": ep_size,
        "base_gpu_id": base_gpu_id,
        "mem_fraction_static": rollout.gpu_memory_utilization,
        "enable_memory_saver": True,
        "dtype": dtype,
        "random_seed": seed,
        "enable_return_routed_experts": moe and rollout.sglang_routed_experts,
        "log_level": "error",
        # Idle, SGLang's scheduler polls its sockets without pause: a host core per engine spent while
        # the trainer trains beside it (on CPU, the trainer's own cores: seen 75% of each of 2).
        "sleep_on_idle": True,
    }
    if device == "cpu":
        args.update(CPU_SERVER_ARGS)
    if not weights_on_disk:
        args["load_format"] = "dummy"
    if hf_overrides:
        args["json_model_override_args"] = json.dumps(hf_overrides)
    if nnodes > 1:
        args.update(nnodes=nnodes, node_rank=node_rank, dist_init_addr=dist_init_addr)
    else:
        # The TCP port of the engine's own torch.distributed group. SGLang draws it from Python's
        # `random`, which every trainer rank seeds alike: engines starting together on one host
        # drew the same port and their schedulers waited on each other's rendezvous for good.
        args["nccl_port"] = free_port("")
    return {**args, **rollout.sglang_server_args}


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
    with cpu_tensors_shared_by_name(payload["flattened_tensor"].device):
        return serializer.serialize(payload, output_str=True)


@contextlib.contextmanager
def cpu_tensors_shared_by_name(device: torch.device) -> Iterator[None]:
    """While a CPU payload is serialized: torch shares its storage as a named shared-memory file
    (the ``file_system`` strategy). Its default on Linux passes a file descriptor through the
    producer's multiprocessing resource sharer, which only processes holding the producer's authkey
    may use: SGLang's scheduler of TP rank 1 opening a payload made by trainer rank 1 (not its
    parent) was refused ("digest sent was rejected"). A CUDA tensor travels as a CUDA IPC handle
    either way."""
    import torch.multiprocessing as tmp

    if device.type != "cpu":
        yield
        return
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        start_shared_memory_manager()
        yield
    finally:
        tmp.set_sharing_strategy(before)


def start_shared_memory_manager() -> None:
    """Start torch's shared-memory manager (the ``torch_shm_manager`` process that the
    ``file_system`` strategy's first tensor starts, one per process) with SIGTERM ignored, which it
    keeps through its exec: a preemption's SIGTERM, which Slurm sends to every process of the job,
    would otherwise end it, and every later payload with "Broken pipe" (the trainer saves before it
    stops; the SGLang engine's processes start the same way, rollout/sglang/health.py). From the main
    thread only: elsewhere it does nothing, and the manager starts on first use as torch would,
    unless a later call from the main thread comes first."""
    if threading.current_thread() is threading.main_thread():
        _start_shared_memory_manager_once()


@functools.cache
def _start_shared_memory_manager_once() -> None:
    with sigterm_ignored():
        torch.empty(1).share_memory_()


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


def contribution(bucket: Bucket, sglang_classes: tuple[type, Any], device: torch.device | str) -> Contribution:
    """One GPU's part of a round: its payload, or the error making it raised (handed to the leader
    like a payload, so the group's round still completes and fails on every GPU together)."""
    try:
        return rank_payload(bucket, sglang_classes, device), bool(bucket), None
    except Exception as exc:
        return None, False, f"{type(exc).__name__}: {exc}"


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
        everyone = self.feed.gather(contribution(bucket, self.sglang_classes, self.device)) or []
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

