"""SGLang rollout engine: a thin adapter from ``RolloutEngine`` to SGLang 0.5.x's API (0.5.17 to 0.5.23,
by capability), on GPUs, or on CPU for a CPU job (SGLang's CPU engine).

The adapter's rooms, one module each (this one is the engine: generate, score, memory, lifetime):

| room | module | what it holds |
|---|---|---|
| protocol | ``protocol.py`` | requests (sampling, scoring, routes) and their outputs decoded (pure) |
| launch | ``launch.py`` | server arguments, where an engine's processes start, their environment (``EngineLaunch``) |
| weights | ``weights.py`` | the load protocol (``WeightLoad``: version, sessions, staleness), checks, tied head |
| transports | ``ipc.py``, ``nccl.py`` | colocated CUDA IPC / disaggregated NCCL broadcast, each its own differences |
| member | ``member.py`` | the other GPUs of a colocated engine (``SGLangSyncMember``) |
| health | ``health.py`` | the engine's processes watched; a dead one named |

Two modes (``rollout.sglang_mode``), decided once when the engine is built (its servers and transport):

- **colocated**: one ``sglang.Engine`` per group of ``rollout.sglang_tp`` consecutive trainer ranks, on
  the group's GPUs; weights travel by CUDA IPC (on CPU: shared memory). A group of several whole nodes
  is one SGLang multi-node engine (one ``sglang.Engine`` per node, driven from the first). Its
  processes are watched (``health.py``).
- **disaggregated**: SGLang servers already running on other GPUs or nodes, driven over HTTP; weights
  travel by an NCCL broadcast from the trainer's first rank. Health checks before use; a failed
  server goes through a restart hook and must be re-synced before it generates again.

Every call that reaches the servers goes through one ``ServerGuard``: it first waits for the one
generation that may be in flight (``submit``), so a submitted batch finishes under the weights it was
submitted with whatever the next call is. The engine's own state is named: the load protocol's
(``WeightLoad.state``: serving, loading, stale) and the memory it released (``ReleasedMemory``).

The memory order that keeps the colocated peak low is ``training/offload.py:ColocatedMemory``'s, the
same for every engine; the adapter releases and resumes only what it holds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import random
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, TypeVar

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
from grpo_megatron.rollout.engine_process import fault_items
from grpo_megatron.rollout.hf_routes import RouteLayout
from grpo_megatron.rollout.placement import RolloutPlacement, runtime_placement
from grpo_megatron.rollout.sglang import protocol
from grpo_megatron.rollout.sglang.compat import HANG_SIGNAL
from grpo_megatron.rollout.sglang.health import EngineProcesses
from grpo_megatron.rollout.sglang.ipc import CudaIpcTransport
from grpo_megatron.rollout.sglang.launch import (
    EngineLaunch,
    SGLangUnavailableError,
    agree_engine_address,
    import_sglang,
    layout_of,
    quantized,
    read_hf_config,
    start_colocated,
    stop_lost_part,
    torch_dtype,
)
from grpo_megatron.rollout.sglang.nccl import NcclBroadcastTransport, SGLangHttpClient
from grpo_megatron.rollout.sglang.shards import check_expert_placement, rank_needs
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
    from grpo_megatron.distributed.bootstrap import ParallelState
    from grpo_megatron.rollout.sglang.shards import ExpertBlock

__all__ = ["ReleasedMemory", "SGLangEngine", "SGLangUnavailableError", "ServerGuard"]

T = TypeVar("T")

WATCH_S = 0.5
"""How often a wait for the generation in flight looks at the engine's processes (``ServerGuard``)."""
ABORT_S = 10.0
"""How long a lost engine's generation thread is given to end once its requests are cancelled."""
CANCELLED = (asyncio.CancelledError, concurrent.futures.CancelledError)


