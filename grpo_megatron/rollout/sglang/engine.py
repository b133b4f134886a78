"""SGLang rollout engine: a thin adapter from ``RolloutEngine`` to SGLang 0.5.x's API (0.5.17 to 0.5.23,
by capability), on GPUs, or on CPU for a CPU job (SGLang's CPU engine). This room is the engine:
generate, submit, score, weights, memory, health, restart, shutdown; the package docstring
(``rollout/sglang/__init__.py``) names the others.

Its mode (``rollout.sglang.mode``) is decided once, at launch (``launch.py:launch_servers``): the
servers (a colocated ``sglang.Engine`` on this rank, or HTTP clients of disaggregated servers) and the
weight transport that feeds them (CUDA IPC, ``ipc.py``; NCCL broadcast, ``nccl.py``); the engine itself
has no branch on it. Every call that reaches the servers goes through one ``ServerGuard``
(``watch.py``): it first waits for the one generation that may be in flight (``submit``), so a
submitted batch finishes under the weights it was submitted with whatever the next call is. The
engine's own state is named: the load protocol's (``WeightLoad.state``: serving, loading, stale) and
the memory it released (``ReleasedMemory``).

The memory order that keeps the colocated peak low is ``training/offload.py:ColocatedMemory``'s, the
same for every engine; the adapter releases and resumes only what it holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from grpo_megatron.distributed.bootstrap import free_port
from grpo_megatron.rollout.config import RolloutConfig
from grpo_megatron.rollout.engine import (
    ALL_MEMORY_TAGS,
    Bucket,
    Completion,
    EngineLost,
    EngineSpec,
    Manifest,
    MemoryTag,
    RolloutEngine,
    SamplingParams,
    stamped,
)
from grpo_megatron.rollout.faults import EngineFaults
from grpo_megatron.rollout.hf_routes import RouteLayout
from grpo_megatron.rollout.placement import RolloutPlacement, runtime_placement
from grpo_megatron.rollout.sglang import protocol
from grpo_megatron.rollout.sglang.launch import (
    EngineLaunch,
    SGLangUnavailableError,
    import_sglang,
    launch_servers,
    start_colocated,
    torch_dtype,
)
from grpo_megatron.rollout.sglang.layout import agree_engine_address, layout_of
from grpo_megatron.rollout.sglang.model_config import engine_fp8, quantized, read_hf_config
from grpo_megatron.rollout.sglang.shards import check_expert_placement, rank_needs
from grpo_megatron.rollout.sglang.watch import (
    SchedulerProbe,
    ServerGuard,
    abort_requests,
    cancel_requests,
    stop_lost_part,
)
from grpo_megatron.rollout.sglang.weights import (
    EngineTensors,
    KeptPrefixes,
    PairedLoads,
    WeightLoad,
    WeightTransport,
    checkpoint_output_head,
    checkpoint_shapes,
    engine_tensors,
    manifest_errors,
    raise_on_failure,
    tied_output_head,
    with_output_head,
)

if TYPE_CHECKING:
    import torch

    from grpo_megatron.distributed.bootstrap import ParallelState
    from grpo_megatron.rollout.sglang.health import EngineProcesses
    from grpo_megatron.rollout.sglang.shards import ExpertBlock

__all__ = ["ReleasedMemory", "SGLangEngine", "SGLangUnavailableError", "ServerGuard"]


class ReleasedMemory:
    """The memory tags an engine has released and not resumed. Only those may be resumed: SGLang's
    scheduler raises KeyError on (and then kills the process tree for) a resume of a tag it holds,
    e.g. the run's first sync resuming ``weights``."""

    def __init__(self) -> None:
        self.tags: set[str] = set()

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.tags))

    def __len__(self) -> int:
        return len(self.tags)

    def to_release(self, tags: Sequence[MemoryTag] | None) -> list[MemoryTag]:
        return [t for t in (ALL_MEMORY_TAGS if tags is None else tags) if t not in self.tags]

    def to_resume(self, tags: Sequence[MemoryTag] | None) -> list[MemoryTag]:
        return [t for t in (ALL_MEMORY_TAGS if tags is None else tags) if t in self.tags]

    def refusal(self) -> str | None:
        """Why the engine cannot generate now (None: it can)."""
        if self.tags & {"weights", "kv_cache"}:
            return (
                f"the SGLang engine has released its {sorted(self.tags)} memory (to the trainer): "
                "resume_memory before generating"
            )
        return None


