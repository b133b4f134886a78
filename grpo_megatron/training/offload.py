"""Trainer offload / onload: move the policy's device memory to host memory around rollout and back.

What moves: every storage behind the policy's training state, found by walking it (no list of
megatron internals to keep in sync):
- parameters, and megatron DDP's contiguous param/grad buffers (``buffers`` and
  ``expert_parallel_buffers``, whose views are the parameters and their ``main_grad``);
- optimizer state (Adam moments, step) and the optimizer's own parameters: fp32 main copies under
  mixed precision, the distributed optimizer's shards, whatever ``param_groups`` hold, and their
  ``.grad``.

How: each storage is copied into one host buffer (pinned on GPU, so the copies run at full PCIe
speed) and then shrunk to zero bytes with ``untyped_storage().resize_(0)``; ``onload`` grows it back
and copies the bytes in. Every tensor keeps its storage object, so views (parameters inside DDP's
buffer, the distributed optimizer's shard views, ``main_grad``) stay valid without re-pointing
anything, and the round trip is bit-exact. On CPU the storages are freed the same way (which is
what the tests check); there is no device memory to report.

Parts can go separately: a colocated iteration offloads gradients and optimizer state after the
update, keeps the parameters for the weight sync (the export reads them), then offloads those.

torch_memory_saver (GPU, optional) pauses allocations made inside its ``region()``; our policy is
built outside one, so it does not apply here: the trainer may use it for what it builds inside a
region, and this module is the path for the policy.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from grpo_megatron.rollout.placement import ENGINE_TAGS, TRAINER_PARTS, Occupancy

if TYPE_CHECKING:
    from grpo_megatron.training.policy import Policy


@dataclass
class OffloadReport:
    """What ``offload`` moved; ``onload`` needs it to bring everything back."""

    bytes_moved: int
    """Bytes copied to host memory (gradients discarded with ``discard_grads`` are not counted)."""
    bytes_freed: int
    """Device (or CPU) bytes released, copied or discarded."""
    seconds: float
    device_memory_left: int | None
    """``torch.cuda.memory_allocated()`` after the offload; None on CPU."""
    storages: int
    """Number of distinct storages freed."""
    _saved: list[tuple[torch.UntypedStorage, torch.Tensor | None, int]] = field(
        default_factory=list, repr=False
    )
    """(storage, host copy of its bytes or None for a discarded gradient that comes back zeroed,
    its size in bytes)."""
    onloaded: bool = False
    parts: frozenset[str] = frozenset()
    """The parts asked for (``offload``'s ``parts``)."""

    def metrics(self, prefix: str = "offload/") -> dict[str, float]:
        out = {
            f"{prefix}bytes_moved": float(self.bytes_moved),
            f"{prefix}bytes_freed": float(self.bytes_freed),
            f"{prefix}seconds": self.seconds,
        }
        if self.device_memory_left is not None:
            out[f"{prefix}device_memory_left"] = float(self.device_memory_left)
        return out


def _chunks(model: torch.nn.Module | list[torch.nn.Module]) -> list[torch.nn.Module]:
    return model if isinstance(model, list) else [model]


def _inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (chained or not), or a torch optimizer itself."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    megatron_opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [opt.optimizer for opt in megatron_opts if getattr(opt, "optimizer", None) is not None]


def _ddp_buffers(chunk: torch.nn.Module) -> list[Any]:
    """megatron DDP's param/grad buffers (its ``buffers`` list shadows ``nn.Module.buffers()``)."""
    out = []
    for attr in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, attr, None)
        if isinstance(value, list):
            out.extend(value)
    return out


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def policy_tensors(policy: Policy) -> dict[str, list[torch.Tensor]]:
    """Every tensor of the policy's training state by part: "params" (parameters and DDP's param
    buffers), "grads" (DDP's grad buffers, ``main_grad``, ``.grad``), "optimizer" (optimizer state
    and the optimizer's own parameters: fp32 main copies, distributed-optimizer shards)."""
    parts: dict[str, list[torch.Tensor]] = {"params": [], "grads": [], "optimizer": []}
    for chunk in _chunks(policy.model):
        for buffer in _ddp_buffers(chunk):
            if getattr(buffer, "param_data", None) is not None:
                parts["params"].append(buffer.param_data)
            if getattr(buffer, "grad_data", None) is not None:
                parts["grads"].append(buffer.grad_data)
        for param in chunk.parameters():
            parts["params"].append(param.data)
            main_grad = getattr(param, "main_grad", None)  # megatron DDP's gradient buffer view
            if main_grad is not None:
                parts["grads"].append(main_grad)
            if param.grad is not None:
                parts["grads"].append(param.grad)
    for inner in _inner_optimizers(policy.optimizer):
        parts["optimizer"].extend(_tensors_in(list(inner.state.values())))
        for group in inner.param_groups:
            for param in group["params"]:
                parts["optimizer"].append(param.data)
                if param.grad is not None:
                    parts["grads"].append(param.grad)
    return parts