class ServerGuard:
    """The engine's servers, reachable only through here, and the one generation that may run in a
    thread of this rank meanwhile (``SGLangEngine.submit``; its work is done by SGLang's scheduler
    processes). ``sglang.Engine`` drives its requests on one asyncio loop, which one thread may run at
    a time, and a submitted batch must finish under the weights it was submitted with: so
    ``with guard as servers:`` first waits for that generation, whatever the call (weights, scores,
    memory, health, shutdown). ``start(work)`` runs ``work(servers)`` as the generation in flight.

    Every wait for that generation looks at the engine every ``WATCH_S`` (``watch``: raises when the
    engine is lost, e.g. a scheduler killed or stopped, whose requests would never answer); the wait
    then cancels the generation (``cancel(servers)``: its requests on the engine's loop), gives its
    thread ``ABORT_S`` to end, and raises what ``watch`` raised. ``probe()``, where given, makes each
    wait's ``SchedulerProbe``: the engine alive but not answering (a hung scheduler) is lost too."""

    def __init__(
        self,
        servers: Sequence[Any],
        *,
        watch: Callable[[], None] | None = None,
        cancel: Callable[[list[Any]], None] | None = None,
        probe: Callable[[], SchedulerProbe] | None = None,
    ) -> None:
        self._servers = list(servers)
        self._pool: ThreadPoolExecutor | None = None
        self._running: Future[Any] | None = None
        self._watch = watch
        self._cancel = cancel
        self._probe = probe

    def __enter__(self) -> list[Any]:
        self._settle()
        return self._servers

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        # A call blocked on a lost engine (``cancel``, from the SIGQUIT of SGLang's watchdog) ends with
        # CancelledError: ``watch`` names the loss instead.
        if kind is not None and issubclass(kind, CANCELLED) and self._watch is not None:
            self._watch()

    @property
    def servers(self) -> list[Any]:
        """The servers, for a call from another thread that must not wait (``SGLangEngine.interrupt``)."""
        return list(self._servers)

    def cancel(self) -> None:
        """Cancel whatever waits on the servers now (a lost engine's: ``health.on_lost``), from a
        signal handler or another thread."""
        if self._cancel is not None:
            self._cancel(self._servers)

    def start(self, work: Callable[[list[Any]], T]) -> Future[T]:
        """Run ``work(servers)`` in the generation thread once the one before it is done; its error is
        its caller's, at ``result()``."""
        self._settle()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sglang-generate")
        running = self._pool.submit(work, self._servers)
        self._running = running
        return running

    def result(self, future: Future[T]) -> T:
        """``future``'s result (a generation ``start`` began), waited for under ``watch``."""
        self._wait(future)
        try:
            return future.result()
        except CANCELLED:
            if self._watch is not None:
                self._watch()  # the engine was lost: named (EngineLost)
            raise

    def close(self) -> list[Any]:
        """Wait for the generation in flight, stop the thread; the servers, handed over (the guard
        holds none afterwards)."""
        self._settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        servers, self._servers = self._servers, []
        return servers

    def abandon(self) -> list[Any]:
        """A lost engine's servers, handed over without waiting on them: the generation in flight is
        cancelled and given ``ABORT_S``; a thread still on the servers' event loop after that has the
        loop stopped under it (``stop_loops``: its ``run_until_complete`` returns) and ``ABORT_S``
        more. The thread is joined once it ended (bounded: a thread stuck outside the loop, which
        Python cannot end, is named and left behind); the loop is then the caller's to close
        (``close_loop``, after the shutdown)."""
        ended = self._abort()
        if not ended and self._running is not None:
            stop_loops(self._servers)
            ended = not wait([self._running], timeout=ABORT_S).not_done
        if self._pool is not None:
            self._pool.shutdown(wait=ended, cancel_futures=True)
            self._pool = None
        if not ended:
            print("[engine] the lost SGLang engine's generation thread did not end; left behind", flush=True)
        self._running = None
        servers, self._servers = self._servers, []
        return servers

    def _settle(self) -> None:
        if self._running is not None:
            self._wait(self._running)
            self._running = None

    def _wait(self, future: Future[Any]) -> None:
        probe = self._probe() if self._probe is not None else None
        while wait([future], timeout=WATCH_S).not_done:
            if self._watch is None:
                continue
            try:
                self._watch()
                if probe is not None:
                    probe.poll(self._servers)
            except BaseException:
                self._abort()
                raise

    def _abort(self) -> bool:
        """Cancel the generation in flight; whether its thread ended within ``ABORT_S``."""
        running = self._running
        if running is None or running.done():
            return True
        if self._cancel is not None:
            self._cancel(self._servers)
        return not wait([running], timeout=ABORT_S).not_done