class SGLangEngine(RolloutEngine):
    """``RolloutEngine`` over one colocated ``sglang.Engine`` or a set of SGLang servers.

    Build it with ``SGLangEngine.from_config(spec, ps)`` (colocated: on each group leader, ``None``
    elsewhere) or directly with an ``EngineLaunch``. ``servers`` (tests, custom launchers) replaces
    starting anything: objects with ``sglang.Engine``'s methods, used as given.

    Weight updates stream through the load protocol (``weights.py:WeightLoad``): each bucket is checked
    before it is sent; a bucket that fails the check, or a version whose last bucket leaves out names an
    earlier version carried, raises, and a partly loaded engine goes stale and refuses to generate until
    a complete version arrives.
    """

    def __init__(
        self,
        rollout: RolloutConfig,
        model_path: str,
        launch: EngineLaunch | None = None,
        *,
        servers: Sequence[Any] | None = None,
        restart_server: Callable[[str], None] | None = None,
    ):
        launch = launch or EngineLaunch()
        self.rollout, self.model_path, self._launch = rollout, str(model_path), launch
        self._rng = random.Random(launch.seed)
        self._restart_server = restart_server
        self._hf_config = {**read_hf_config(model_path), **(launch.hf_overrides or {})}
        self.tied_head = tied_output_head(self._hf_config)
        self._shapes = checkpoint_shapes(model_path)
        # Width and EP: rollout/placement.py's (from_config passes them; EngineLaunch.shape when built directly).
        # The EP decides which experts each GPU loads; server args placing experts otherwise are refused.
        self.tp_size, self.ep_size = launch.shape(rollout)
        check_expert_placement(rollout.sglang.server_args)
        launched = launch_servers(
            rollout,
            self.model_path,
            launch,
            self._hf_config,
            weights_on_disk=bool(self._shapes),
            given=servers,
        )
        self.transport: WeightTransport = launched.transport
        self.health: EngineProcesses | None = launched.health
        """The engine's processes when this adapter started them (a colocated engine), else None."""
        self._dummy = launched.dummy
        self.faults = EngineFaults(launch.rank)
        """``GRPO_ENGINE_FAULT`` (tests; rollout/faults.py): generations counted over every life."""
        moe = "num_experts_per_tok" in self._hf_config
        self._route_layout = RouteLayout.from_hf(self._hf_config) if moe and launched.routes else None
        """Where the servers report routed experts (asked per request, ``SamplingParams.routes``); None: they do not."""
        self._fresh_state()
        self.guard = self._guard(launched.servers)
        self.interrupted = False
        """Set by ``interrupt``: generations ask one token per response (a preemption's dropped batch)."""
        self.context = protocol.context_tokens(launched.servers)
        """Tokens one sequence may hold (prompt and response): each request's ``max_new_tokens`` stays
        within it (``protocol.request_budgets``); None where the servers do not say (HTTP)."""
        if launched.started:
            self.ensure_healthy()  # disaggregated servers answer before use (colocated: a no-op)
            if self.tied_head and self._shapes and not self._dummy:
                self._load_tied_head_from_disk()

    def _fresh_state(self) -> None:
        """What the adapter knows of a freshly started engine: its weights, memory and load protocol."""
        dtype = torch_dtype(self._launch.dtype)
        fp8 = engine_fp8(self.rollout.weight_dtype == "fp8", self._hf_config)
        self.held: EngineTensors = engine_tensors(
            self._shapes, self._hf_config, dtype, dummy=self._dummy, fp8=fp8
        )
        """What the engine holds per tensor (``check_manifest`` judges each sync's manifest against it)."""
        self.load = WeightLoad(self.held.shapes, f"the checkpoint at {self.model_path}")
        """The weight-load protocol's state (version, sessions, staleness)."""
        self.released = ReleasedMemory()
        self.prefixes = KeptPrefixes(self.rollout.partial.keep_kv, self._launch.max_staleness)
        """Which weight loads flush the prefix cache (``rollout.partial.keep_kv``; off: every one)."""
        self._accepted: Manifest | None = None
        self._pairs = PairedLoads()
        self.lost: EngineLost | None = None
        """The loss a memory call met (``_memory_call``), until the restart."""

    def _guard(self, servers: Sequence[Any]) -> ServerGuard:
        if self.health is None:
            return ServerGuard(servers)
        health = self.health

        def probe() -> SchedulerProbe:  # each wait's: rollout.recovery.health_timeout_s of the moment
            return SchedulerProbe(self.rollout.recovery.health_timeout_s, health.lost)

        guard = ServerGuard(servers, watch=self._watch, cancel=cancel_requests, probe=probe)
        self.health.on_lost = guard.cancel  # a call blocked on a dead scheduler ends (recoverable only)
        return guard

    @classmethod
    def from_config(
        cls, spec: EngineSpec, ps: ParallelState, placement: RolloutPlacement | None = None
    ) -> SGLangEngine | None:
        """The engine this rank drives, from the job's ``EngineSpec`` and ``ParallelState``: colocated, one per
        ``rollout.sglang.tp`` consecutive ranks (inside a node, or whole nodes: ``colocated_layout``),
        on the first of them (others get ``None``; on a multi-node engine the first rank of each
        further node starts that node's part in ``SGLangSyncMember.from_config``); disaggregated, one
        over all servers on rank 0."""
        import_sglang()
        rollout, model = spec.rollout, spec.model
        device = str(ps.device)
        if rollout.sglang.mode == "disaggregated":
            if ps.rank != 0:
                return None
            launch = EngineLaunch(
                model.dtype,
                spec.seed,
                device,
                routes=spec.record_routes,
                group_timeout=ps.timeout,
                max_staleness=spec.max_staleness,
            )
            return cls(rollout, model.hf_path, launch)
        placement = placement or runtime_placement(spec, ps, read_hf_config(model.hf_path))
        layout, gpus_per_node, local_rank = layout_of(placement, ps)
        if ps.rank != layout.leader:
            return None  # a multi-node engine's other ranks agree on its address in SGLangSyncMember
        address = agree_engine_address(layout, gpus_per_node, local_rank) if layout.multi_node else None
        launch = EngineLaunch(
            model.dtype,
            spec.seed + ps.rank,
            device,
            base_gpu_id=layout.base_gpu_id,
            tp_size=placement.gpus_per_engine,
            ep_size=placement.engine_ep,
            nnodes=layout.nnodes,
            dist_init_addr=address,
            hf_overrides=model.hf_overrides,
            rank=ps.rank,
            log_dir=spec.log_dir,
            tokenizer_path=spec.tokenizer_path,
            routes=spec.record_routes,
            max_staleness=spec.max_staleness,
        )
        engine = cls(rollout, model.hf_path, launch)
        engine.sync_group_ranks = layout.members  # every GPU of the engine receives its own share
        return engine

    @property
    def servers(self) -> list[Any]:
        """The servers, once no generation is in flight (the guard's)."""
        with self.guard as servers:
            return servers

    @property
    def weight_version(self) -> int:
        """The last complete version loaded (``WeightLoad.version``; -1: the checkpoint's weights)."""
        return self.load.version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.load.version = version

    # -- the weight sync's view of this engine's GPUs

    def weight_needs(self) -> ExpertBlock | None:
        """The leader's share (SGLang TP rank 0): every dense tensor, and with ``ep_size`` > 1 the
        experts of MoE EP rank 0 (``rollout/sglang/shards.py``); everything when it feeds alone."""
        if len(self.sync_group_ranks) <= 1:
            return None
        return rank_needs(self._hf_config, self.tp_size, self.ep_size, 0)

    def bind_sync_group(self, group: Any) -> None:
        self.transport.bind_group(self.sync_group_ranks, group)

    def check_manifest(self, manifest: Manifest, version: int) -> list[str]:
        """Every tensor the sync will send this GPU (``manifest``) against what the engine holds
        (``weights.py:manifest_errors``: name, full shape, dtype; completeness on dummy weights), before
        any byte moves. The manifest accepted last (the fleet passes the same one each sync) passes
        again without another look. Servers the transport cannot feed at all are refused
        (``WeightTransport.manifest_refusal``: disaggregated servers of a quantized checkpoint)."""
        self.check_alive()  # a lost engine raises EngineLost here: the fleet restarts it before the sync
        if manifest is self._accepted:
            return []
        refusal = self.transport.manifest_refusal(quantized(self._hf_config), self.model_path, version)
        if refusal is not None:
            return [refusal]
        errors = manifest_errors(
            manifest, self.held, self.weight_needs(), f"the checkpoint at {self.model_path}"
        )
        if errors:
            return [
                f"weight sync of version {version} refused by the SGLang engine ({len(errors)} problems): "
                + "; ".join(errors[:10])
            ]
        self._accepted = manifest
        return []

    # -- generation and scores

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        with self.guard as servers:
            self._refuse_if_unable()
            return self._generate(servers, prompts, params)

    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> Callable[[], list[list[Completion]]]:
        """Start generating and return at once (the asynchronous loop: SGLang's scheduler processes
        generate while this rank trains); calling the result waits for the completions, stamped with
        the weight version they were submitted under. One generation at a time, in submission order:
        every other call of the engine first waits for it (``ServerGuard``), so a batch is generated
        with exactly the weights it was submitted under."""
        with self.guard:
            self._refuse_if_unable()
            if self.health is not None and (signum := self.faults.at_generation()) is not None:
                self._signal_scheduler(signum)  # tests only (rollout/faults.py)
            version = self.weight_version
            future = self.guard.start(lambda servers: self._generate(servers, prompts, params))
        return lambda: stamped(self.guard.result(future), version)

    def interrupt(self, cut: bool = True) -> None:
        """Cut generation short, from any thread (a preemption signal: the batch will be dropped, issue
        51): the requests in flight are aborted on each server's event loop (``abort_requests``; their
        outputs so far come back, possibly empty) and later generations ask one token per response,
        until ``interrupt(False)``."""
        self.interrupted = cut
        if cut:
            abort_requests(self.guard.servers)

    def _generate(
        self, servers: list[Any], prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        if self.interrupted:  # the batch is dropped: one token each, as soon as it can
            params = dataclasses.replace(params, max_new_tokens=1, max_new_tokens_each=None)
        request = protocol.generate_request(
            prompts, params, self._rng, routes_enabled=self._route_layout is not None, context=self.context
        )
        outputs = _scatter(servers, request)
        return protocol.completions(
            outputs, request, params.n, self._route_layout, aborted_ok=self.interrupted
        )

    def score(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> list[list[float]]:
        return self._score(sequences, prompt_lens, temperature, routes=None)[0]

    def score_with_routes(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> tuple[list[list[float]], list[torch.Tensor] | None]:
        """``score``, and SGLang's routed experts of each sequence where the engine was started to
        report them (``launch.routes``: algorithm.routing_replay=r3), so the mismatch probe replays
        them (``mismatch/probe_replay_*``) as it does the embedded engine's."""
        return self._score(sequences, prompt_lens, temperature, routes=self._route_layout)

    def _score(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        temperature: float,
        *,
        routes: RouteLayout | None,
    ) -> tuple[list[list[float]], list[torch.Tensor] | None]:
        """``score``, with each sequence's routes where ``routes`` (their layout) is given."""
        request = protocol.score_request(sequences, temperature, routes=routes is not None)
        with self.guard as servers:
            self._refuse_if_unable()
            if self.prefixes.older_than(self.weight_version):  # kept KV of older weights: not for a score
                self._flush(servers)
            outputs = _scatter(servers, request)
        vocab = self._hf_config.get("vocab_size")
        scored = [
            protocol.teacher_forced_logprobs(o, s, n, vocab)
            for o, s, n in zip(outputs, request.input_ids, prompt_lens, strict=True)
        ]
        if routes is None:
            return scored, None
        return scored, [
            protocol.score_routes(o, len(s), routes) for o, s in zip(outputs, request.input_ids, strict=True)
        ]

    def _refuse_if_unable(self) -> None:
        self.check_alive()
        why = self.released.refusal() or self.load.refusal()
        if why is not None:
            raise RuntimeError(why)

    # -- weights

    def update_weights(self, bucket: Bucket, *, version: int, last: bool) -> None:
        with self.guard as servers:  # a submitted batch finishes under the weights it was submitted with
            if self.health is not None and bucket and (signum := self.faults.at_bucket(version)) is not None:
                self._signal_scheduler(signum)  # tests only (rollout/faults.py)
            try:
                self.load.accept(bucket, version)
                arranged = self._pairs.arrange(
                    bucket, version=version, last=last
                )  # SGLang loads some in pairs
                self.check_alive()
                self.load.open_sessions(servers)
            except BaseException as exc:  # a call cancelled on a lost engine too (ServerGuard)
                # The engine's other GPUs are in this round too: they fail with the reason, not wait.
                self.transport.refuse(f"{type(exc).__name__}: {exc}")
                raise
            flush = self.prefixes.due(version)
            try:
                self.transport.send(
                    servers,
                    with_output_head(arranged, self.tied_head),
                    last=last,
                    version=version,
                    flush=flush,
                )
            except Exception:
                self.check_alive()  # a load that failed because a process of the engine died: EngineLost
                raise
            self.load.loaded(arranged)
            if last:
                self.load.finish(servers, version)
                if flush:
                    self.prefixes.flushed(version)

    def _load_tied_head_from_disk(self) -> None:
        """A tied checkpoint just loaded by SGLang: give its own ``lm_head`` the input embedding
        (``with_output_head``), by name, as ``update_weights_from_tensor``'s named-tensor path."""
        head = checkpoint_output_head(self.model_path)
        if not head:
            return
        with self.guard as servers:
            self.load.open_sessions(servers)
            for server in servers:
                raise_on_failure(server.update_weights_from_tensor(head), "update_weights_from_tensor")
            self.load.close_sessions(servers)

    # -- health

    def check_alive(self) -> None:
        """Raise ``EngineLost`` naming the engine, rank, host and last log lines if one of its processes is
        gone or stopped (state T), or a memory call found it lost (cheap: the process table); the fleet's
        recovery restarts it or names it."""
        if self.lost is not None:
            raise self.lost
        if self.health is not None:
            self.health.check_now()

    def stop_watching(self) -> None:
        if self.health is not None:
            self.health.stopping = True

    def _watch(self) -> None:
        """While a generation is awaited (``ServerGuard``): raise if a process of the engine died
        (SGLang's watchdog also SIGQUITs the rank: ``health.on_sigquit``) or has been stopped for
        ``rollout.recovery.health_timeout_s``; the guard then cancels the generation. A scheduler alive
        but hung is the guard's ``SchedulerProbe``'s to find."""
        assert self.health is not None
        self.health.check_now(self.rollout.recovery.health_timeout_s)

    def _signal_scheduler(self, signum: int) -> None:
        """Signal the scheduler of the engine's last TP rank (``sglang::scheduler_TP<i>``): on an engine
        of several GPUs, one on a member's GPU, which the leader's processes watch too."""
        assert self.health is not None
        names = self.health.names
        schedulers = [p for p in self.health.procs if "scheduler" in names.get(p.pid, "")]
        if schedulers:
            os.kill(max(schedulers, key=lambda p: _tp_rank(names[p.pid])).pid, signum)

    def restart(self, address: str | None = None) -> None:
        """Restart a lost colocated engine in place (issue 41; ``EngineRecovery.restart_engines``): the
        generation in flight is cancelled, the engine stopped (``watch.stop_lost_part``: its own
        processes only, what is left of them SIGKILLed, a stopped one too), then ``sglang.Engine``
        starts again in this process with the same arguments (fresh ports and IPC names; the trainer's
        signal handlers taken back again) on a fresh event loop. It holds the checkpoint's (or dummy)
        weights: the fleet then streams the last synced version into it. It comes back in the memory
        phase of the moment: the tags its predecessor had released are released again right after the
        start. SGLang sizes its KV pool from the memory free as it starts: the recovery restarts it with
        the trainer's state off the device (``EngineRecovery.starting``, the job's
        ``ColocatedMemory.restart_visit``: issue 51 item 2), so the pool is the first start's. An engine
        of several GPUs restarts whole, with the same width: inside a node its schedulers are all this
        process's children; across nodes the first rank of each further node restarts that node's part at
        the same time (``SGLangSyncMember.restart``), all parts meeting at ``address``, a fresh
        ``dist_init_addr`` (``restart_address``; the old one's port may still be held). Its members'
        sinks hold nothing a restart invalidates: the fleet resyncs every GPU."""
        if self.health is None:
            raise RuntimeError("only a colocated SGLang engine started by this adapter restarts in place")
        if self._launch.nnodes > 1:
            if address is None:
                raise RuntimeError(
                    "an SGLang engine across nodes restarts at a fresh address (restart_address)"
                )
            self._launch = dataclasses.replace(self._launch, dist_init_addr=address)
        released = sorted(self.released.tags)
        servers = self.guard.abandon()
        self.life += 1
        for server in servers:
            stop_lost_part(server, self.health, self.life)
        self.transport.reset(servers)
        self._fresh_state()
        server, self.health, _ = start_colocated(
            self.rollout, self.model_path, self._launch, self._hf_config, weights_on_disk=bool(self._shapes)
        )
        self.guard = self._guard([server])
        self.context = protocol.context_tokens([server])
        if self.tied_head and self._shapes and not self._dummy:
            self._load_tied_head_from_disk()
        if released:
            self.release_memory(released)  # type: ignore[arg-type]

    def restart_address(self) -> str | None:
        """Where the parts of this engine meet when it restarts across nodes (``restart``): its first
        node's host with a port free there now; None inside one node (no address needed)."""
        if self._launch.nnodes <= 1 or self._launch.dist_init_addr is None:
            return None
        host = self._launch.dist_init_addr.rpartition(":")[0]
        return f"{host}:{free_port('')}"

    def ensure_healthy(self, timeout_s: float | None = None) -> None:
        """Wait until every server answers (disaggregated: ``/health_generate``). A server that does
        not in time goes through ``restart_server(url)`` (or raises naming it); a restarted server has
        its checkpoint's weights again, so the engine then needs a full sync before it generates."""
        timeout_s = timeout_s or self.rollout.sglang.request_timeout_s
        with self.guard as servers:
            for i in self.transport.restarted_servers(servers, timeout_s, self._restart_server):
                self.load.server_restarted(i, getattr(servers[i], "url", str(i)))

    # -- memory and lifetime

    def release_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        """Release ``tags`` (None: all) that the engine still holds; the others are left alone."""
        wanted = self.released.to_release(tags)
        self._memory_call("release_memory_occupation", wanted)
        self.released.tags.update(wanted)

    def resume_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        """Take back ``tags`` (None: all) that the engine released; asking for one it holds (e.g.
        the run's first sync resuming ``weights``) does nothing, by construction."""
        wanted = self.released.to_resume(tags)
        self._memory_call("resume_memory_occupation", wanted)
        self.released.tags.difference_update(wanted)

    def _memory_call(self, method: str, tags: Sequence[MemoryTag]) -> None:
        """SGLang's ``method`` with ``tags`` on every server (no tags: nothing), run as a generation is
        (``ServerGuard.start``, once none is in flight) so that its wait is watched the same way: a
        process dead or stopped past the deadline, or schedulers that leave a state request unanswered
        past it (a peer of the TP group stopped on another node leaves TP rank 0 waiting on it), end it.
        An engine lost on the way (``EngineLost``: ``rollout.recovery.max_restarts`` > 0; a death lands
        in a memory phase as often as anywhere) raises nothing here: the phase counts as done, and the
        fleet's next recoverable call (the sync's manifest check, a generation, the mismatch probe)
        finds the engine lost and restarts it, in that phase (``restart``)."""
        if not tags:
            return

        def call(servers: list[Any]) -> None:
            for server in servers:
                getattr(server, method)(tags=list(tags))

        try:
            self.guard.result(self.guard.start(call))
        except EngineLost as exc:
            self.lost = exc  # check_alive raises it again (a hung scheduler's processes still look alive)

    def flush_cache(self) -> None:
        with self.guard as servers:
            self._flush(servers)

    def _flush(self, servers: Sequence[Any]) -> None:
        for server in servers:
            server.flush_cache()
        self.prefixes.flushed(self.weight_version)

    def shutdown(self) -> None:
        """Stop the engine: its own processes only (``EngineProcesses.engine_only_shutdown``), not
        the rank's other children (reward workers, wandb)."""
        servers = self.guard.close()
        self.transport.reset(servers)
        for server in servers:
            with self.health.engine_only_shutdown() if self.health is not None else contextlib.nullcontext():
                server.shutdown()


def _tp_rank(name: str) -> int:
    """The TP rank in an SGLang scheduler's process title (``sglang::scheduler_TP1``, ``..._TP1_EP1``); 0
    when it names none."""
    digits = name.partition("_TP")[2].split("_")[0]
    return int(digits) if digits.isdigit() else 0


def _scatter(servers: Sequence[Any], request: protocol.Request) -> list[Any]:
    """``request`` split over the servers in contiguous chunks; outputs in request order."""
    if not request.input_ids:
        return []
    k = len(servers)
    bounds = [len(request.input_ids) * i // k for i in range(k + 1)]
    chunks = [(s, bounds[i], bounds[i + 1]) for i, s in enumerate(servers) if bounds[i] < bounds[i + 1]]

    def run(chunk: tuple[Any, int, int]) -> list[Any]:
        server, lo, hi = chunk
        out = server.generate(
            input_ids=request.input_ids[lo:hi],
            sampling_params=request.sampling_params[lo:hi],
            **request.options,
        )
        return out if isinstance(out, list) else [out]

    if len(chunks) == 1:
        return run(chunks[0])
    with ThreadPoolExecutor(len(chunks)) as pool:
        return [o for part in pool.map(run, chunks) for o in part]
