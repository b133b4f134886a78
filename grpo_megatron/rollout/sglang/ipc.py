"""Colocated SGLang engines and their weight transport: CUDA IPC, one payload per GPU.

One ``sglang.Engine`` per group of ``rollout.sglang.tp`` consecutive trainer ranks, started by the
group's first rank (the leader) on the group's GPUs with ``enable_memory_saver`` so that it can give
its memory to the trainer and take it back; SGLang's TP rank ``i`` runs on trainer rank
``leader + i``'s GPU. Every GPU of the group is a destination of the weight sync and receives
exactly what its SGLang rank loads (``rollout/sglang/shards.py``). Each round, every GPU makes its
bucket one ``FlattenedTensorBucket`` on its own device and serializes it once with
``MultiprocessingSerializer`` (a CUDA IPC handle: the SGLang rank on that GPU opens it locally);
the payloads are gathered to the leader (``EngineGroupFeed``), which loads them with one
``update_weights_from_tensor(payloads_in_tp_rank_order, load_format="flattened_bucket")``, and
tells the group how it went.

An engine wider than a node loads the same way (``rollout/sglang/launch.py`` has SGLang's multi-node
facts): every request, ``update_weights_from_tensor`` included, goes through the first node's TP
rank 0 scheduler, which hands every TP rank the leader's list of payloads; each deserializes only its
own entry, a CUDA IPC handle made on its own GPU and node: only the small handle strings cross
nodes, the bytes stay on each GPU.

The transport's calls come from the engine inside its ``ServerGuard`` (``rollout/sglang/engine.py``):
never while a generation of the engine is in flight.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from grpo_megatron.rollout.engine import Bucket
from grpo_megatron.rollout.sglang.health import sigterm_ignored
from grpo_megatron.rollout.sglang.weights import aligned_order, flattened_bucket, raise_on_failure


def rank_payload(
    bucket: Bucket,
    sglang_classes: tuple[type, Any],
    device: torch.device | str | None = None,
    staging: SharedStaging | None = None,
) -> str:
    """One TP rank's element of ``update_weights_from_tensor(payloads, load_format="flattened_bucket")``:
    ``bucket`` as one ``FlattenedTensorBucket`` on ``device``, serialized (base64 string, which every
    0.5.x release accepts; on a GPU the tensor travels as a CUDA IPC handle). An empty bucket (this
    rank has nothing in this round) is still a valid payload: a one-byte tensor with no metadata,
    which SGLang's updater turns into no tensors (``FlattenedTensorBucket`` refuses to be built from
    an empty list of tensors, not from a flat tensor with empty metadata; a zero-byte CUDA tensor
    would have no IPC handle). A CPU payload is written into ``staging``'s buffer when given (else a
    new shared-memory file)."""
    flattened_cls, serializer = sglang_classes
    on_cpu = torch.device(device if device is not None else "cpu").type == "cpu"
    with cpu_tensors_shared_by_name(torch.device("cpu") if on_cpu else torch.device("cuda")):
        if bucket and on_cpu:
            payload = shared_memory_bucket(bucket, flattened_cls, staging)
        elif bucket:
            flat = flattened_bucket(bucket, flattened_cls, device)
            payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        else:
            payload = {"flattened_tensor": torch.zeros(1, dtype=torch.uint8, device=device), "metadata": []}
        return serializer.serialize(payload, output_str=True)


class SharedStaging:
    """One shared-memory buffer that a CPU rank writes its payloads into, kept across calls (grown to
    the largest bucket, never shrunk). A new shared-memory file per payload costs its page faults on
    every call: writing 100 MiB took ~75 ms into a new file against ~21 ms into one already written
    (2 cores, ``bench/sglang_profile.py``'s ``serialize`` row). Reusing it is safe because every load
    is synchronous: ``update_weights_from_tensor`` returns (and an engine group's verdict arrives)
    after the engine copied the payload into its weights, before the next payload is written."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the buffer, as uint8 (call inside ``cpu_tensors_shared_by_name``)."""
        if self._flat is None or self._flat.numel() < nbytes:
            self._flat = None  # the old file goes before the new one is made
            self._flat = new_shared_bytes(nbytes)
        return self._flat[:nbytes]


def new_shared_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` in a new shared-memory file (no copy, unlike ``share_memory_()``)."""
    flat = torch.empty(0, dtype=torch.uint8)
    return flat.set_(torch.UntypedStorage._new_shared(nbytes))


def shared_memory_bucket(
    bucket: Bucket, flattened_cls: type, staging: SharedStaging | None = None
) -> dict[str, Any]:
    """A CPU payload written once, straight into shared memory: ``FlattenedTensorBucket``'s layout and
    metadata (computed by the class itself on meta tensors, so every SGLang release lays it out its
    own way), its bytes copied from each tensor into one shared-memory buffer. Flattening on the
    heap first (``torch.cat``) and then sharing (``share_memory_()`` copies into a new shared file)
    writes every byte twice, and the engine's load reads it a third time: seen 3x the embedded
    engine's copy for a 400 MiB version (``bench/sglang_cpu.py``). Call inside
    ``cpu_tensors_shared_by_name`` (the buffer is a named shared-memory file; ``staging``'s, reused,
    when given)."""
    named = aligned_order(bucket)
    layout = flattened_cls(named_tensors=[(name, t.detach().to("meta")) for name, t in named])
    metadata = layout.get_metadata()
    nbytes = max(m.end_idx for m in metadata)
    flat = staging.buffer(nbytes) if staging is not None else new_shared_bytes(nbytes)
    for (_, t), m in zip(named, metadata, strict=True):
        flat[m.start_idx : m.end_idx].view(t.dtype).view(t.shape).copy_(t.detach())
    return {"flattened_tensor": flat, "metadata": metadata}


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
    bucket: Bucket,
    tp_size: int,
    sglang_classes: tuple[type, Any],
    device: torch.device | str | None = None,
    staging: SharedStaging | None = None,
) -> list[str]:
    """An engine fed through one rank (no engine group bound, e.g. an engine driven outside the
    fleet): the same full bucket for every TP rank, serialized once per rank so the producer's IPC
    reference counts drop as each rank loads (on CPU, with ``staging``, the ranks' payloads share its
    one buffer, written once)."""
    if staging is not None and tp_size > 1 and torch.device(device or "cpu").type == "cpu" and bucket:
        with cpu_tensors_shared_by_name(torch.device("cpu")):
            payload = shared_memory_bucket(bucket, sglang_classes[0], staging)
            return [sglang_classes[1].serialize(payload, output_str=True) for _ in range(tp_size)]
    return [rank_payload(bucket, sglang_classes, device, staging) for _ in range(tp_size)]


Contribution = tuple[str | None, bool, str | None]
"""(payload, whether it carries any tensor, error) of one GPU for one round; the payload or the
error is set. A payload without tensors is made anyway: when any GPU of the engine has tensors in
the round, SGLang takes one payload per TP rank, each opened on that rank's own GPU."""


def contribution(
    bucket: Bucket,
    sglang_classes: tuple[type, Any],
    device: torch.device | str,
    staging: SharedStaging | None = None,
) -> Contribution:
    """One GPU's part of a round: its payload, or the error making it raised (handed to the leader
    like a payload, so the group's round still completes and fails on every GPU together)."""
    try:
        return rank_payload(bucket, sglang_classes, device, staging), bool(bucket), None
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
    the engine's leader. With a group bound (``bind_group``: the fleet's engine group), every call is a
    round of the group, empty buckets too: one payload per GPU, each made on its own GPU. Without one,
    the leader's full bucket goes to every TP rank.

    An empty last bucket still makes a load call, of empty payloads, to carry the version's one cache
    flush (``flush_cache=True``), never a ``flush_cache()`` call: SGLang's own ``flush_cache`` also
    empties the device allocator's cache, which on CPU is a full ``gc.collect()`` of the scheduler's
    heap (``platforms/cpu.py``; seen 410-510 ms of a 520 ms version of the demo's 3.5 MiB, against
    ~3 ms for an empty load call: ``bench/sglang_profile.py``), while the flush a load carries skips
    it (its ``torch_empty_cache`` defaults to False, SGLang 0.5.23 ``io_struct.py``)."""

    def __init__(self, tp_size: int, sglang_classes: tuple[type, Any], device: torch.device | str):
        self.tp_size = tp_size
        self.sglang_classes = sglang_classes
        self.device = device
        self.feed: EngineGroupFeed | None = None
        self.staging = SharedStaging()
        """This rank's reused shared-memory buffer, on CPU (``SharedStaging``)."""

    def bind_group(self, ranks: Sequence[int], group: Any) -> None:
        if len(ranks) > 1:
            self.feed = EngineGroupFeed(ranks)
            self.feed.group = group

    def send(
        self, servers: Sequence[Any], bucket: Bucket, *, last: bool, version: int, flush: bool = True
    ) -> None:
        (engine,) = servers
        if self.feed is None or self.feed.group is None:
            if not bucket and not last:
                return
            payloads = flattened_bucket_payloads(
                bucket, self.tp_size, self.sglang_classes, self.device, self.staging
            )
            result = engine.update_weights_from_tensor(
                payloads, load_format="flattened_bucket", flush_cache=last and flush
            )
            raise_on_failure(result, "update_weights_from_tensor")
            return
        everyone = (
            self.feed.gather(contribution(bucket, self.sglang_classes, self.device, self.staging)) or []
        )
        error = (
            "; ".join(f"engine GPU {i}: {e}" for i, (_, _, e) in enumerate(everyone) if e is not None) or None
        )
        cancelled: BaseException | None = None
        if error is None:
            try:
                if last or any(full for _, full, _ in everyone):
                    result = engine.update_weights_from_tensor(
                        [p for p, _, _ in everyone],
                        load_format="flattened_bucket",
                        flush_cache=last and flush,
                    )
                    raise_on_failure(result, "update_weights_from_tensor")
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            except (
                BaseException
            ) as exc:  # the load cancelled (a lost engine, ServerGuard): the group still hears
                error, cancelled = f"{type(exc).__name__}: the engine was lost during the load", exc
        self.feed.verdict(error)
        if cancelled is not None:
            raise cancelled
        if error is not None:
            raise RuntimeError(f"SGLang update_weights_from_tensor of version {version}: {error}")

    def refuse(self, reason: str) -> None:
        """The leader refused its own bucket: the group's round still runs, and fails everywhere."""
        if self.feed is not None and self.feed.group is not None:
            self.feed.gather((None, False, reason))
            self.feed.verdict(f"engine GPU 0: {reason}")

    def restarted_servers(self, servers: Sequence[Any], timeout_s: float, restart: Any) -> list[int]:
        return []  # the engine's processes are watched by rollout/sglang/health.py, not restarted

    def reset(self, servers: Sequence[Any]) -> None:
        self.staging = (
            SharedStaging()
        )  # no connection (every bucket carries its own handles); the buffer goes

    def manifest_refusal(self, quantized: bool, model_path: str, version: int) -> str | None:
        return None  # started here from an unquantized config (model_config.py), on dummy weights if need be
