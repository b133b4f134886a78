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
``sync_weights`` runs the bridge's streaming export with every engine GPU as a destination
(``sync_ranks``: an embedded engine's rank, and every GPU of a colocated SGLang engine, whose
non-leader GPUs hold a ``member`` that loads their share): each receives what its engine rank
loads (``WeightSink.weight_needs``; an SGLang EP rank only its experts) straight from the trainer
ranks holding it (its own first, then its node's, the load spread over every copy), all at once,
round by round. Two
phases: every engine first checks the plan's manifest (every HF name, shape and dtype it will
receive: each rejection is decidable before a byte moves) and the ranks agree; only if all accept
do the bytes move, straight into the engines' live weights (no staged version). If any engine
rejects, nobody transfers, every engine keeps its previous version and every rank raises with the
engines' messages. A failure during the transfer leaves that engine's weights partial
(``weight_version`` -1) and every rank raises: see ``RolloutFleet.sync_weights``.

Engines lost during a rollout (issue 41; an engine process, ``EngineLost``: exited, stopped or silent
past ``rollout.engine_health_timeout_s``) are restarted in place when ``collect`` is given an
``EngineRecovery`` (the job's, with ``rollout.max_engine_restarts`` > 0): the ranks agree which engines
were lost (over the exchange every ``collect`` does anyway: nothing extra while all is well), each
owner restarts its engine from the same spec, every rank streams the version last synced
(``synced_version``, from the recovery's policy model, which holds it whenever a rollout is
collected) into the restarted engines only (every GPU of one: its leader and its members, which
hold nothing the restart invalidates), and each restarted engine's share of the batch (the
same prompts and per-engine seed) is submitted again and collected; live engines' results are kept.
Past the bound every rank raises, naming each lost engine, its rank, host, why and its log's tail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from grpo_megatron.rollout.engine import (
    Completion,
    EngineLost,
    EngineSpec,
    MemoryTag,
    RolloutEngine,
    SamplingParams,
    WeightSink,
)
from grpo_megatron.rollout.placement import RolloutPlacement, runtime_placement
from grpo_megatron.rollout.results import (
    HeldCompletions,
    HeldRoutes,
    Payload,
    exchange_engine,
    pack,
    sizes_of,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from grpo_megatron.bridge.export_plan import ExportPlan, TransferStats
    from grpo_megatron.distributed.bootstrap import ParallelState

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _any_rank(flag: bool, ps: ParallelState) -> bool:
    """Collective: whether ``flag`` is set on any rank (one small all-reduce, on the trainer's device)."""
    flag_t = torch.tensor([int(flag)], dtype=torch.int64, device=ps.device)
    dist.all_reduce(flag_t, op=dist.ReduceOp.MAX)
    return bool(flag_t.item())


def _indented(text: str) -> str:
    """``text``'s lines, each indented by four spaces (an engine's log tail in a message)."""
    return "\n".join(f"    {line}" for line in text.splitlines())


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def make_engine(
    spec: EngineSpec,
    hf: Mapping[str, Any],
    ps: ParallelState,
    tokenizer: PreTrainedTokenizerBase | None = None,
    placement: RolloutPlacement | None = None,
) -> RolloutEngine | None:
    """This rank's engine where ``placement`` puts it (rollout/placement.py; None: decided here from
    the spec), or None if it hosts none."""
    rollout = spec.rollout
    placement = placement or runtime_placement(spec, ps, hf)
    if rollout.engine == "sglang":
        try:
            from grpo_megatron.rollout.sglang import engine as sglang_engine
        except ImportError as exc:
            raise RuntimeError(
                f"rollout.engine=sglang: the SGLang adapter grpo_megatron.rollout.sglang.engine cannot be "
                f"imported ({exc}); use rollout.engine=embedded, or install SGLang on a CUDA machine "
                "(pip install --no-deps -r requirements/gpu.txt: docs/getting-started/gpu.md)"
            ) from exc
        return sglang_engine.SGLangEngine.from_config(spec, ps, placement)
    if ps.rank not in placement.leaders():
        return None
    if rollout.embedded_process:
        from grpo_megatron.rollout.engine_process import EngineProcess

        return EngineProcess(
            hf,
            dtype=_DTYPES[spec.model.dtype],
            max_batch_rows=rollout.embedded_max_batch_rows,
            threads=rollout.embedded_process_threads,
            record_routes=spec.record_routes,
            rank=ps.rank,
            health_timeout_s=rollout.engine_health_timeout_s,
            log_path=spec.log_dir / f"engine-process-rank{ps.rank}.log" if spec.log_dir else None,
        )
    from grpo_megatron.rollout.embedded import EmbeddedEngine

    device = ps.device if rollout.engine_device == "auto" else torch.device("cpu")
    return EmbeddedEngine(
        hf,
        device=device,
        dtype=_DTYPES[spec.model.dtype],
        tokenizer=tokenizer,
        max_batch_rows=rollout.embedded_max_batch_rows,
        record_routes=spec.record_routes,
    )


def make_sync_member(spec: EngineSpec, ps: ParallelState, placement: RolloutPlacement) -> WeightSink | None:
    """What loads this rank's share of the weights when an engine on another rank (a colocated
    SGLang engine's leader) uses this rank's GPU too; None elsewhere."""
    if not placement.colocated_sglang or placement.gpus_per_engine == 1:
        return None
    from grpo_megatron.rollout.sglang.member import SGLangSyncMember

    return SGLangSyncMember.from_config(spec, ps, placement)


def sync_groups(members: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The distinct multi-rank weight-sync groups among every rank's ``sync_group_ranks``, in a
    fixed order (every rank creates them in it)."""
    return sorted({tuple(sorted(m)) for m in members if len(m) > 1})


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
    """``RolloutFleet.engine_life`` when the share was submitted: an older one is submitted again."""
    lost: EngineLost | None = None
    """The engine was found lost when the share was submitted."""
    done: list[list[Completion]] | None = None
    """This rank's completions once collected (kept while a lost engine elsewhere is redone)."""


@dataclasses.dataclass
class EngineRecovery:
    """What restarting lost engines in place needs (``RolloutFleet.collect``), built by the job: the
    policy ``model`` whose weights the fleet synced last (streamed into a restarted engine as
    ``synced_version``) and the bound ``max_restarts`` (rollout.max_engine_restarts, per run: per
    launch of the job). Counts the restarts and keeps each restart event's wall seconds until
    ``metrics`` takes them."""

    model: torch.nn.Module
    max_restarts: int
    sync_visit: Callable[[], AbstractContextManager[Any]] | None = None
    """A context inside which ``model``'s parameters are on the device for the resync (the job's
    ``ColocatedMemory.sync_visit``: a colocated rollout phase has them offloaded); None: they always are."""
    restarts: int = 0
    """Engines restarted so far in this run (the bound counts them)."""
    unreported: int = 0
    """Engines restarted since the last ``metrics``."""
    seconds: list[float] = dataclasses.field(default_factory=list)
    """Wall seconds of each restart event not yet reported: from the ranks' agreement that engines
    were lost to every one of them serving again (engines lost together restart at once: one event)."""
    depth: int = 0
    """Restarts in progress on this rank (one found inside another's resync belongs to its wall time)."""

    def metrics(self) -> dict[str, float]:
        """``engine/restarts`` (engines restarted since the last call) and ``engine/restart_s`` (the
        wall seconds of their restart events, summed: two engines restarted at once count once);
        empty when there was none."""
        if not self.unreported:
            return {}
        out = {"engine/restarts": float(self.unreported), "engine/restart_s": sum(self.seconds)}
        self.unreported, self.seconds = 0, []
        return out


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
    rounds_in_flight: int = 2
    """Weight-sync transfer rounds posted ahead (``rollout.sync_rounds_in_flight``)."""
    export_plan: ExportPlan | None = None
    """The export stream's plan, made at the first sync and reused while the model and bucket size
    stay the same (the metadata exchange it saves grows with the world size)."""
    planned_for: tuple[int, int] | None = None
    """(id of the model, bucket bytes) ``export_plan`` was made for."""
    manifest: list[tuple[str, tuple[int, ...], torch.dtype]] = dataclasses.field(default_factory=list)
    """``export_plan``'s manifest for this rank: every (HF name, shape, dtype) it receives per sync."""
    member: WeightSink | None = None
    """On a GPU of an engine led from another rank (a colocated SGLang engine's other GPUs): what
    loads this GPU's share of the weights (``make_sync_member``); else None."""
    placement: RolloutPlacement | None = None
    """Where the engines run and what each phase keeps on the device (rollout/placement.py)."""
    sync_ranks: list[int] = dataclasses.field(default_factory=list)
    """Destinations of the weight sync: every rank with a ``sink`` (every GPU of every engine), in
    rank order; defaults to ``engine_ranks``. Generation still goes through ``engine_ranks`` only."""

    data_group: Any = None
    """Host-side (gloo) group of every rank that rollout results travel over (``generate``,
    ``deliver_routes``); None: made at the first ``generate`` (collective, every rank calls it)."""
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
    synced_version: int = -1
    """The version of the last weight sync that reached every engine (what a restarted one is given)."""
    engine_life: int = 0
    """How often this rank's engine was restarted (a share submitted in an earlier life goes again)."""
    engine_groups: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Every rank of each engine led from a rank (its ``sync_group_ranks``: a colocated SGLang engine
    of several GPUs, its leader first), by leader rank; an engine absent here is its rank alone."""

    def __post_init__(self) -> None:
        if not self.sync_ranks:
            self.sync_ranks = list(self.engine_ranks)

    @property
    def sink(self) -> WeightSink | None:
        """What this rank's weight sync feeds: its engine, else its ``member``, else None."""
        return self.engine if self.engine is not None else self.member

    @classmethod
    def build(
        cls,
        spec: EngineSpec,
        hf: Mapping[str, Any],
        ps: ParallelState,
        tokenizer: PreTrainedTokenizerBase | None = None,
        placement: RolloutPlacement | None = None,
        engine: RolloutEngine | None = None,
    ) -> RolloutFleet:
        """Collective: create this rank's engine (if any) where ``placement`` puts it (None: decided
        here, ``rollout/placement.py``) and the engines' process group. ``engine``: this rank's engine,
        made by the caller (the policy engine of ``rollout.true_on_policy``, which the job builds over
        its policy: rollout/policy_engine.py)."""
        member, error = None, None
        # The placement is a pure function of the config and the launch: every rank decides alike.
        placement = placement or runtime_placement(spec, ps, hf)
        try:
            engine = engine or make_engine(spec, hf, ps, tokenizer, placement)
            member = make_sync_member(spec, ps, placement) if engine is None else None
        except Exception as exc:  # reported on every rank by _agree, so no rank hangs
            error = _describe(exc)
        _agree(error, f"building the {spec.rollout.engine} rollout engines")
        sink: WeightSink | None = engine if engine is not None else member
        flags: list[Any] = [None] * ps.world_size
        dist.all_gather_object(
            flags, (engine is not None, sink.sync_group_ranks if sink is not None else None)
        )
        engine_ranks = [rank for rank, (has, _) in enumerate(flags) if has]
        sync_ranks = [rank for rank, (_, ranks) in enumerate(flags) if ranks is not None]
        # The GPUs of one engine hand their payloads to its leader over a group of their own; every
        # rank creates every such group (new_group is collective), in the same order. gloo: they
        # carry only small objects.
        for ranks in sync_groups([r for _, r in flags if r is not None]):
            group_of = dist.new_group(
                list(ranks), backend="gloo", timeout=ps.timeout, group_desc="ENGINE_SYNC"
            )
            if sink is not None and ps.rank in ranks:
                sink.bind_sync_group(group_of)
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
        return cls(
            ps=ps,
            hf=hf,
            engine=engine,
            engine_ranks=engine_ranks,
            group=group,
            export_dtype=_DTYPES[spec.model.dtype],
            bucket_bytes=spec.rollout.sync_bucket_mb << 20,
            rounds_in_flight=spec.rollout.sync_rounds_in_flight,
            member=member,
            sync_ranks=sync_ranks,
            placement=placement,
            routes=spec.record_routes,
            sync_waits_for_generation=spec.rollout.engine == "sglang",
            engine_groups={rank: tuple(flags[rank][1]) for rank in engine_ranks if flags[rank][1]},
        )

    @property
    def num_engines(self) -> int:
        return len(self.engine_ranks)

    # ------------------------------------------------------------------------------- generation

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        payload: Payload = "everywhere",
        recovery: EngineRecovery | None = None,
    ) -> list[list[Completion]]:
        """Collective: ``params.n`` completions per prompt, in prompt order, on every rank.

        Tokens, logprobs, loss masks and weight versions of every completion reach every rank (the
        reward on rank 0, advantages and the data-parallel split everywhere use them) as one int64
        and one float64 tensor per engine, broadcast over ``data_group`` (host memory): per rank, the
        whole batch's tokens at 16 bytes each plus 72 bytes per completion, whatever the world size;
        nothing is pickled. Routed experts never travel here: ``Completion.routed_experts`` is None
        on every rank. With ``params.routes`` (routing replay needs the engine's routes) each
        completion gets a ``route_id`` and its engine's rank keeps the routes until
        ``deliver_routes``; without, the engines are not asked for any.

        ``payload`` (``rollout/results.py``): "everywhere" as above; "collector": every completion
        whole on global rank 0 only (it scores and logs them), the others get each one's header
        (``Completion.sizes``, finish, version: 72 bytes); "owners": as "collector", and each
        completion gets a ``payload_id`` under which its engine's rank keeps it until
        ``deliver_completions`` sends it to the data-parallel replica that trains it. ``recovery``:
        lost engines are restarted (``collect``)."""
        return self.collect(self.submit(prompts, params), payload=payload, recovery=recovery)

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
        pending.life, pending.lost, pending.error = self.engine_life, None, None
        try:
            pending.local = (
                self.engine.submit(prompts, seeded) if prompts or self.engine.collective else lambda: []
            )
        except EngineLost as exc:
            pending.lost = exc
        except Exception as exc:
            pending.error = _describe(exc)

    def _local_share(
        self, pending: PendingRollout
    ) -> tuple[list[list[Completion]], str | None, EngineLost | None]:
        """This rank's completions, or why not: (completions, error, lost engine)."""
        if self.engine is None or pending.share is None:
            return [], pending.error, None
        if pending.done is not None:
            return pending.done, None, None
        if pending.life != self.engine_life:  # submitted to the engine before its restart
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
            return [], _describe(exc), None

    def collect(
        self,
        pending: PendingRollout,
        *,
        payload: Payload = "everywhere",
        recovery: EngineRecovery | None = None,
    ) -> list[list[Completion]]:
        """Collective: the completions of ``submit``, in prompt order, on every rank (each stamped
        with the weight version that sampled it), as ``generate`` returns them. Engines lost on the
        way are restarted and their shares generated again while ``recovery`` allows (``recover``);
        else every rank raises, naming them."""
        while True:
            local, error, lost = self._local_share(pending)
            flat = [c for group in local for c in group]
            failed = error is not None or lost is not None
            exchanged = self._exchange(flat, failed=failed, payload=payload)
            if exchanged is not None:
                break
            self.recover(error, lost, recovery, "rollout generate")  # raises unless every failure was a loss
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

    def recover(
        self,
        error: str | None,
        lost: EngineLost | None,
        recovery: EngineRecovery | None,
        what: str,
        *,
        version: int | None = None,
        resync: bool = True,
    ) -> None:
        """Collective, after a step that failed somewhere: the ranks agree on every rank's ``error``
        and ``lost`` engine. Any error, or a loss without ``recovery`` or past its bound: every rank
        raises with them (lost engines named with rank, host, why and their log's tail). Else the lost
        engines are restarted and (``resync``) given ``version`` (None: ``synced_version``,
        ``restart_engines``). The error of another GPU of a lost engine (its weight round failed with
        the engine) is the loss's, not one of its own."""
        lost = lost or self._member_loss()
        mine = (
            None
            if lost is None
            else {"host": lost.host, "why": lost.why, "tail": lost.log_tail, "log": lost.log_path}
        )
        reports: list[Any] = [None] * self.ps.world_size
        dist.all_gather_object(reports, (error, mine), group=self._data_group())  # every rank is here
        losses = {rank: info for rank, (_, info) in enumerate(reports) if info is not None}
        lost_engines = sorted(
            {self._leader_of(rank) for rank in losses}
        )  # a further node's part: its engine's
        with_lost = set(self._engine_ranks_of(lost_engines))
        errors = [(rank, e) for rank, (e, _) in enumerate(reports) if e is not None and rank not in with_lost]
        named = "\n".join(
            f"  engine {self.engine_ranks.index(self._leader_of(rank))} (rank {rank} on {info['host']}) was lost: "
            f"{info['why']}; its log ({info['log']}) ends:\n{_indented(info['tail'])}"
            for rank, info in losses.items()
        )
        if errors or not losses:
            lines = "\n".join(f"  rank {rank}: {e}" for rank, e in errors[:8])
            raise RuntimeError(
                f"{what} failed on {len(errors) + len(losses)} rank(s):\n{lines}\n{named}".rstrip()
            )
        if recovery is None or recovery.restarts + len(lost_engines) > recovery.max_restarts:
            bound = 0 if recovery is None else recovery.max_restarts
            done = 0 if recovery is None else recovery.restarts
            raise RuntimeError(
                f"{what}: {len(lost_engines)} engine(s) lost, past rollout.max_engine_restarts={bound} ({done} "
                f"restart(s) so far); resume from the last checkpoint (or raise the bound):\n{named}"
            )
        version = self.synced_version if version is None else version
        seconds = self.restart_engines(lost_engines, recovery, version, resync=resync)
        if self.ps.rank == 0:
            for rank, info in losses.items():
                print(
                    f"[engine] engine {self.engine_ranks.index(self._leader_of(rank))} (rank {rank} on "
                    f"{info['host']}) lost during {what}: {info['why']}; restarted for weights version {version} "
                    f"in {seconds:.1f} s (restart {recovery.restarts} of at most {recovery.max_restarts}); its "
                    f"log ended:\n{_indented(info['tail'])}",
                    flush=True,
                )

    def _member_loss(self) -> EngineLost | None:
        """This rank's part of an engine led from another rank, lost (a further node's part of an
        SGLang engine across nodes: ``SGLangSyncMember.check_alive``); None when alive or none."""
        check = getattr(self.member, "check_alive", None)
        try:
            if check is not None:
                check()
        except EngineLost as exc:
            return exc
        except Exception:  # not recoverable (no restarts): the failure that brought us here is reported
            pass
        return None

    def _engine_ranks_of(self, leaders: Iterable[int]) -> list[int]:
        """Every rank of the engines led from ``leaders`` (an engine of several GPUs: its leader and
        its members, ``engine_groups``), in rank order."""
        return sorted({r for leader in leaders for r in self.engine_groups.get(leader, (leader,))})

    def _leader_of(self, rank: int) -> int:
        """The leader of the engine whose GPUs include ``rank``'s (``engine_groups``); itself elsewhere."""
        return next((leader for leader, ranks in self.engine_groups.items() if rank in ranks), rank)

    def _restart_addresses(self, leaders: Sequence[int]) -> dict[int, str | None]:
        """Collective (over the data group): where each restarting engine's parts meet again, by its
        leader (``SGLangEngine.restart_address``: an engine across nodes needs a fresh one; None
        elsewhere), so that each further node's part restarts at its leader's."""
        mine = None
        if self.ps.rank in leaders and self.engine is not None:
            fresh = getattr(self.engine, "restart_address", None)
            mine = fresh() if fresh is not None else None
        everyone: list[Any] = [None] * self.ps.world_size
        dist.all_gather_object(everyone, mine, group=self._data_group())
        return {leader: everyone[leader] for leader in leaders}

    def restart_engines(
        self, ranks: Sequence[int], recovery: EngineRecovery, version: int, *, resync: bool
    ) -> float:
        """Collective: the engines of ``ranks`` (their leaders) restart (each owner kills what is left
        and starts it again, same spec and width) and (``resync``; not when the sync that found them
        lost goes on) every rank streams ``version`` from ``recovery.model`` into them only: into
        every GPU of each (its members drop what they staged of an abandoned version first). Returns
        the wall seconds it took (kept in ``recovery`` unless it runs inside another restart)."""
        start = time.perf_counter()
        error = None
        everyone = self._engine_ranks_of(ranks)
        addresses = self._restart_addresses(ranks)
        if self.ps.rank in ranks:
            assert self.engine is not None
            try:
                restart = getattr(self.engine, "restart", None)
                if restart is None:
                    raise RuntimeError(f"{type(self.engine).__name__} cannot be restarted in place")
                restart(addresses[self.ps.rank])
                self.engine_life += 1
            except Exception as exc:
                error = _describe(exc)
        elif self.ps.rank in everyone and self.member is not None:
            try:  # a further node's part of an engine across nodes restarts with its leader (SGLangSyncMember)
                restart = getattr(self.member, "restart", None)
                if restart is not None:
                    restart(addresses[self._leader_of(self.ps.rank)])
                else:
                    self.member.abort_update(version)
            except Exception as exc:
                error = _describe(exc)
        _agree(error, "restarting the lost rollout engine(s)")
        recovery.restarts += len(ranks)
        recovery.unreported += len(ranks)
        recovery.depth += 1
        try:
            if resync:
                with recovery.sync_visit() if recovery.sync_visit is not None else contextlib.nullcontext():
                    self.sync_weights(recovery.model, version, targets=everyone, recovery=recovery)
        finally:
            recovery.depth -= 1
        seconds = time.perf_counter() - start
        if recovery.depth == 0:
            recovery.seconds.append(seconds)
        return seconds

    def _exchange(
        self, flat: list[Completion], *, failed: bool = False, payload: Payload = "everywhere"
    ) -> list[list[tuple[Completion, tuple[Any, torch.Tensor | None], list[int]]]] | None:
        """Collective: every engine's completions (``flat`` on an engine rank), per engine, each with
        its routes' (shape, dtype) and, on its own engine's rank, its routes, and its header row;
        whole or header only as ``payload`` puts them (``results.exchange_engine``). None on every
        rank if any rank is ``failed`` (the sizes every rank sends first carry the flag: no extra
        collective)."""
        group = self._data_group()
        mine = pack(flat)
        sizes = [torch.zeros(4, dtype=torch.int64) for _ in range(self.ps.world_size)]
        dist.all_gather(sizes, sizes_of(*mine, len(flat), failed=failed), group=group)
        if any(int(s[3]) for s in sizes):
            return None
        per_engine = []
        for rank in self.engine_ranks:
            own = mine if rank == self.ps.rank else None
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
        (its data-parallel share), sent from the engine's rank over ``data_group``. Afterwards the
        held routes ``release`` names are dropped; None: every held route (the asynchronous loop
        releases only its iteration's: later batches' routes stay held)."""
        return self.held_routes.deliver(owners, self.ps.rank, self._data_group(), release)

    def deliver_completions(
        self, owners: Mapping[int, Sequence[int]], release: Iterable[int] | None = None
    ) -> dict[int, Completion]:
        """Collective: the completions of ``generate(payload="owners")`` to the ranks that train them.
        ``owners`` (the same on every rank): ``Completion.payload_id`` -> global ranks. Returns the
        completions this rank received, by payload id: per rank only those of the samples it was
        named for (its data-parallel replica's), sent from the engine's rank over ``data_group``
        (global rank 0 and the engine's own rank have them already). Afterwards the held ones
        ``release`` names are dropped; None: every held one."""
        return self.held_completions.deliver(owners, self.ps.rank, self._data_group(), release)

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """Collective on first use: the global ranks of data-parallel replica ``dp_rank`` (its TP,
        PP, CP and EP ranks: every one runs the replica's samples)."""
        if self.dp_rank_of is None:
            ranks = [torch.zeros(1, dtype=torch.int64) for _ in range(self.ps.world_size)]
            dist.all_gather(ranks, torch.tensor([self.ps.dp_rank]), group=self._data_group())
            self.dp_rank_of = [int(r) for r in ranks]
        return [rank for rank, d in enumerate(self.dp_rank_of) if d == dp_rank]

    def _data_group(self) -> Any:
        if self.data_group is None:  # every rank gets here together: generate is collective
            self.data_group = dist.new_group(
                backend="gloo", timeout=self.ps.timeout, group_desc="ROLLOUT_DATA"
            )
        return self.data_group

    # ------------------------------------------------------------------------------ weight sync

    def sync_weights(
        self,
        model: torch.nn.Module,
        version: int,
        *,
        bucket_bytes: int | None = None,
        targets: Sequence[int] | None = None,
        recovery: EngineRecovery | None = None,
    ) -> dict[str, float]:
        """Collective: stream the trainer's weights into every engine as ``version``, all engines fed
        at once, each from the ranks holding its slices (``bridge/export.py``).

        Two phases. One, before any byte moves: every engine checks the plan's manifest (each HF name,
        shape and dtype it will receive, ``RolloutEngine.check_manifest``) and the ranks agree; if any
        engine rejects it, nobody transfers, every engine keeps its previous weights and version, and
        every rank raises with the engines' messages. Two: the bytes stream straight into every
        engine's live weights (borrowed views where a tensor needs no assembly: one copy per byte, no
        staged version). A failure during phase two (a broken link, an engine that fails to load what
        its manifest accepted) leaves that engine's weights partial: it reports ``weight_version``
        -1 and every rank raises, naming the engines; engines that received everything hold
        ``version``. The job cannot go on from there (resume from the last checkpoint), so nothing
        is kept to roll back to: holding a previous version would double every engine's memory.
        Returns ``sync/*`` metrics: seconds of the manifest check and of the transfer, bytes and
        buckets each engine received, the most bytes of transfer buffers any rank held, and the most
        bytes any engine received straight into its weights.

        The steps: ``_plan`` (once), ``_check_manifests`` (phase one), ``_transfer`` (phase two on
        this rank), ``_verdict`` (the ranks agree on phase two's outcome and its metrics).

        ``targets``: only the sinks of these ranks take the version (every GPU of a restarted engine,
        ``restart_engines``); the stream runs as always, the others drop what they receive.
        ``recovery``: an engine found lost (``EngineLost``) in phase one is restarted and takes part
        in this sync; one lost in phase two is restarted and sent ``version`` once more, alone (the
        others received all of it: an engine process loads a version only once it has all of it).
        """
        bucket_bytes = bucket_bytes or self.bucket_bytes
        sink = self.sink if targets is None or self.ps.rank in targets else None
        start = time.perf_counter()
        plan = self._plan(model, bucket_bytes)
        self._check_manifests(version, sink, recovery)
        check_s = time.perf_counter() - start
        start = time.perf_counter()
        outcome = self._transfer(plan, version, sink)
        totals = self._verdict(outcome, version, recovery)
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

    def _plan(self, model: torch.nn.Module, bucket_bytes: int) -> ExportPlan:
        """The export plan to every engine GPU (made at the first sync, reused while the model and the
        bucket size stay the same), and this rank's manifest."""
        from grpo_megatron.bridge.export_plan import plan_export

        if self.planned_for != (id(model), bucket_bytes) or self.export_plan is None:
            # Each destination's needs (e.g. an SGLang EP rank: dense tensors + its experts), known
            # to every rank: every rank plans every destination's sources.
            sink, dsts = self.sink, tuple(self.sync_ranks)
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
            )
            self.planned_for = (id(model), bucket_bytes)
            self.manifest = self.export_plan.manifest(self.ps.rank if sink is not None else None)
        return self.export_plan

    def _check_manifests(
        self, version: int, sink: WeightSink | None, recovery: EngineRecovery | None
    ) -> None:
        """Phase one: every engine (``sink`` on this rank) judges the manifest; the ranks agree (one
        small all-reduce; the messages are gathered only when some engine rejected). A rejection
        anywhere: every engine keeps its previous version and every rank raises. Only lost engines
        (``EngineLost``) and a ``recovery``: they restart, then judge again."""
        problems: list[str] = []
        lost: EngineLost | None = None
        if sink is not None:
            try:
                problems = sink.check_manifest(self.manifest, version)
            except EngineLost as exc:
                lost = exc
            except Exception as exc:
                problems = [_describe(exc)]
        flags = torch.tensor(
            [int(bool(problems)), int(lost is not None)], dtype=torch.int64, device=self.ps.device
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if not flags[0] and flags[1] and recovery is not None:
            self.recover(
                None, lost, recovery, f"the weight sync of version {version}", version=version, resync=False
            )
            return self._check_manifests(version, sink, recovery)
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

    def _transfer(self, plan: ExportPlan, version: int, sink: WeightSink | None) -> _Transfer:
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
        every_round = len(self.sync_ranks) > len(self.engine_ranks)  # an engine's GPUs load in step
        for bucket in ExportStream(plan, landing, stats=out.stats, every_round=every_round):
            if sink is None or out.error is not None:
                continue
            out.received += sum(t.numel() * t.element_size() for _, t in bucket)
            out.buckets += 1
            try:
                sink.update_weights(bucket, version=version, last=False)
            except Exception as exc:
                out.error, out.lost = _describe(exc), exc if isinstance(exc, EngineLost) else None
        if sink is not None and out.error is None:
            try:
                sink.update_weights([], version=version, last=True)
            except Exception as exc:
                out.error, out.lost = _describe(exc), exc if isinstance(exc, EngineLost) else None
        return out

    def _verdict(self, outcome: _Transfer, version: int, recovery: EngineRecovery | None) -> torch.Tensor:
        """One all-reduce (max) carries the verdict and the metrics (bytes and buckets: the busiest
        destination's; with per-GPU needs an engine's GPUs receive different shares): [failed,
        bytes, buckets, peak buffer bytes, in-place bytes]. A failure anywhere: every rank raises;
        with ``recovery``, lost engines only: they restart and are sent ``version`` alone."""
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
        if totals[0] and recovery is not None:
            error = None if outcome.lost is not None else outcome.error
            self.recover(
                error, outcome.lost, recovery, f"the weight sync of version {version}", version=version
            )
        elif totals[0]:
            reports: list[Any] = [None] * self.ps.world_size
            dist.all_gather_object(reports, outcome.error)
            failed = [(rank, e) for rank, e in enumerate(reports) if e is not None]
            lines = "\n".join(f"  rank {rank}: {e}" for rank, e in failed[:8])
            raise RuntimeError(
                f"weight sync of version {version} failed during the transfer on {len(failed)} engine(s); their "
                f"weights are partial (weight_version -1), resume from the last checkpoint:\n{lines}"
            )
        return totals

    # -------------------------------------------------------------------------- mismatch probe

    def score(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        temperature: float,
        *,
        recovery: EngineRecovery | None = None,
    ) -> tuple[list[list[float]] | None, list[torch.Tensor] | None]:
        """Collective: this rank's engine's teacher-forced logprobs of each sequence's tokens after its
        prompt (the mismatch probe, training/phases/sync.py; None on ranks without an engine), and on
        every rank the first engine's routed experts of each sequence (``Completion.routed_experts``
        layout; None for a dense model). An engine that fails makes every rank raise with its message;
        engines lost on the way are restarted and every engine scores again while ``recovery`` allows
        (``recover``)."""
        while True:
            scored, routes, error, lost = None, None, None, None
            if self.engine is not None:
                try:
                    scored, routes = self.engine.score_with_routes(sequences, prompt_lens, temperature)
                except EngineLost as exc:
                    lost = exc
                except Exception as exc:
                    error = _describe(exc)
            failed = torch.tensor([int(error is not None or lost is not None)], dtype=torch.int64)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self._data_group())
            if not failed.item():
                break
            self.recover(error, lost, recovery, "mismatch probe")  # raises unless every failure was a loss
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
                health = getattr(
                    part, "health", None
                )  # the SGLang parts' processes (rollout/sglang/health.py)
                if health is not None:
                    health.stopping = True
            dist.barrier(group=self._data_group())
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.member is not None:
            self.member.shutdown()  # a multi-node SGLang engine's part on this node, if it started one
            self.member = None
