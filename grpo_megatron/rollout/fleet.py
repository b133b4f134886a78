"""The rollout fleet: the trainer's view of all its engines, present on every rank.

Every rank of the trainer holds a ``RolloutFleet`` and calls its methods together (they are
collectives); some ranks also hold an engine (``engine_ranks``):

- where ``rollout/placement.py`` puts them (the decision ``grpo-megatron plan`` prints too):
  ``embedded`` engines by ``rollout.placement`` (``per_dp_rank``: each rank with TP, PP and CP rank
  0; ``per_node``: each node's local rank 0; ``per_rank``: every rank), ``sglang`` engines of the
  placement's width and EP, started by ``SGLangEngine.from_config`` (``rollout/sglang/engine.py``).

``generate`` splits the prompts into contiguous slices, one per engine in rank order (engine ``i``
samples with seed ``params.seed + i``), and returns every completion in prompt order on every rank,
as fixed-layout tensors over a host-side group (``rollout/results.py``): whole everywhere, or (the
training rollout, ``payload="owners"``) whole on rank 0 and as headers elsewhere until
``deliver_completions`` sends each to the data-parallel replica that trains it; routed experts stay
on their engine's rank until ``deliver_routes`` sends each to the ranks that train it.

The fleet's two other rooms, each an object it holds:

- ``weights`` (``rollout/weight_sync.py:WeightSync``): ``sync_weights`` streams the trainer's weights
  into every engine GPU at once, all or nothing (every engine checks the plan's manifest before any
  byte moves);
- ``recovery`` (``rollout/recovery.py:EngineRecovery``): engine loss. Every step that can find an
  engine lost (a rollout's ``collect``, both phases of a sync, the mismatch probe's ``score``) hands its
  failure to it: lost engines are restarted in place up to ``rollout.recovery.max_restarts`` and
  given the version last synced, and the step goes on (a lost engine's share of the batch is
  submitted again, with the same prompts and per-engine seed; live engines' results are kept); past
  the bound every rank raises, naming each lost engine, its rank, host, why and its log's tail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from grpo_megatron.rollout.engine import (
    Completion,
    EngineLost,
    EngineParts,
    EngineSpec,
    MemoryTag,
    RolloutEngine,
    SamplingParams,
    WeightSink,
)
from grpo_megatron.rollout.factory import DTYPES, make_engine, make_sync_member
from grpo_megatron.rollout.placement import RolloutPlacement, runtime_placement
from grpo_megatron.rollout.recovery import EngineRecovery, Resync, describe
from grpo_megatron.rollout.results import (
    DataGroup,
    HeldCompletions,
    HeldRoutes,
    Payload,
    exchange_engine,
    pack,
    received_numel,
    sizes_of,
)
from grpo_megatron.rollout.sglang.model_config import engine_fp8
from grpo_megatron.rollout.weight_sync import WeightSync, bind_sync_groups

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from grpo_megatron.distributed.bootstrap import ParallelState


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


@dataclasses.dataclass
class PendingRollout:
    """A generation ``RolloutFleet.submit`` started: this rank's share to collect (None on ranks
    without an engine), the number of prompts of the whole request and completions per prompt."""

    num_prompts: int
    n: int = 1
    routes: bool = False
    """``SamplingParams.routes``: ``collect`` holds each completion's routes on its engine's rank."""
    local: Callable[[], list[list[Completion]]] | None = None
    error: str | None = None
    """Why this rank's share could not start (``collect`` raises it on every rank)."""
    share: tuple[list[list[int]], SamplingParams] | None = None
    """On an engine rank: its share's prompts and seeded sampling, to submit again after a restart."""
    life: int = 0
    """The engine's ``life`` when the share was submitted: a share of an earlier life is submitted again."""
    lost: EngineLost | None = None
    """The engine was found lost when the share was submitted."""
    done: list[list[Completion]] | None = None
    """This rank's completions once collected (kept while a lost engine elsewhere is redone)."""