ALL_PARTS: tuple[str, ...] = ("params", "grads", "optimizer")


def _unique_storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            out.setdefault(storage.data_ptr(), storage)
    return out


def offload(
    policy: Policy, *, parts: Collection[str] = ALL_PARTS, discard_grads: bool = False
) -> OffloadReport:
    """Copy the policy's ``parts`` (parameters, gradients, optimizer state) to host memory and free them.

    A storage shared by several parts (a distributed-optimizer shard is a view of its parameter)
    belongs to the first of params, grads, optimizer: offloading "optimizer" alone never frees a
    parameter. Storages already offloaded are skipped, so ``offload(parts=("grads", "optimizer"))``
    before a weight sync and ``offload(parts=("params",))`` after it free everything in two steps
    (onload both reports). ``discard_grads``: free gradients without copying them (they come back
    zeroed), for a trainer that zeroes gradients before its next step anyway.
    """
    unknown = sorted(set(parts) - set(ALL_PARTS))
    if unknown:
        raise ValueError(f"offload parts {unknown}: choose from {list(ALL_PARTS)}")
    start = time.perf_counter()
    owner: dict[int, str] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    for part, tensors in policy_tensors(policy).items():
        for ptr, storage in _unique_storages(tensors).items():
            if ptr not in owner:
                owner[ptr] = part
                if part in parts:
                    storages[ptr] = storage
    on_gpu = any(s.device.type == "cuda" for s in storages.values())

    saved: list[tuple[torch.UntypedStorage, torch.Tensor | None, int]] = []
    moved = freed = 0
    for ptr, storage in storages.items():
        nbytes = storage.nbytes()
        host = None
        if not (discard_grads and owner[ptr] == "grads"):
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
            host.copy_(_bytes_of(storage), non_blocking=on_gpu)
            moved += nbytes
        saved.append((storage, host, nbytes))
        freed += nbytes
    if on_gpu:
        torch.cuda.synchronize()  # the copies must land before the storages go
    for storage, _, _ in saved:
        storage.resize_(0)
    memory_left = None
    if on_gpu:
        torch.cuda.empty_cache()
        memory_left = torch.cuda.memory_allocated()
    return OffloadReport(
        bytes_moved=moved,
        bytes_freed=freed,
        seconds=time.perf_counter() - start,
        device_memory_left=memory_left,
        storages=len(saved),
        _saved=saved,
        parts=frozenset(parts),
    )


def onload(policy: Policy, report: OffloadReport) -> float:
    """Bring back what ``offload`` freed, bit for bit, in the same storages; returns seconds.

    Discarded gradients come back as zeros."""
    if report.onloaded:
        raise RuntimeError("onload: this OffloadReport was already onloaded; offload again first")
    start = time.perf_counter()
    on_gpu = False
    for storage, host, nbytes in report._saved:
        storage.resize_(nbytes)
        device_bytes = _bytes_of(storage)
        on_gpu = on_gpu or storage.device.type == "cuda"
        if host is None:
            device_bytes.zero_()
        else:
            device_bytes.copy_(host, non_blocking=on_gpu)
    if on_gpu:
        torch.cuda.synchronize()
    report.onloaded = True
    report._saved = []
    return time.perf_counter() - start


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage`` (shares its memory)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


