"""The fleet's weight sync: the trainer's weights streamed into every engine GPU at once.

One ``WeightSync`` per rank, held by the fleet (``rollout/fleet.py``), called on every rank together.
Its destinations are every rank with a sink (``sync_ranks``: an embedded engine's rank, and every GPU
of a colocated SGLang engine, whose non-leader GPUs hold a member that loads their share); each
receives what its engine rank loads (``WeightSink.weight_needs``; an SGLang EP rank only its experts)
straight from the trainer ranks holding it (its own first, then its node's, the load spread over every
copy), all at once, round by round (``bridge/export.py``). Its steps, each a method:

- ``plan``: the export plan (``bridge/export_plan.py``), made at the first sync and reused while the
  model and the bucket size stay the same, and this rank's manifest (every HF name, shape and dtype
  it receives per sync; FP8 engines, ``quantize``: each quantized weight as float8 with its float32
  scales, quantized on this rank's device as the stream lands it);
- ``check_manifests`` (phase one, before any byte moves): every engine judges the manifest and the
  ranks agree; one rejection anywhere and nobody transfers, every engine keeps its previous version,
  every rank raises with the engines' messages;
- ``transfer`` (phase two on this rank): the bytes stream straight into the engines' live weights (no
  staged version), the first failure kept;
- ``verdict``: the ranks agree on phase two's outcome and its metrics. A failure leaves that engine's
  weights partial (``weight_version`` -1) and every rank raises, naming the engines.

An engine found lost in either phase goes to the fleet's engine recovery (``rollout/recovery.py``):
lost in phase one, it is restarted and takes part in this very sync; lost in phase two, it is
restarted and sent the version alone (the others received all of it). ``sync_groups``: the gloo
groups over which the GPUs of one engine hand their payloads to its leader.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from grpo_megatron.rollout.engine import EngineLost, EngineParts, WeightSink
from grpo_megatron.rollout.recovery import EngineRecovery, describe

if TYPE_CHECKING:
    from grpo_megatron.bridge.export_plan import ExportPlan, TransferStats
    from grpo_megatron.bridge.fp8 import Fp8Weights
    from grpo_megatron.distributed.bootstrap import ParallelState


def sync_groups(members: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The distinct multi-rank weight-sync groups among every rank's ``sync_group_ranks``, in a
    fixed order (every rank creates them in it)."""
    return sorted({tuple(sorted(m)) for m in members if len(m) > 1})


def bind_sync_groups(
    sink: WeightSink | None, members: Sequence[tuple[int, ...] | None], ps: ParallelState
) -> None:
    """Collective: the gloo group of each engine of several GPUs (its ``sync_group_ranks``; ``members``:
    every rank's, None without a sink), made by every rank in the same order, handed to the sink of
    each rank in it: its GPUs hand their payloads to its leader over it (small objects only)."""
    for ranks in sync_groups([r for r in members if r is not None]):
        group_of = dist.new_group(list(ranks), backend="gloo", timeout=ps.timeout, group_desc="ENGINE_SYNC")
        if sink is not None and ps.rank in ranks:
            sink.bind_sync_group(group_of)


@dataclasses.dataclass
class _Transfer:
    """What phase two of a weight sync did on this rank: bytes and buckets its sink received, the
    transport's bytes, and the first failure (None: none)."""

    stats: TransferStats
    received: int = 0
    buckets: int = 0
    error: str | None = None
    lost: EngineLost | None = None
    """The failure was this rank's engine lost (``error`` says so too)."""

    def failed(self, exc: Exception) -> None:
        self.error, self.lost = describe(exc), exc if isinstance(exc, EngineLost) else None