@dataclasses.dataclass
class RolloutFleet:
    """All rollout engines of a job; every method is called on every rank with the same arguments."""

    ps: ParallelState
    hf: Mapping[str, Any]
    parts: EngineParts
    """This rank's engine (``engine``), or on a GPU of an engine led from another rank (a colocated SGLang
    engine's other GPUs) what loads this GPU's share of the weights (``member``), or neither."""
    engine_ranks: list[int]
    """Global ranks holding an engine, in engine-index order."""
    group: Any
    """Process group of ``engine_ranks`` (made by every rank, used by the engine ranks)."""
    weights: WeightSync
    """The weight sync (``sync_weights``)."""
    recovery: EngineRecovery
    """Engine loss: every step that finds an engine lost hands it its failure."""
    data: DataGroup
    """The host-side group every rank's rollout results travel over and the recovery agrees over."""
    placement: RolloutPlacement | None = None
    """Where the engines run and what each phase keeps on the device (rollout/placement.py)."""
    held_routes: HeldRoutes = dataclasses.field(default_factory=HeldRoutes)
    """Routes of completions generated with ``SamplingParams.routes`` until ``deliver_routes``."""
    held_completions: HeldCompletions = dataclasses.field(default_factory=HeldCompletions)
    """Completions of ``generate(payload="owners")`` until ``deliver_completions``."""
    routes: bool = False
    """The engines were built to report MoE routes (``EngineSpec.record_routes``: routing replay r3):
    the training rollouts ask for them (``SamplingParams.routes``)."""
    sync_waits_for_generation: bool = False
    """A weight load waits for the generation in flight (SGLang: its tokenizer manager takes the
    model-update writer lock, which waits for every running request, and ``ServerGuard`` waits
    too), so a batch submitted ahead must be collected before the sync stream starts
    (``GroupSource.before_sync``): else the engine's leader waits inside the stream while the other
    ranks wait in its collectives under the sync's bounds. An engine process loads between two
    requests (rollout/engine_process.py): its sync never waits. Decided from the config, so every
    rank agrees."""
    dp_rank_of: list[int] | None = None
    """Every global rank's data-parallel rank (``replica_ranks``), gathered on first use."""
    received_bytes: int = 0
    """Bytes of completions (``pack``'s tensors, whole or headers) this rank has received from other
    engines' ranks in ``collect``: a running count, read as a difference (the partial rollouts' trace)."""

    @property
    def engine(self) -> RolloutEngine | None:
        """This rank's engine, or None."""
        return self.parts.engine

    @property
    def member(self) -> WeightSink | None:
        return self.parts.member

    @classmethod
    def build(
        cls,
        spec: EngineSpec,
        hf: Mapping[str, Any],
        ps: ParallelState,
        tokenizer: PreTrainedTokenizerBase | None = None,
        placement: RolloutPlacement | None = None,
        resync: Resync | None = None,
        engine: RolloutEngine | None = None,
    ) -> RolloutFleet:
        """Collective: create this rank's engine (if any) where ``placement`` puts it (None: decided
        here, ``rollout/placement.py``), the engines' process groups, the weight sync and the engine
        recovery. ``resync``: what a restarted engine is given (None: no engine is restarted);
        ``engine``: this rank's engine, made by the caller (the policy engine of
        ``rollout.true_on_policy``, which the job builds over its policy: rollout/policy_engine.py)."""
        member, error = None, None
        # The placement is a pure function of the config and the launch: every rank decides alike.
        placement = placement or runtime_placement(spec, ps, hf)
        try:
            engine = engine or make_engine(spec, hf, ps, tokenizer, placement)
            member = make_sync_member(spec, ps, placement) if engine is None else None
        except Exception as exc:  # reported on every rank by _agree, so no rank hangs
            error = describe(exc)
        _agree(error, f"building the {spec.rollout.engine} rollout engines")
        sink: WeightSink | None = engine if engine is not None else member
        flags: list[Any] = [None] * ps.world_size
        dist.all_gather_object(
            flags, (engine is not None, sink.sync_group_ranks if sink is not None else None)
        )
        engine_ranks = [rank for rank, (has, _) in enumerate(flags) if has]
        sync_ranks = [rank for rank, (_, ranks) in enumerate(flags) if ranks is not None]
        bind_sync_groups(sink, [ranks for _, ranks in flags], ps)
        if not engine_ranks:
            raise RuntimeError(
                f"rollout.engine={spec.rollout.engine} with placement {spec.rollout.placement} put no engine "
                "on any rank"
            )
        if placement.engines and engine_ranks != placement.leaders():
            raise RuntimeError(
                f"engines started on ranks {engine_ranks[:8]}, the placement planned {placement.leaders()[:8]}"
            )
        # every rank calls new_group, engine or not
        group = dist.new_group(engine_ranks, timeout=ps.timeout, group_desc="ROLLOUT_ENGINES")
        data = DataGroup(ps)
        engine_groups = {rank: tuple(flags[rank][1]) for rank in engine_ranks if flags[rank][1]}

        def resync_from(source: Resync) -> Callable[[int, list[int]], None]:
            def resync(version: int, ranks: list[int]) -> None:  # restarted engines' sinks only
                with source.visit():
                    weights.run(source.model, version, targets=ranks)

            return resync

        parts = EngineParts(engine, member)
        recovery = EngineRecovery(
            spec.rollout.recovery.max_restarts,
            ps.rank,
            engine_ranks,
            engine_groups,
            parts,
            data.gather,
            resync=resync_from(resync) if resync is not None else None,
            starting=resync.starting if resync is not None else nullcontext,
        )
        weights = WeightSync(
            ps,
            hf,
            parts,
            sync_ranks,
            every_round=len(sync_ranks) > len(engine_ranks),
            recovery=recovery,
            export_dtype=DTYPES[spec.model.dtype],
            bucket_bytes=spec.rollout.sync_bucket_mb << 20,
            rounds_in_flight=spec.rollout.sync_rounds_in_flight,
            quantize=engine_fp8(spec.rollout.weight_dtype == "fp8", hf),  # what the engines hold in FP8
        )
        return cls(
            ps=ps,
            hf=hf,
            parts=parts,
            engine_ranks=engine_ranks,
            group=group,
            weights=weights,
            recovery=recovery,
            data=data,
            placement=placement,
            routes=spec.record_routes,
            sync_waits_for_generation=spec.rollout.engine == "sglang",
        )

    @classmethod
    def without_engines(cls, ps: ParallelState, hf: Mapping[str, Any]) -> RolloutFleet:
        """A fleet of no engines (a replay, rollout.replay_dir: the sync and eval phases do nothing)."""
        data, parts = DataGroup(ps), EngineParts()
        recovery = EngineRecovery(0, ps.rank, [], {}, parts, data.gather)
        weights = WeightSync(
            ps,
            hf,
            parts,
            [],
            every_round=False,
            recovery=recovery,
            export_dtype=torch.float32,
            bucket_bytes=0,
        )
        return cls(
            ps=ps,
            hf=hf,
            parts=parts,
            engine_ranks=[],
            group=None,
            weights=weights,
            recovery=recovery,
            data=data,
        )

    @property
    def num_engines(self) -> int:
        return len(self.engine_ranks)

    # ------------------------------------------------------------------------------- generation

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, payload: Payload = "everywhere"
    ) -> list[list[Completion]]:
        """Collective: ``params.n`` completions per prompt, in prompt order, on every rank.

        Tokens, logprobs, loss masks and weight versions of every completion reach every rank (the
        reward on rank 0, advantages and the data-parallel split everywhere use them) as one int64
        and one float64 tensor per engine, broadcast over ``data`` (host memory): per rank, the
        whole batch's tokens at 16 bytes each plus 72 bytes per completion, whatever the world size;
        nothing is pickled. Routed experts never travel here: ``Completion.routed_experts`` is None
        on every rank. With ``params.routes`` (routing replay needs the engine's routes) each
        completion gets a ``route_id`` and its engine's rank keeps the routes until
        ``deliver_routes``; without, the engines are not asked for any.

        ``payload`` (``rollout/results.py``): "everywhere" as above; "collector": every completion
        whole on global rank 0 only (it scores and logs them), the others get each one's header
        (``Completion.sizes``, finish, version: 72 bytes); "owners": as "collector", and each
        completion gets a ``payload_id`` under which its engine's rank keeps it until
        ``deliver_completions`` sends it to the data-parallel replica that trains it; "engines": whole on
        its engine's rank only (``prompt_ranks``), headers everywhere else (the partial rollouts'
        segments). Lost engines are restarted (``collect``)."""
        return self.collect(self.submit(prompts, params), payload=payload)

    def prompt_ranks(self, num_prompts: int) -> list[int]:
        """The global rank of the engine that generates each of a request's ``num_prompts`` prompts
        (``submit``'s split: contiguous slices in engine order) and, after ``collect`` with
        ``payload="engines"``, holds its completions."""
        slices = prompt_slices(num_prompts, self.num_engines)
        return [
            rank
            for rank, (start, end) in zip(self.engine_ranks, slices, strict=True)
            for _ in range(start, end)
        ]

    def interrupt(self) -> None:
        """Cut this rank's engine's generation short, from another thread (a preemption signal: the
        batch will be dropped); every rank still takes part in the results' exchange, with shorter
        completions (the embedded engine's and SGLang's ``interrupt``; engine processes have none and
        finish what they run)."""
        interrupt = getattr(self.engine, "interrupt", None)
        if interrupt is not None:
            interrupt()

    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> PendingRollout:
        """Start generating this rank's share (``RolloutEngine.submit``: an engine process returns at
        once); ``collect`` (collective) gives the completions, or raises on every rank if any rank's
        share failed, here or while it ran."""
        params.budgets(len(prompts))  # misfit per-prompt limits are refused on every rank alike
        pending = PendingRollout(len(prompts), params.n, params.routes)
        if self.engine is not None:
            index = self.engine_ranks.index(self.ps.rank)
            start, end = prompt_slices(len(prompts), self.num_engines)[index]
            seeded = params.sliced(start, end)  # each prompt keeps its own limit (max_new_tokens_each)
            seeded = seeded if params.seed is None else dataclasses.replace(seeded, seed=params.seed + index)
            pending.share = ([list(p) for p in prompts[start:end]], seeded)
            self._start_share(pending)
        return pending

    def _start_share(self, pending: PendingRollout) -> None:
        """Submit this rank's share to its engine (again, after a restart)."""
        assert self.engine is not None and pending.share is not None
        prompts, seeded = pending.share
        pending.life, pending.lost, pending.error = self.engine.life, None, None
        try:
            pending.local = (
                self.engine.submit(prompts, seeded) if prompts or self.engine.collective else lambda: []
            )
        except EngineLost as exc:
            pending.lost = exc
        except Exception as exc:
            pending.error = describe(exc)

    def _local_share(
        self, pending: PendingRollout
    ) -> tuple[list[list[Completion]], str | None, EngineLost | None]:
        """This rank's completions, or why not: (completions, error, lost engine)."""
        if self.engine is None or pending.share is None:
            return [], pending.error, None
        if pending.done is not None:
            return pending.done, None, None
        if pending.life != self.engine.life:  # submitted to the engine before its restart
            self._start_share(pending)
        if pending.error is not None or pending.lost is not None:
            return [], pending.error, pending.lost
        assert pending.local is not None
        try:
            pending.done = pending.local()
            return pending.done, None, None
        except EngineLost as exc:
            return [], None, exc
        except Exception as exc:
            return [], describe(exc), None

    def collect(self, pending: PendingRollout, *, payload: Payload = "everywhere") -> list[list[Completion]]:
        """Collective: the completions of ``submit``, in prompt order, on every rank (each stamped
        with the weight version that sampled it), as ``generate`` returns them. Engines lost on the
        way are restarted and their shares generated again while the bound allows
        (``EngineRecovery.recover``); else every rank raises, naming them."""
        while True:
            local, error, lost = self._local_share(pending)
            flat = [c for group in local for c in group]
            failed = error is not None or lost is not None
            exchanged = self._exchange(flat, failed=failed, payload=payload)
            if exchanged is not None:
                break
            self.recover(error, lost, "rollout generate")  # raises unless every failure was a loss
        out: list[list[Completion]] = []
        slices = prompt_slices(pending.num_prompts, self.num_engines)
        for i, (rank, completions) in enumerate(zip(self.engine_ranks, exchanged, strict=True)):
            start, end = slices[i]
            if len(completions) != (end - start) * pending.n:
                raise RuntimeError(
                    f"rollout generate: engine {i} returned {len(completions)} completions for "
                    f"{end - start} prompts x n={pending.n}"
                )
            for c, (shape, mine), header in completions:
                if pending.routes and shape is not None:
                    c.route_id = self.held_routes.add(rank, shape, mine)
                if payload == "owners":
                    c.payload_id = self.held_completions.add(
                        rank, header, c if rank == self.ps.rank else None
                    )
            out += [
                [c for c, _, _ in completions[k : k + pending.n]]
                for k in range(0, len(completions), pending.n)
            ]
        if len(out) != pending.num_prompts:
            raise RuntimeError(f"rollout generate: {len(out)} results for {pending.num_prompts} prompts")
        return out

    def recover(self, error: str | None, lost: EngineLost | None, what: str) -> None:
        """Collective, after a step that failed somewhere: ``EngineRecovery.recover`` with the version
        last synced (what a restarted engine is given)."""
        self.recovery.recover(error, lost, what, version=self.weights.synced_version)

    def _exchange(
        self, flat: list[Completion], *, failed: bool = False, payload: Payload = "everywhere"
    ) -> list[list[tuple[Completion, tuple[Any, torch.Tensor | None], list[int]]]] | None:
        """Collective: every engine's completions (``flat`` on an engine rank), per engine, each with
        its routes' (shape, dtype) and, on its own engine's rank, its routes, and its header row;
        whole or header only as ``payload`` puts them (``results.exchange_engine``). None on every
        rank if any rank is ``failed`` (the sizes every rank sends first carry the flag: no extra
        collective)."""
        group = self.data.group()
        mine = pack(flat)
        sizes = [torch.zeros(4, dtype=torch.int64) for _ in range(self.ps.world_size)]
        dist.all_gather(sizes, sizes_of(*mine, len(flat), failed=failed), group=group)
        if any(int(s[3]) for s in sizes):
            return None
        per_engine = []
        for rank in self.engine_ranks:
            own = mine if rank == self.ps.rank else None
            self.received_bytes += (
                0 if own is not None else received_numel(sizes[rank].tolist(), payload, self.ps.rank) * 8
            )
            completions, shapes, headers = exchange_engine(
                own, sizes[rank].tolist(), src=rank, rank=self.ps.rank, payload=payload, group=group
            )
            routes = [c.routed_experts for c in flat] if rank == self.ps.rank else [None] * len(completions)
            per_engine.append(list(zip(completions, zip(shapes, routes, strict=True), headers, strict=True)))
        return per_engine

    def deliver_routes(
        self, owners: Mapping[int, Sequence[int]], release: Iterable[int] | None = None
    ) -> dict[int, torch.Tensor]:
        """Collective: the routes of completions generated with ``SamplingParams.routes`` to the ranks that need
        them. ``owners`` (the same on every rank): ``Completion.route_id`` -> global ranks. Returns
        this rank's routes by route id: per rank, only the routes of the samples it was named for
        (its data-parallel share), sent from the engine's rank over ``data``. Afterwards the
        held routes ``release`` names are dropped; None: every held route (the asynchronous loop
        releases only its iteration's: later batches' routes stay held)."""
        return self.held_routes.deliver(owners, self.ps.rank, self.data.group(), release)

    def deliver_completions(
        self, owners: Mapping[int, Sequence[int]], release: Iterable[int] | None = None
    ) -> dict[int, Completion]:
        """Collective: the completions of ``generate(payload="owners")`` to the ranks that train them.
        ``owners`` (the same on every rank): ``Completion.payload_id`` -> global ranks. Returns the
        completions this rank received, by payload id: per rank only those of the samples it was
        named for (its data-parallel replica's), sent from the engine's rank over ``data``
        (global rank 0 and the engine's own rank have them already). Afterwards the held ones
        ``release`` names are dropped; None: every held one."""
        return self.held_completions.deliver(owners, self.ps.rank, self.data.group(), release)

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """Collective on first use: the global ranks of data-parallel replica ``dp_rank`` (its TP,
        PP, CP and EP ranks: every one runs the replica's samples)."""
        if self.dp_rank_of is None:
            ranks = [torch.zeros(1, dtype=torch.int64) for _ in range(self.ps.world_size)]
            dist.all_gather(ranks, torch.tensor([self.ps.dp_rank]), group=self.data.group())
            self.dp_rank_of = [int(r) for r in ranks]
        return [rank for rank, d in enumerate(self.dp_rank_of) if d == dp_rank]

    # ------------------------------------------------------------------------------ weight sync

    def sync_weights(
        self,
        model: torch.nn.Module,
        version: int,
        *,
        bucket_bytes: int | None = None,
        targets: Sequence[int] | None = None,
    ) -> dict[str, float]:
        """Collective: stream the trainer's weights into every engine as ``version``, all engines fed
        at once, each from the ranks holding its slices, all or nothing (``WeightSync.run``); engines
        found lost on the way are restarted (``EngineRecovery``). Returns ``sync/*`` metrics."""
        return self.weights.run(model, version, bucket_bytes=bucket_bytes, targets=targets)

    # -------------------------------------------------------------------------- mismatch probe

    def score(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> tuple[list[list[float]] | None, list[torch.Tensor] | None]:
        """Collective: this rank's engine's teacher-forced logprobs of each sequence's tokens after its
        prompt (the mismatch probe, training/phases/sync.py; None on ranks without an engine), and on
        every rank the first engine's routed experts of each sequence (``Completion.routed_experts``
        layout; None for a dense model). An engine that fails makes every rank raise with its message;
        engines lost on the way are restarted and every engine scores again while the bound allows
        (``EngineRecovery.recover``)."""
        while True:
            scored, routes, error, lost = None, None, None, None
            if self.engine is not None:
                try:
                    scored, routes = self.engine.score_with_routes(sequences, prompt_lens, temperature)
                except EngineLost as exc:
                    lost = exc
                except Exception as exc:
                    error = describe(exc)
            failed = torch.tensor([int(error is not None or lost is not None)], dtype=torch.int64)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.data.group())
            if not failed.item():
                break
            self.recover(error, lost, "mismatch probe")  # raises unless every failure was a loss
        box = [routes if self.ps.rank == self.engine_ranks[0] else None]
        dist.broadcast_object_list(box, src=self.engine_ranks[0])
        return scored, box[0]

    # ---------------------------------------------------------------------------------- memory

    def release_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        if self.engine is not None:
            self.engine.release_memory(tags)

    def resume_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        if self.engine is not None:
            self.engine.resume_memory(tags)

    def shutdown(self, *, together: bool = False) -> None:
        """Stop this rank's engine, and its part of a multi-node SGLang engine if it started one.

        ``together``: every rank calls this at the same point of a run that ends in order (its end,
        or a preemption's safe point). Each rank first stops treating its engine processes' deaths as
        fatal (``EngineProcesses.stopping``), and no part stops before every rank has (a barrier over
        the data group): the parts of a multi-node engine fail with whichever stops first, and each
        failing scheduler SIGQUITs its own rank (seen: a two-node engine's first rank exited
        ``EXIT_ENGINE_DIED`` while it closed its loggers, its peer having stopped its part)."""
        if together:
            for part in (self.engine, self.member):
                if part is not None:
                    part.stop_watching()
            dist.barrier(group=self.data.group())
        if self.parts.engine is not None:
            self.parts.engine.shutdown()
            self.parts.engine = None
        if self.parts.member is not None:
            self.parts.member.shutdown()  # a multi-node SGLang engine's part on this node, if it started one
            self.parts.member = None