CACHED_KEY = "offload/cached_free_bytes"
"""The trainer's reserved but unused device bytes right before an engine resumed (the worst resume of the
phases reported), 0 where nothing is cached (CPU); bench/gpu_check.py's cached-blocks criterion reads it."""


def release_device_cache() -> dict[str, float]:
    """Return the trainer process's cached, unused device blocks to the driver (CUDA's caching allocator
    keeps what training freed reserved for this process: another process, a colocated engine resuming
    its KV cache, cannot use it). Objects in reference cycles are collected first, so that no tensor
    only a cycle still holds keeps its block. ``offload/cached_free_bytes``: what stays reserved but
    unused afterwards; 0.0 where nothing is cached (CPU, or CUDA never used: nothing to return)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {CACHED_KEY: 0.0}
    gc.collect()
    torch.cuda.empty_cache()
    return {CACHED_KEY: float(torch.cuda.memory_reserved() - torch.cuda.memory_allocated())}


def release_pinned_host_cache() -> None:
    """Unpin the host memory torch's pinned-memory allocator keeps cached (an offload's host buffers,
    freed by their onload, stay pinned in that cache for the next offload to reuse): page-locked memory
    the rest of the node cannot use. A no-op without CUDA (nothing is pinned on CPU)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    accelerator = getattr(torch, "accelerator", None)
    empty = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:  # torch.accelerator.empty_host_cache (2.13); torch._C._host_emptyCache before
        empty()