class SchedulerProbe:
    """Whether an in-process engine's schedulers still answer, while one wait for its generation lasts
    (issue 41: a scheduler alive but hung, neither dead nor stopped, answers nothing and SGLang's
    tokenizer manager awaits it with no deadline). Every ``every_s`` of the wait it sends one state
    request (``TokenizerManager.get_internal_state``: a ``GetInternalStateReq`` the scheduler answers
    from its event loop between two batches, so a healthy one answers within one forward step, whatever
    the generation's length); one unanswered for ``deadline_s`` (``rollout.engine_health_timeout_s``)
    is the engine lost: ``fail(why)`` is raised. One request at a time, never cancelled (SGLang's
    communicator serializes them: a late answer completes its own request); a request left unanswered
    when the wait ends is answered on the loop's next run, and the next wait starts its own count."""

    def __init__(self, deadline_s: float, fail: Callable[[str], BaseException], every_s: float | None = None):
        self.deadline_s = deadline_s
        self.every_s = min(deadline_s / 8, 10.0) if every_s is None else every_s
        self._fail = fail
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._sent = time.monotonic()
        """When the request in flight (or the last one) was sent; the wait's start before the first."""

    def poll(self, servers: Sequence[Any]) -> None:
        """Look at the request in flight (raise if it is past the deadline), or send the next one."""
        now = time.monotonic()
        if self._pending and not all(f.done() for f in self._pending):
            if now - self._sent >= self.deadline_s:
                raise self._fail(
                    f"its scheduler, alive, left a state request unanswered for {now - self._sent:.1f} s, past "
                    f"rollout.engine_health_timeout_s={self.deadline_s:g} (hung)"
                )
            return
        if now - self._sent >= self.every_s:
            self._pending, self._sent = ask_state(servers), now


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
        device = launch.torch_device()
        _, flattened_cls, serializer = import_sglang(device)
        self.rollout = rollout
        self.model_path = str(model_path)
        self.mode = rollout.sglang_mode
        self._rng = random.Random(launch.seed)
        self._restart_server = restart_server
        self._hf_config = {**read_hf_config(model_path), **(launch.hf_overrides or {})}
        self.tied_head = tied_output_head(self._hf_config)
        self._shapes = shapes = checkpoint_shapes(model_path)
        self._launch = launch
        self.life = 0
        """How often this engine was restarted in place (``restart``)."""
        self._generated = 0
        """Generations submitted, over every life (``GRPO_ENGINE_FAULT`` counts them)."""
        self._buckets = (-1, 0)
        """(version, buckets of it received so far): ``GRPO_ENGINE_FAULT``'s ``killsync``."""
        self._sync_faults_done: set[int] = set()
        # Width and EP: rollout/placement.py's (from_config passes them; EngineLaunch.shape when built directly).
        # The EP decides which experts each GPU loads; server args placing experts otherwise are refused.
        self.tp_size, self.ep_size = launch.shape(rollout)
        check_expert_placement(rollout.sglang_server_args)
        self.health: EngineProcesses | None = None
        """The engine's processes when this adapter started them (a colocated engine), else None."""
        moe = "num_experts_per_tok" in self._hf_config
        self.transport: WeightTransport
        started_here = servers is None
        # A colocated engine started here from a quantized checkpoint, or from none, holds dummy weights.
        dummy = started_here and self.mode == "colocated" and (not shapes or quantized(self._hf_config))
        self._dummy = dummy
        self._fresh_state()
        if started_here and self.mode == "colocated":
            server, args = self._start_colocated()
            servers, routes = [server], bool(args["enable_return_routed_experts"])
        elif started_here:
            servers = [
                SGLangHttpClient(u, rollout.sglang_request_timeout_s) for u in rollout.sglang_server_urls
            ]
            routes = launch.routes and rollout.sglang_routed_experts
        else:
            routes = launch.routes and rollout.sglang_routed_experts
        self._route_layout = RouteLayout.from_hf(self._hf_config) if moe and routes else None
        """Where the servers report routed experts (asked per request, ``SamplingParams.routes``); None: they do not."""
        if self.mode == "colocated":
            self.transport = CudaIpcTransport(self.tp_size, (flattened_cls, serializer), device)
        else:
            self.transport = NcclBroadcastTransport(rollout, flattened_cls, device, launch.group_timeout)
        self.guard = self._guard(servers or [])
        self.interrupted = False
        """Set by ``interrupt``: generations ask one token per response (a preemption's dropped batch)."""
        self.context = context_tokens(servers or [])
        """Tokens one sequence may hold (prompt and response): each request's ``max_new_tokens`` stays
        within it (``protocol.request_budgets``); None where the servers do not say (HTTP)."""
        if started_here:
            self.ensure_healthy()  # disaggregated servers answer before use (colocated: a no-op)
            if self.tied_head and shapes and not dummy:
                self._load_tied_head_from_disk()

    def _fresh_state(self) -> None:
        """What the adapter knows of a freshly started engine: its weights, memory and load protocol."""
        self.load = WeightLoad(self._shapes, f"the checkpoint at {self.model_path}")
        """The weight-load protocol's state (version, sessions, staleness)."""
        self.released = ReleasedMemory()
        self.prefixes = KeptPrefixes(self.rollout.partial_keep_kv, self._launch.max_staleness)
        """Which weight loads flush the prefix cache (``rollout.partial_keep_kv``; off: every one)."""
        dtype = torch_dtype(self._launch.dtype)
        self.held: EngineTensors = engine_tensors(self._shapes, self._hf_config, dtype, dummy=self._dummy)
        """What the engine holds per tensor (``check_manifest`` judges each sync's manifest against it)."""
        self._accepted: Manifest | None = None
        self._pairs = PairedLoads()
        self.lost: EngineLost | None = None
        """The loss a memory call met (``_memory_call``), until the restart."""

    def _start_colocated(self) -> tuple[Any, dict[str, Any]]:
        """Start the colocated ``sglang.Engine`` (``launch.start_colocated``): (the engine, its server
        arguments); its processes watched in ``health``, restartable with ``rollout.max_engine_restarts``."""
        server, self.health, args = start_colocated(
            self.rollout, self.model_path, self._launch, self._hf_config, weights_on_disk=bool(self._shapes)
        )
        self.health.recoverable = self.rollout.max_engine_restarts > 0
        return server, args

    def _guard(self, servers: Sequence[Any]) -> ServerGuard:
        if self.health is None:
            return ServerGuard(servers)
        health = self.health

        def probe() -> SchedulerProbe:  # each wait's: rollout.engine_health_timeout_s of the moment
            return SchedulerProbe(self.rollout.engine_health_timeout_s, health.failure)

        guard = ServerGuard(servers, watch=self._watch, cancel=cancel_requests, probe=probe)
        self.health.on_lost = guard.cancel  # a call blocked on a dead scheduler ends (recoverable only)
        return guard

    @classmethod
    def from_config(
        cls, spec: EngineSpec, ps: ParallelState, placement: RolloutPlacement | None = None
    ) -> SGLangEngine | None:
        """The engine this rank drives, from the job's ``EngineSpec`` and ``ParallelState``: colocated, one per
        ``rollout.sglang_tp`` consecutive ranks (inside a node, or whole nodes: ``colocated_layout``),
        on the first of them (others get ``None``; on a multi-node engine the first rank of each
        further node starts that node's part in ``SGLangSyncMember.from_config``); disaggregated, one
        over all servers on rank 0."""
        import_sglang()
        rollout, model = spec.rollout, spec.model
        device = str(ps.device)
        if rollout.sglang_mode == "disaggregated":
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
        again without another look. Disaggregated servers of a quantized checkpoint are refused:
        they were started from its config, so they hold float8 weights the sync's tensors would be
        cast into beside stale scales."""
        self.check_alive()  # a lost engine raises EngineLost here: the fleet restarts it before the sync
        if manifest is self._accepted:
            return []
        if self.mode == "disaggregated" and quantized(self._hf_config):
            return [
                f"weight sync of version {version}: {self.model_path} is quantized (quantization_config) and the "
                "disaggregated SGLang servers started from it hold its float8 weights, which the sync's "
                "unquantized tensors cannot replace; start the servers from a copy of the folder whose "
                "config.json has no quantization_config, with --load-format dummy (the first sync fills them)"
            ]
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
            self._inject_fault()
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
        request = protocol.score_request(sequences, temperature)
        with self.guard as servers:
            self._refuse_if_unable()
            if self.prefixes.older_than(self.weight_version):  # kept KV of older weights: not for a score
                self._flush(servers)
            outputs = _scatter(servers, request)
        vocab = self._hf_config.get("vocab_size")
        return [
            protocol.teacher_forced_logprobs(o, s, n, vocab)
            for o, s, n in zip(outputs, request.input_ids, prompt_lens, strict=True)
        ]

    def _refuse_if_unable(self) -> None:
        self.check_alive()
        why = self.released.refusal() or self.load.refusal()
        if why is not None:
            raise RuntimeError(why)

    # -- weights

    def update_weights(self, bucket: Bucket, *, version: int, last: bool) -> None:
        with self.guard as servers:  # a submitted batch finishes under the weights it was submitted with
            self._inject_sync_fault(bucket, version)
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
        """Raise ``EngineDiedError`` naming the engine, rank, host and last log lines if one of its
        processes is gone or stopped (state T) (cheap: the process table); ``EngineLost`` with
        ``rollout.max_engine_restarts`` > 0 (the fleet restarts it)."""
        if self.lost is not None:
            raise self.lost
        if self.health is not None:
            self.health.check_now()

    def _watch(self) -> None:
        """While a generation is awaited (``ServerGuard``): raise if a process of the engine died
        (SGLang's watchdog also SIGQUITs the rank: ``health.on_sigquit``) or has been stopped for
        ``rollout.engine_health_timeout_s``; the guard then cancels the generation. A scheduler alive
        but hung is the guard's ``SchedulerProbe``'s to find."""
        assert self.health is not None
        self.health.check_now(self.rollout.engine_health_timeout_s)

    def _inject_fault(self) -> None:
        """``GRPO_ENGINE_FAULT`` (tests; the engine process's variable, rollout/engine_process.py:
        ``kill:N``, ``stop:N``, ``hang:N``, ``@R`` for trainer rank R's engine only): as this engine's
        N-th generation is submitted, counted over its lives (a restart does not reset the count, so
        faults can follow each other, each once), SIGKILL (SIGSTOP) its scheduler just before the
        request goes to it; ``hang``: send it ``compat.HANG_SIGNAL``, on which a scheduler started
        with the variable set hangs alive (``compat.arm_hang_fault``). ``killsync:V``:
        ``_inject_sync_fault``."""
        if self.health is None:
            return
        self._generated += 1
        signals = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "hang": HANG_SIGNAL}
        for action, number, rank in fault_items():
            if action in signals and number == self._generated and rank in (None, self.health.rank):
                self._kill_scheduler(signals[action])
                return

    def _inject_sync_fault(self, bucket: Bucket, version: int) -> None:
        """``GRPO_ENGINE_FAULT``'s ``killsync:V`` (``@R``): SIGKILL the scheduler as the second bucket of
        weight version V arrives (a death between two buckets), once per engine, in whichever life."""
        if self.health is None or not bucket:
            return
        seen = self._buckets[1] + 1 if self._buckets[0] == version else 1
        self._buckets = (version, seen)
        for action, number, rank in fault_items():
            wanted = action == "killsync" and number == version and seen == 2
            wanted = wanted and rank in (None, self.health.rank)
            if wanted and version not in self._sync_faults_done:
                self._sync_faults_done.add(version)
                self._kill_scheduler(signal.SIGKILL)

    def _kill_scheduler(self, signum: int) -> None:
        """Signal the scheduler of the engine's last TP rank (``sglang::scheduler_TP<i>``): on an engine
        of several GPUs, one on a member's GPU, which the leader's processes watch too."""
        assert self.health is not None
        names = self.health.names
        schedulers = [p for p in self.health.procs if "scheduler" in names.get(p.pid, "")]
        if schedulers:
            os.kill(max(schedulers, key=lambda p: _tp_rank(names[p.pid])).pid, signum)

    def restart(self, address: str | None = None) -> None:
        """Restart a lost colocated engine in place (issue 41; ``RolloutFleet.restart_engines``): the
        generation in flight is cancelled, the engine stopped (``launch.stop_lost_part``: its own
        processes only, what is left of them SIGKILLed, a stopped one too), then ``sglang.Engine``
        starts again in this process with the same arguments (fresh ports and IPC names; the trainer's
        signal handlers taken back again) on a fresh event loop. It holds the checkpoint's (or dummy)
        weights: the fleet then streams the last synced version into it. It comes back in the memory
        phase of the moment: the tags its predecessor had released are released again right after the
        start (on a GPU SGLang sizes its KV pool from the memory free as it starts; the rollout phase,
        where the fleet finds most losses, has the trainer resident unless train.offload_trainer, so the
        pool comes out smaller than the first start's: issue 51 item 2, open). An engine of several GPUs
        restarts whole, with the same width: inside a node its schedulers are all this process's children; across nodes
        the first rank of each further node restarts that node's part at the same time
        (``SGLangSyncMember.restart``), all parts meeting at ``address``, a fresh ``dist_init_addr``
        (``restart_address``; the old one's port may still be held). Its members' sinks hold nothing
        a restart invalidates: the fleet resyncs every GPU."""
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
        server, _ = self._start_colocated()
        self.guard = self._guard([server])
        self.context = context_tokens([server])
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
        timeout_s = timeout_s or self.rollout.sglang_request_timeout_s
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
        An engine lost on the way (``EngineLost``: ``rollout.max_engine_restarts`` > 0; a death lands
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


def cancel_requests(servers: Sequence[Any]) -> None:
    """Cancel every task on each in-process server's event loop (``sglang.Engine.loop``), from any
    thread: a generation waiting on a lost scheduler (its tokenizer manager awaits an answer with no
    deadline) then ends with ``CancelledError`` in its thread."""
    for server in servers:
        loop = getattr(server, "loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_cancel_tasks, loop)


def abort_requests(servers: Sequence[Any]) -> None:
    """Abort every request of each in-process server, from any thread: ``TokenizerManager.abort_request(
    abort_all=True)`` on the server's event loop (0.5.17 and 0.5.23); the aborted requests' outputs so
    far come back to their callers with ``finish_reason`` abort and no status code (a normal end)."""
    for server in servers:
        loop, manager = getattr(server, "loop", None), getattr(server, "tokenizer_manager", None)
        abort = getattr(manager, "abort_request", None)
        if isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_closed() and callable(abort):
            loop.call_soon_threadsafe(functools.partial(abort, abort_all=True))


def ask_state(servers: Sequence[Any]) -> list[concurrent.futures.Future[Any]]:
    """A state request to each in-process server's schedulers (``SchedulerProbe``), on the server's event
    loop from this thread: ``TokenizerManager.get_internal_state`` (0.5.17 and 0.5.23:
    ``managers/tokenizer_control_mixin.py``), the request ``Engine.get_server_info`` makes. Servers
    without a loop (HTTP clients) are not asked."""
    futures = []
    for server in servers:
        loop, manager = getattr(server, "loop", None), getattr(server, "tokenizer_manager", None)
        ask = getattr(manager, "get_internal_state", None)
        if isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_closed() and callable(ask):
            futures.append(asyncio.run_coroutine_threadsafe(ask(), loop))
    return futures


def _cancel_tasks(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


def stop_loops(servers: Sequence[Any]) -> None:
    """Stop each in-process server's event loop from any thread (``ServerGuard.abandon``): a thread
    running it returns from ``run_until_complete`` with RuntimeError."""
    for server in servers:
        loop = getattr(server, "loop", None)
        if isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)


def context_tokens(servers: Sequence[Any]) -> int | None:
    """The tokens a sequence may hold on every in-process server (``sglang.Engine``): its tokenizer
    manager's ``context_len`` less its reserved tokens (SGLang's own request check); None when no
    server says (HTTP clients)."""
    known = []
    for server in servers:
        manager = getattr(server, "tokenizer_manager", None)
        context = getattr(manager, "context_len", None)
        if isinstance(context, int):
            known.append(context - int(getattr(manager, "num_reserved_tokens", 0) or 0))
    return min(known) if known else None


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