@dataclasses.dataclass
class WeightSync:
    """This rank's side of the weight sync (module docstring)."""

    ps: ParallelState
    hf: Mapping[str, Any]
    parts: EngineParts
    """This rank's engine or member: the sync feeds its ``sink``."""
    sync_ranks: list[int]
    """Destinations: every rank with a sink (every GPU of every engine), in rank order."""
    every_round: bool
    """Some engine spans several GPUs: each of them yields every transfer round, empty or not, so its
    GPUs load in step."""
    recovery: EngineRecovery
    export_dtype: torch.dtype
    """dtype the weights are exported in (the engines' dtype)."""
    bucket_bytes: int
    """Default bucket size (``rollout.sync_bucket_mb``)."""
    rounds_in_flight: int = 2
    """Transfer rounds posted ahead (``rollout.sync_rounds_in_flight``)."""
    quantize: Fp8Weights | None = None
    """The engines serve FP8 (``rollout.weight_dtype=fp8``): the tensors this rule selects reach them
    as block-wise FP8 weight + scales, quantized where they land (on the engine's device, after
    assembly; bridge/fp8.py), and the manifest lists both; None: as exported."""
    export_plan: ExportPlan | None = None
    """The export stream's plan, made at the first sync and reused while the model and bucket size
    stay the same (the metadata exchange it saves grows with the world size)."""
    planned_for: tuple[int, int] | None = None
    """(id of the model, bucket bytes) ``export_plan`` was made for."""
    manifest: list[tuple[str, tuple[int, ...], torch.dtype]] = dataclasses.field(default_factory=list)
    """``export_plan``'s manifest for this rank: every (HF name, shape, dtype) it receives per sync."""
    synced_version: int = -1
    """The version of the last sync that reached every engine (what a restarted one is given)."""

    def run(
        self,
        model: torch.nn.Module,
        version: int,
        *,
        bucket_bytes: int | None = None,
        targets: Sequence[int] | None = None,
    ) -> dict[str, float]:
        """Collective: stream ``model``'s weights into every engine as ``version`` (module docstring).
        ``targets``: only the sinks of these ranks take the version (every GPU of a restarted engine,
        ``EngineRecovery.restart_engines``); the stream runs as always, the others drop what they
        receive. Returns ``sync/*`` metrics: seconds of the manifest check and of the transfer, bytes
        and buckets each engine received, the most bytes of transfer buffers any rank held, and the most
        bytes any engine received straight into its weights."""
        bucket_bytes = bucket_bytes or self.bucket_bytes
        sink = self.parts.sink if targets is None or self.ps.rank in targets else None
        start = time.perf_counter()
        plan = self.plan(model, bucket_bytes)
        self.check_manifests(version, sink)
        check_s = time.perf_counter() - start
        start = time.perf_counter()
        totals = self.verdict(self.transfer(plan, version, sink), version)
        transfer_s = time.perf_counter() - start
        if targets is None:
            self.synced_version = version
        return {
            "sync/check_seconds": check_s,
            "sync/transfer_seconds": transfer_s,
            "sync/seconds": check_s + transfer_s,
            "sync/bytes": float(totals[1]),
            "sync/buckets": float(totals[2]),
            "sync/peak_buffer_bytes": float(totals[3]),
            "sync/in_place_bytes": float(totals[4]),
            "sync/version": float(version),
        }

    def plan(self, model: torch.nn.Module, bucket_bytes: int) -> ExportPlan:
        """The export plan to every engine GPU (made at the first sync, reused while the model and the
        bucket size stay the same), and this rank's manifest."""
        from grpo_megatron.bridge.export_plan import plan_export

        if self.planned_for != (id(model), bucket_bytes) or self.export_plan is None:
            # Each destination's needs (e.g. an SGLang EP rank: dense tensors + its experts), known
            # to every rank: every rank plans every destination's sources.
            sink, dsts = self.parts.sink, tuple(self.sync_ranks)
            needs: list[Any] = [None] * self.ps.world_size
            dist.all_gather_object(needs, sink.weight_needs() if sink is not None else None)
            self.export_plan = plan_export(
                model,
                self.ps,
                self.hf,
                bucket_bytes=bucket_bytes,
                dst_ranks=dsts,
                dtype=self.export_dtype,
                rounds_in_flight=self.rounds_in_flight,
                needs={d: needs[d] for d in dsts if needs[d] is not None},
                quantize=self.quantize,
            )
            self.planned_for = (id(model), bucket_bytes)
            self.manifest = self.export_plan.manifest(self.ps.rank if sink is not None else None)
        return self.export_plan

    def check_manifests(self, version: int, sink: WeightSink | None) -> None:
        """Phase one: every engine (``sink`` on this rank) judges the manifest; the ranks agree (one
        small all-reduce; the messages are gathered only when some engine rejected). A rejection
        anywhere: every engine keeps its previous version and every rank raises. Only lost engines
        (``EngineLost``): the recovery restarts them (or names them past its bound), then they judge."""
        problems: list[str] = []
        lost: EngineLost | None = None
        if sink is not None:
            try:
                problems = sink.check_manifest(self.manifest, version)
            except EngineLost as exc:
                lost = exc
            except Exception as exc:
                problems = [describe(exc)]
        flags = torch.tensor(
            [int(bool(problems)), int(lost is not None)], dtype=torch.int64, device=self.ps.device
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if not flags[0] and flags[1]:
            self.recovery.recover(
                None, lost, f"the weight sync of version {version}", version=version, resync=False
            )
            return self.check_manifests(version, sink)
        problems = problems or ([str(lost)] if lost is not None else [])
        if not flags.any():
            return
        if sink is not None:
            sink.abort_update(version)
        verdicts: list[Any] = [None] * self.ps.world_size
        dist.all_gather_object(verdicts, problems)
        rejected = [(rank, "; ".join(v)) for rank, v in enumerate(verdicts) if v]
        lines = "\n".join(f"  rank {rank}: {e}" for rank, e in rejected[:8])
        raise RuntimeError(
            f"weight sync of version {version} rejected by {len(rejected)} engine(s) before any transfer; "
            f"every engine keeps its previous version:\n{lines}"
        )

    def transfer(self, plan: ExportPlan, version: int, sink: WeightSink | None) -> _Transfer:
        """Phase two on this rank: run the plan's stream to its end (every rank sends from inside it),
        feeding ``sink``, if any, and committing it; the first failure is kept, not raised."""
        from grpo_megatron.bridge.assemble import Landing
        from grpo_megatron.bridge.export import ExportStream
        from grpo_megatron.bridge.export_plan import TransferStats

        out = _Transfer(TransferStats())
        landing = Landing(
            self.ps.device,  # engines sit on the trainer's devices
            borrow=True,  # the engines copy every tensor into their weights at once
            into=sink.load_target if sink is not None else None,
        )
        for bucket in ExportStream(plan, landing, stats=out.stats, every_round=self.every_round):
            if sink is None or out.error is not None:
                continue
            out.received += sum(t.numel() * t.element_size() for _, t in bucket)
            out.buckets += 1
            try:
                sink.update_weights(bucket, version=version, last=False)
            except Exception as exc:
                out.failed(exc)
        if sink is not None and out.error is None:
            try:
                sink.update_weights([], version=version, last=True)
            except Exception as exc:
                out.failed(exc)
        return out

    def verdict(self, outcome: _Transfer, version: int) -> torch.Tensor:
        """One all-reduce (max) carries the verdict and the metrics (bytes and buckets: the busiest
        destination's; with per-GPU needs an engine's GPUs receive different shares): [failed,
        bytes, buckets, peak buffer bytes, in-place bytes]. A failure anywhere: every rank raises;
        lost engines only: the recovery restarts them and every rank sends them ``version`` alone."""
        stats = outcome.stats
        totals = torch.tensor(
            [
                outcome.error is not None,
                outcome.received,
                outcome.buckets,
                stats.peak_bytes,
                stats.in_place_bytes,
            ],
            dtype=torch.int64,
            device=self.ps.device,
        )
        dist.all_reduce(totals, op=dist.ReduceOp.MAX)
        if totals[0]:
            error = None if outcome.lost is not None else outcome.error
            self.recovery.recover(
                error,
                outcome.lost,
                f"the weight sync of version {version}",
                version=version,
                consequence=" during the transfer; their weights are partial (weight_version -1), "
                "resume from the last checkpoint",
            )
        return totals