def merge_memory_metrics(*parts: Mapping[str, float]) -> dict[str, float]:
    """The ``offload/*`` metrics of several memory phases as one: bytes and seconds add up, the cached
    bytes at an engine resume are the worst one's, the device memory left is the last phase's."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            if key not in out or key.endswith("memory_left"):
                out[key] = value
            elif key == CACHED_KEY:
                out[key] = max(out[key], value)
            else:
                out[key] += value
    return out


class ColocatedMemory:
    """The colocated memory choreography: moves the trainer's state and the engines' memory so that
    each phase has on the device what ``rollout/placement.py`` planned for it (``phases``, the table
    ``grpo-megatron plan`` adds up). The trainer, checkpoint saving, the final export and
    bench/gpu_smoke.py call it. Every move frees before it allocates: engine tags the next phase does
    not hold are released and trainer parts it does not hold leave first, then what it needs returns.

    With colocated SGLang engines (and with ``train.offload_trainer`` for any engine), one iteration:
      ``start_engines`` (start-up) the engines start while the trainer's state is in host memory (SGLang
                       sizes its pool from free memory), then release all of theirs; the trainer returns;
      ``to_trainer``   (train) the engines release all their memory, the trainer's state returns;
      ``before_sync``  (sync) the engines take their weights back (with offload, gradients and
                       optimizer state leave first; the export reads the parameters, so those stay);
      ``engines_serve`` (probe, only when the mismatch probe runs) the engines get their KV cache and
                       CUDA graphs back while the parameters are still here: the probe needs both;
      ``after_sync``   (rollout) with offload the parameters leave; the engines get their caches back.
    ``trainer_visit`` (save) a checkpoint save: with offload the parameters and optimizer state visit
    the device beside the engines' weights (their caches are released); afterwards the phase before
    comes back.
    Without a swapping placement every phase holds everything and every method moves nothing.

    Before the engines start and before every resume of engine memory, in every phase order, the
    trainer's cached device blocks go back to the driver (``release_cache``): the engines are other
    processes, and memory the trainer's allocator keeps reserved is not free for them.

    Every phase returns its metrics (``visit`` yields them): ``offload/*`` of what moved, and at an
    engine resume ``offload/cached_free_bytes`` (0 on CPU). The worst of the latter since the last
    metrics row, whichever caller moved the memory (a save or an engine restart included), is
    ``take_cached_at_resume``'s: bench/gpu_check.py fails a stage whose rows miss it (issue 51).
    """

    def __init__(
        self,
        policy: Policy,
        fleet: Any,
        phases: Mapping[str, Occupancy],
        *,
        discard_grads: bool = False,
        release_cache: Callable[[], dict[str, float]] = release_device_cache,
        release_host_cache: Callable[[], None] = release_pinned_host_cache,
    ) -> None:
        self.policy = policy
        self.fleet = fleet
        """The rollout fleet (rollout/fleet.py: ``release_memory`` / ``resume_memory``); None until
        ``start_engines`` builds it."""
        self.phases = dict(phases)
        """``RolloutPlacement.phases()``: what each phase holds on the device."""
        self.discard_grads = discard_grads
        """Free gradients without copying them (they come back zeroed): for a loop that zeroes them
        before its next step anyway (bench/gpu_smoke.py)."""
        self.offloaded: list[OffloadReport] = []
        """Trainer state now in host memory, in the order it left."""
        self.engine_held: set[str] = set() if fleet is None else set(ENGINE_TAGS)
        """Engine memory tags the engines hold now."""
        self.phase = "train"
        """The phase whose memory is on the device now."""
        self.release_cache = release_cache
        """Returns the trainer's cached device blocks to the driver (``release_device_cache``)."""
        self.release_host_cache = release_host_cache
        """Unpins the host buffers an offload left cached (``release_pinned_host_cache``)."""
        self._cached_at_resume: float | None = None
        """The worst ``offload/cached_free_bytes`` of the engine resumes since ``take_cached_at_resume``."""

    def enter(self, phase: str) -> dict[str, float]:
        """Move to ``phase``'s memory; ``offload/*`` of what left and ``offload/onload_seconds`` of
        what returned (when anything did)."""
        want = self.phases[phase]
        release = [t for t in ENGINE_TAGS if t in self.engine_held and t not in want.engine]
        if release and self.fleet is not None:
            self.fleet.release_memory(release)
        self.engine_held.difference_update(release)
        leaving = self._offload_each(self._on_device() - want.trainer)
        self.offloaded.extend(leaving)
        metrics = merge_memory_metrics(*(r.metrics() for r in leaving))  # totals; memory left after the last
        back = [r for r in self.offloaded if r.parts & want.trainer]
        if back:
            self.offloaded = [r for r in self.offloaded if not r.parts & want.trainer]
            metrics["offload/onload_seconds"] = sum(onload(self.policy, r) for r in reversed(back))
        resume = [t for t in ENGINE_TAGS if t in want.engine and t not in self.engine_held]
        if resume and self.fleet is not None:
            metrics |= self.release_cache()  # after the trainer's moves: what they freed goes back too
            self._note_resume(metrics)
            self.fleet.resume_memory(resume)
        self.engine_held.update(resume)
        self.phase = phase
        return metrics

    def _on_device(self) -> set[str]:
        """The trainer parts on the device now."""
        return set(TRAINER_PARTS).difference(*(r.parts for r in self.offloaded))

    def _offload_each(self, parts: Collection[str]) -> list[OffloadReport]:
        """``parts`` off the device, one report per part: each comes back on its own."""
        return [offload(self.policy, parts=(p,), discard_grads=self.discard_grads) for p in sorted(parts)]

    def _note_resume(self, metrics: Mapping[str, float]) -> None:
        cached = metrics.get(CACHED_KEY)
        if cached is None:  # a release_cache that measures nothing: the check must see it missing
            return
        self._cached_at_resume = max(cached, self._cached_at_resume or 0.0)

    def take_cached_at_resume(self) -> dict[str, float]:
        """``offload/cached_free_bytes`` of the worst engine resume since the last call (every phase's,
        a checkpoint save's or an engine restart's visit included, whichever caller made it), for the
        iteration's metrics row; empty when no engine resumed."""
        cached, self._cached_at_resume = self._cached_at_resume, None
        return {} if cached is None else {CACHED_KEY: cached}

    def start_engines(self, build: Callable[[], Any]) -> Any:
        """Start-up: the trainer's state leaves the device as planned, ``build()`` starts the engines
        (they hold all their memory), then the training phase's memory is restored. Returns the fleet.
        Where no later phase offloads the trainer (``train.offload_trainer=false``: every recipe), the
        pinned host buffers of that one offload are unpinned once it is back (issue 51 item 9: they stayed
        page-locked in torch's pinned-memory cache for the whole run); an offloading job keeps them for
        its next offload."""
        self.enter("start-up")
        self.release_cache()  # the engines size their memory from what is free
        self.fleet = build()
        self.engine_held = set(ENGINE_TAGS)
        self.enter("train")
        if all(held.trainer == TRAINER_PARTS for name, held in self.phases.items() if name != "start-up"):
            self.release_host_cache()
        return self.fleet

    def to_trainer(self) -> dict[str, float]:
        """Engines -> trainer (the train phase): ``offload/onload_seconds`` when anything came back."""
        return self.enter("train")

    def before_sync(self) -> dict[str, float]:
        """The sync phase: the engines take their weights back; what the sync does not read leaves
        (``offload/*``, ``offload/cached_free_bytes`` of the resume)."""
        return self.enter("sync")

    def engines_serve(self) -> dict[str, float]:
        """The probe phase: the engines get their caches back (they can score and generate again);
        the trainer's parameters stay, for the probe's forward pass (``offload/*`` of the move)."""
        return self.enter("probe")

    def after_sync(self) -> dict[str, float]:
        """The rollout phase: with offload the parameters leave (``offload/*``); the engines get
        their caches back (if ``engines_serve`` has not)."""
        return {k: v for k, v in self.enter("rollout").items() if k != "offload/onload_seconds"}

    @contextmanager
    def visit(self, phase: str) -> Iterator[dict[str, float]]:
        """``phase``'s memory for the body, then the phase before it again; inside ``phase`` already,
        nothing moves. Yields the visit's ``offload/*`` (the way in at once, the way back added when
        the body ends: ``merge_memory_metrics``). ``visit("save")``: a checkpoint save.
        ``visit("sync")``: an engine restarted in place during a rollout (issue 41,
        ``EngineRecovery.restart_engines``) is streamed the last synced version, and the export reads the
        parameters the rollout phase offloads."""
        before = self.phase
        moved: dict[str, float] = {}
        if before == phase:
            yield moved
            return
        moved |= self.enter(phase)
        yield moved
        moved |= merge_memory_metrics(dict(moved), self.enter(before))

    def trainer_visit(self) -> AbstractContextManager[dict[str, float]]:
        """The save phase for the body (a checkpoint save): ``visit("save")``."""
        return self.visit("save")

    def sync_visit(self) -> AbstractContextManager[dict[str, float]]:
        """The sync phase for the body (an engine's resync during a rollout): ``visit("sync")``."""
        return self.visit("sync")

    @contextmanager
    def restart_visit(self) -> Iterator[dict[str, float]]:
        """An engine restarted in place starts as the engines did at start-up (issue 51 item 2): the
        trainer's state on the device leaves, its cached blocks go back to the driver (SGLang sizes its
        KV pool from the memory free as it starts: with the trainer resident it would get a fraction of
        the planned pool, or none), the body restarts the engine (which releases again what its
        predecessor had released: the phase of the moment), then the state returns. Yields
        ``offload/*`` of the way out, ``offload/onload_seconds`` added at the end."""
        reports = self._offload_each(self._on_device())
        moved = merge_memory_metrics(*(r.metrics() for r in reports)) | self.release_cache()
        try:
            yield moved
        finally:
            moved["offload/onload_seconds"] = sum(onload(self.policy, r) for r in reversed(reports))

    def trainer_back(self) -> None:
        """Bring the trainer's state back for good (the final export reads the parameters; the end of
        a loop); the engines' memory is not touched."""
        for report in reversed(self.offloaded):
            onload(self.policy, report)
        self.offloaded.clear()
