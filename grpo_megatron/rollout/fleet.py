"""The rollout fleet: the trainer's view of all its engines, present on every rank.

Every rank of the trainer holds a ``RolloutFleet`` and calls its methods together (they are
collectives); some ranks also hold an engine (``engine_ranks``):

- ``embedded`` engines by ``rollout.placement``: ``per_dp_rank`` = one on each rank with TP, PP and
  CP rank 0 (one per data-parallel replica; with EP, ``ps.dp`` already counts the EP ranks), or
  ``per_node`` = one on each node's local rank 0;
- ``sglang`` engines where ``SGLangEngine.from_config`` starts them (``rollout/sglang_engine.py``).

``generate`` splits the prompts into contiguous slices, one per engine in rank order (engine ``i``
samples with seed ``params.seed + i``), and returns every completion in prompt order on every rank.
``sync_weights`` runs the bridge's streaming export with the first engine rank as destination and
feeds each bucket to its engine as it arrives; the other engine ranks get the same buckets by
broadcast over the engines' process group once the export is done (they take part in the export's
collectives, so they cannot receive during it). An engine commits a version only after its last
bucket validates, and every rank learns of any engine's failure: all ranks raise together.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from grpo_megatron.rollout.engine import Bucket, Completion, MemoryTag, RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from grpo_megatron.bridge.export import ExportPlan
    from grpo_megatron.config import JobConfig
    from grpo_megatron.distributed.bootstrap import ParallelState

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hosts_embedded_engine(placement: str, ps: ParallelState) -> bool:
    """Whether this rank runs an embedded engine under ``rollout.placement``."""
    if placement == "per_dp_rank":
        return ps.tp_rank == 0 and ps.pp_rank == 0 and ps.cp_rank == 0
    if placement == "per_node":
        return ps.local_rank == 0
    raise ValueError(f"rollout.placement={placement!r}: choose per_dp_rank or per_node")


def prompt_slices(num_prompts: int, num_engines: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` prompt ranges, one per engine; the first ones get one extra."""
    base, extra = divmod(num_prompts, num_engines)
    bounds, start = [], 0
    for i in range(num_engines):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _agree(error: str | None, what: str) -> None:
    """Collective: raise on every rank if any rank reports an error (so no rank waits forever)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        lines = "\n".join(f"  rank {rank}: {e}" for rank, e in failed[:8])
        raise RuntimeError(f"{what} failed on {len(failed)} rank(s):\n{lines}")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def make_engine(
    cfg: JobConfig, hf: Mapping[str, Any], ps: ParallelState, tokenizer: Any = None
) -> RolloutEngine | None:
    """This rank's engine under ``cfg.rollout`` (None if it hosts none)."""
    rollout = cfg.rollout
    if rollout.engine == "sglang":
        try:
            from grpo_megatron.rollout import sglang_engine
        except ImportError as exc:
            raise RuntimeError(
                f"rollout.engine=sglang: the SGLang adapter grpo_megatron.rollout.sglang_engine cannot be "
                f"imported ({exc}); use rollout.engine=embedded, or install SGLang on a CUDA machine "
                "(pip install 'grpo-megatron[gpu]')"
            ) from exc
        return sglang_engine.SGLangEngine.from_config(cfg, ps)
    if rollout.engine != "embedded":
        raise ValueError(f"rollout.engine={rollout.engine!r}: choose embedded or sglang")
    if not hosts_embedded_engine(rollout.placement, ps):
        return None
    from grpo_megatron.rollout.embedded import EmbeddedEngine

    device = ps.device if rollout.engine_device == "auto" else torch.device("cpu")
    return EmbeddedEngine(
        hf,
        device=device,
        dtype=_DTYPES[cfg.model.dtype],
        tokenizer=tokenizer,
        max_batch_rows=rollout.embedded_max_batch_rows,
    )


@dataclasses.dataclass
class RolloutFleet:
    """All rollout engines of a job; every method is called on every rank with the same arguments."""

    ps: ParallelState
    hf: Mapping[str, Any]
    engine: RolloutEngine | None
    """This rank's engine, or None."""
    engine_ranks: list[int]
    """Global ranks holding an engine, in engine-index order."""
    group: Any
    """Process group of ``engine_ranks`` (made by every rank, used by the engine ranks)."""
    export_dtype: torch.dtype
    """dtype the weights are exported in (the engines' dtype)."""
    bucket_bytes: int
    """Default weight-sync bucket size (``rollout.sync_bucket_mb``)."""
    export_plan: ExportPlan | None = None
    """The export stream's plan, made at the first sync and reused while the model and bucket size
    stay the same (the metadata exchange it saves grows with the world size)."""
    planned_for: tuple[int, int] | None = None
    """(id of the model, bucket bytes) ``export_plan`` was made for."""

    @classmethod
    def build(
        cls, cfg: JobConfig, hf: Mapping[str, Any], ps: ParallelState, tokenizer: Any = None
    ) -> RolloutFleet:
        """Collective: create this rank's engine (if any) and the engines' process group."""
        engine, error = None, None
        try:
            engine = make_engine(cfg, hf, ps, tokenizer)
        except Exception as exc:  # reported on every rank by _agree, so no rank hangs
            error = _describe(exc)
        _agree(error, f"building the {cfg.rollout.engine} rollout engines")
        flags: list[bool | None] = [None] * ps.world_size
        dist.all_gather_object(flags, engine is not None)
        engine_ranks = [rank for rank, has in enumerate(flags) if has]
        if not engine_ranks:
            raise RuntimeError(
                f"rollout.engine={cfg.rollout.engine} with placement {cfg.rollout.placement} put no engine "
                "on any rank"
            )
        group = dist.new_group(engine_ranks)  # every rank must call new_group, engine or not
        return cls(
            ps=ps,
            hf=hf,
            engine=engine,
            engine_ranks=engine_ranks,
            group=group,
            export_dtype=_DTYPES[cfg.model.dtype],
            bucket_bytes=cfg.rollout.sync_bucket_mb << 20,
        )

    @property
    def engine_index(self) -> int | None:
        """Position of this rank's engine in ``engine_ranks`` (None without an engine)."""
        return self.engine_ranks.index(self.ps.rank) if self.engine is not None else None

    @property
    def num_engines(self) -> int:
        return len(self.engine_ranks)

    # ------------------------------------------------------------------------------- generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Collective: ``params.n`` completions per prompt, in prompt order, on every rank."""
        local: list[list[Completion]] | None = None
        error = None
        if self.engine is not None:
            index = self.engine_ranks.index(self.ps.rank)
            start, end = prompt_slices(len(prompts), self.num_engines)[index]
            seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + index)
            try:
                local = self.engine.generate(prompts[start:end], seeded) if end > start else []
            except Exception as exc:
                error = _describe(exc)
        _agree(error, "rollout generate")
        gathered: list[list[list[Completion]] | None] = [None] * self.ps.world_size
        dist.all_gather_object(gathered, local)
        out: list[list[Completion]] = []
        for rank in self.engine_ranks:
            out.extend(gathered[rank] or [])
        if len(out) != len(prompts):
            raise RuntimeError(f"rollout generate: {len(out)} results for {len(prompts)} prompts")
        return out

    # ------------------------------------------------------------------------------ weight sync

    def sync_weights(
        self, model: torch.nn.Module, version: int, *, bucket_bytes: int | None = None
    ) -> dict[str, float]:
        """Collective: stream the trainer's weights into every engine as ``version``.

        Returns ``sync/*`` metrics (seconds of the export and of the broadcast, bytes, buckets).
        An engine that rejects the update keeps its previous weights and version; then every rank
        raises with the engines' messages.
        """
        from grpo_megatron.bridge.export import broadcast_bucket, export_hf_stream, plan_export

        bucket_bytes = bucket_bytes or self.bucket_bytes
        dst = self.engine_ranks[0]
        is_dst = self.ps.rank == dst
        keep = is_dst and self.num_engines > 1  # buckets the other engines still need
        kept: list[Bucket] = []
        feeder = _Feeder(self.engine, version) if is_dst else None
        start = time.perf_counter()
        if self.planned_for != (id(model), bucket_bytes):
            self.export_plan = plan_export(
                model, self.ps, self.hf, bucket_bytes=bucket_bytes, dst_rank=dst, dtype=self.export_dtype
            )
            self.planned_for = (id(model), bucket_bytes)
        stream = export_hf_stream(
            model, self.ps, self.hf, bucket_bytes=bucket_bytes, dst_rank=dst, dtype=self.export_dtype,
            plan=self.export_plan,
        )
        for bucket in stream:
            if feeder is not None:
                feeder.push(bucket)
            if keep:
                kept.append(bucket)
        if feeder is not None:
            feeder.finish()
        export_s = time.perf_counter() - start

        start = time.perf_counter()
        header: list[Any] = [None]
        if is_dst:
            header = [(len(kept) if feeder.error is None else -1, feeder.bytes, feeder.buckets)]
        if self.num_engines > 1 and self.ps.rank in self.engine_ranks:
            dist.broadcast_object_list(header, src=dst, group=self.group)
            num_kept = header[0][0]
            if not is_dst and num_kept >= 0:  # -1: the first engine failed; the rest keep their weights
                receiver = _Feeder(self.engine, version)
                for _ in range(num_kept):
                    receiver.push(broadcast_bucket(None, dst, self.group, device=self.ps.device))
                receiver.finish()
                feeder = receiver
            elif is_dst and num_kept >= 0:
                for bucket in kept:
                    broadcast_bucket(bucket, dst, self.group, device=self.ps.device)
        broadcast_s = time.perf_counter() - start
        _agree(feeder.error if feeder is not None else None, f"weight sync of version {version}")

        # Everyone reports the same numbers: the first engine rank's.
        box = [header[0] if is_dst else None]
        dist.broadcast_object_list(box, src=dst)
        _, total_bytes, buckets = box[0]
        return {
            "sync/export_seconds": export_s,
            "sync/broadcast_seconds": broadcast_s,
            "sync/seconds": export_s + broadcast_s,
            "sync/bytes": float(total_bytes),
            "sync/buckets": float(buckets),
            "sync/version": float(version),
        }

    # -------------------------------------------------------------------------- mismatch probe

    def mismatch_probe(
        self,
        model: torch.nn.Module,
        ps: ParallelState,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        temperature: float,
    ) -> dict[str, float]:
        """Collective: trainer ``forward_logprobs`` vs every engine's ``score`` on one fixed batch, over
        the tokens after each prompt; max and mean absolute difference over all engines (an empty
        batch gives no metrics). For an MoE engine that reports routes, the trainer's pass also
        counts how often its experts differ from the first engine's (``routing/probe_disagreement``),
        and a second pass replays those routes (``mismatch/probe_replay_*``, models/routing.py)."""
        from grpo_megatron.models.routing import RoutingPass, reduce_routing_stats
        from grpo_megatron.training.forward_backward import MicroBatch, forward_logprobs

        if not sequences:  # e.g. rollout.probe_batch=0, or every response was empty
            return {}
        scored, routes, error = None, None, None
        if self.engine is not None:
            try:
                scored, routes = self.engine.score_with_routes(sequences, prompt_lens, temperature)
            except Exception as exc:
                error = _describe(exc)
        _agree(error, "mismatch probe")
        box = [routes if ps.rank == self.engine_ranks[0] else None]
        dist.broadcast_object_list(box, src=self.engine_ranks[0])
        routes = box[0]
        length = max(len(s) for s in sequences)
        tokens_bl = torch.zeros((len(sequences), length), dtype=torch.long)  # right padding is harmless
        for i, seq in enumerate(sequences):
            tokens_bl[i, : len(seq)] = torch.tensor(list(seq))
        batch = MicroBatch(tokens_bl[:, :-1], tokens_bl[:, 1:])
        if routes is not None:
            first = routes[0]
            batch.routes_lbsk = torch.full((first.shape[0], len(sequences), length - 1, first.shape[2]), -1, dtype=first.dtype)
            for i, r in enumerate(routes):
                batch.routes_lbsk[:, i, : r.shape[1]] = r

        def probe(replay: bool, suffix: str) -> dict[str, float]:
            routing = RoutingPass(model, ps, replay=replay) if routes is not None else None
            (out,) = forward_logprobs(
                model, [batch], ps, vocab_size=int(self.hf["vocab_size"]), temperature=temperature, routing=routing
            )
            metrics = self._probe_diffs(out.logprobs_bs.float().cpu(), sequences, prompt_lens, scored, ps, suffix)
            if routing is not None:
                compare_m2, _ = reduce_routing_stats(*routing.stats(), ps)
                routing.close()
                if not replay and float(compare_m2[:, 1].sum()) > 0:
                    metrics["routing/probe_disagreement"] = float(compare_m2[:, 0].sum() / compare_m2[:, 1].sum())
            return metrics

        metrics = probe(False, "")
        if routes is not None:
            metrics |= probe(True, "_replay")
        return metrics

    def _probe_diffs(
        self,
        trainer_bl: torch.Tensor,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        scored: list[list[float]] | None,
        ps: ParallelState,
        suffix: str,
    ) -> dict[str, float]:
        """Collective: |engine - trainer| logprobs after each prompt, max and mean over all engines."""
        stats = None
        if scored is not None:
            diffs = [
                (torch.tensor(engine_lp) - trainer_bl[i, p - 1 : len(s) - 1]).abs()
                for i, (s, p, engine_lp) in enumerate(zip(sequences, prompt_lens, scored, strict=True))
            ]
            diff_t = torch.cat(diffs) if diffs else torch.zeros(0)
            stats = (float(diff_t.max()) if diff_t.numel() else 0.0, float(diff_t.sum()), diff_t.numel())
        gathered: list[Any] = [None] * ps.world_size
        dist.all_gather_object(gathered, stats)
        got = [g for g in gathered if g is not None]
        count = sum(g[2] for g in got)
        out = {
            f"mismatch/probe{suffix}_abs_diff_max": max(g[0] for g in got),
            f"mismatch/probe{suffix}_abs_diff_mean": sum(g[1] for g in got) / max(count, 1),
        }
        if not suffix:
            out["mismatch/probe_tokens"] = float(count)
        return out

    # ---------------------------------------------------------------------------------- memory

    def release_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        if self.engine is not None:
            self.engine.release_memory(tags)

    def resume_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        if self.engine is not None:
            self.engine.resume_memory(tags)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def probe_batch(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[Completion]], size: int
) -> tuple[list[list[int]], list[int]]:
    """The first ``size`` (prompt + response) sequences of a rollout and their prompt lengths: a
    fixed batch for ``mismatch_probe`` (responses shorter than one token are skipped)."""
    sequences, prompt_lens = [], []
    for prompt, group in zip(prompts, completions, strict=True):
        for completion in group:
            if len(sequences) == size:
                return sequences, prompt_lens
            if completion.token_ids:
                sequences.append(list(prompt) + list(completion.token_ids))
                prompt_lens.append(len(prompt))
    return sequences, prompt_lens


class _Feeder:
    """Hands buckets to an engine one step behind, so the final bucket can carry ``last=True``.

    The first error is kept (and nothing more is sent): the fleet reports it on every rank."""

    def __init__(self, engine: RolloutEngine | None, version: int) -> None:
        assert engine is not None
        self.engine, self.version = engine, version
        self.pending: Bucket | None = None
        self.error: str | None = None
        self.bytes = 0
        self.buckets = 0

    def push(self, bucket: Bucket) -> None:
        self.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        self.buckets += 1
        if self.pending is not None:
            self._send(self.pending, last=False)
        self.pending = bucket

    def finish(self) -> None:
        self._send(self.pending or [], last=True)
        self.pending = None

    def _send(self, bucket: Bucket, *, last: bool) -> None:
        if self.error is not None:
            return
        try:
            self.engine.update_weights(bucket, version=self.version, last=last)
        except Exception as exc:
            self.error = _describe(exc)
