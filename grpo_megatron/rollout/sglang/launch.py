"""How an SGLang engine is started: its server arguments, where its processes run, their environment.

- **Colocated** engines (``rollout.sglang.mode=colocated``): one ``sglang.Engine`` per group of
  ``rollout.sglang.tp`` consecutive trainer ranks (``colocated_layout``), started by the group's first
  rank (the leader) on the group's GPUs (``colocated_server_args``: ``enable_memory_saver`` on a GPU,
  so that it can give its memory to the trainer and take it back; on CPU the arguments of SGLang's
  CPU engine, ``CPU_SERVER_ARGS``), its processes watched (``rollout/sglang/health.py``) and started
  without the launcher's variables (``engine_environment``). ``start_colocated`` starts one.
- **Disaggregated** servers (``rollout.sglang.mode=disaggregated``) are not started here: they run
  already (``rollout.sglang.server_urls``) and are driven over HTTP (``rollout/sglang/nccl.py``).

What an engine is started with beside the rollout section and the model is one ``EngineLaunch``
(``SGLangEngine.from_config`` fills it from the job's placement). SGLang is imported only inside
functions (``import_sglang``, after ``compat.install``).

An engine wider than a node (``rollout.sglang.tp`` a multiple of the GPUs per node) uses SGLang's
own multi-node launch: which ranks form it and where its parts meet is ``layout.py``'s.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from grpo_megatron.distributed.bootstrap import free_port
from grpo_megatron.rollout.config import RolloutConfig
from grpo_megatron.rollout.sglang import compat
from grpo_megatron.rollout.sglang.cpu_path import cpu_path_errors, engine_amx_environment, sglang_cpu_path
from grpo_megatron.rollout.sglang.health import (
    EngineProcesses,
    EngineStartError,
    SignalState,
    sigquit_while_starting,
)
from grpo_megatron.rollout.sglang.ipc import CudaIpcTransport
from grpo_megatron.rollout.sglang.layout import ColocatedLayout
from grpo_megatron.rollout.sglang.model_config import engine_model_path, read_hf_config, starts_on_dummy
from grpo_megatron.rollout.sglang.nccl import NcclBroadcastTransport, SGLangHttpClient
from grpo_megatron.rollout.sglang.weights import WeightTransport

if TYPE_CHECKING:
    from grpo_megatron.distributed.bootstrap import ParallelState
    from grpo_megatron.rollout.engine import EngineSpec

INSTALL_HINT = (
    "rollout.engine=sglang needs SGLang: on a CUDA machine pip install --no-deps -r requirements/gpu.txt "
    "(the set the GPU check ran: docs/getting-started/gpu.md); on CPU `make setup` installs SGLang's "
    "engine from the lock and its CPU kernels from WHEELHOUSE (docs/getting-started/cpu.md)"
)


class SGLangUnavailableError(ImportError):
    """SGLang is not importable here: the message says how to install it."""


def import_sglang(device: torch.device | None = None) -> tuple[ModuleType, type, type]:
    """``(sglang, FlattenedTensorBucket, MultiprocessingSerializer)``, imported now, or
    ``SGLangUnavailableError`` naming the install command. For an engine on a CPU ``device`` SGLang's
    CPU engine is switched on first (``SGLANG_USE_CPU_ENGINE``, read when SGLang is imported, here and
    in the engine's processes, which inherit it): every rank that starts a part of an engine passes its
    device (a multi-node engine's further parts too: without it their schedulers took the CUDA paths)."""
    if device is not None and device.type == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    compat.install()  # before SGLang's first import: it imports torchvision and registers configs
    try:
        import sglang
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError as e:
        raise SGLangUnavailableError(f"{INSTALL_HINT} (import failed: {e})") from e
    return sglang, FlattenedTensorBucket, MultiprocessingSerializer


LAUNCHER_VARIABLES = (
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
)
"""torchrun's variables, kept from an engine's processes: with ``TORCHELASTIC_USE_AGENT_STORE=True``
torch.distributed in SGLang's scheduler connects to the trainer's launcher store instead of its own
rendezvous and waits there for good (seen: a colocated engine under torchrun never started)."""


ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""torch's allocator settings (the second is the newer name of the first)."""


def engine_allocator_settings(environ: Mapping[str, str]) -> dict[str, str | None]:
    """The trainer's allocator settings without ``expandable_segments`` (None: the variable removed),
    for the engine's processes: SGLang's memory saver (torch_memory_saver) releases and resumes the
    engine's memory by intercepting the allocations of torch's caching allocator, and expandable
    segments allocate through CUDA's virtual-memory calls instead, so a release would free nothing the
    saver can give back (issue 51 item 9). The trainer keeps its own setting; every other option passes
    on. Empty: nothing to change."""
    out: dict[str, str | None] = {}
    for name in ALLOCATOR_VARIABLES:
        value = environ.get(name)
        if value is None or "expandable_segments" not in value:
            continue
        kept = [o for o in value.split(",") if o.strip() and o.split(":")[0].strip() != "expandable_segments"]
        out[name] = ",".join(kept) or None
    return out


def engine_environment(device: torch.device, cpu_path: str = "auto") -> dict[str, str | None]:
    """The environment an engine's processes start with, over the trainer's: no launcher variables
    (``LAUNCHER_VARIABLES``), no ``expandable_segments`` in torch's allocator settings
    (``engine_allocator_settings``); on CPU its schedulers' cores, one group per trainer rank of this
    node (``cpu_threads_bind``; a binding the user set is kept), and SGLang's CPU path where
    ``rollout.sglang.cpu_path`` (``cpu_path``) chooses one (``cpu_path.engine_amx_environment``)."""
    env: dict[str, str | None] = dict.fromkeys(LAUNCHER_VARIABLES)
    env.update(engine_allocator_settings(os.environ))
    if device.type == "cpu":
        if not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
            env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(
                int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            )
        env.update(engine_amx_environment(cpu_path))
    return env


def engine_overrides(hf_config: Mapping[str, Any], hf_overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """What SGLang's copy of the model config needs over the file: ``model.hf_overrides``, and
    ``architectures`` when the file has none (SGLang picks its model class by it and fails on a config
    without it; transformers needs only ``model_type``): transformers' causal-LM class for the type."""
    out = dict(hf_overrides or {})
    if not hf_config.get("architectures") and hf_config.get("model_type"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(hf_config["model_type"]))
        if name:
            out["architectures"] = [name]
    return out


_SET_BY_LAYOUT = ("tp_size", "nnodes", "node_rank", "dist_init_addr", "base_gpu_id")

CPU_SERVER_ARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",  # triton fails on CPU; intel_amx: see rollout/sglang/cpu_path.py
    "disable_cuda_graph": True,
    "enable_memory_saver": False,  # torch_memory_saver needs libcuda: release/resume then free nothing
    "enable_return_routed_experts": False,  # its host buffer is pinned memory, which needs CUDA
    "max_total_tokens": 16384,  # else the KV pool is sized from free host memory
}
"""What SGLang's engine needs on CPU (seen with SGLang 0.5.23, ``SGLANG_USE_CPU_ENGINE=1``;
../shared/GUIDE.md section 9), on both of its CPU paths (``rollout/sglang/cpu_path.py``: on the
intel_amx path linear layers, norms and MoE run SGLang's kernels, attention stays torch_native).
``rollout.sglang.server_args`` still win over each."""


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
        contiguous = len(mine) > 1 and mine[-1] - mine[0] == len(mine) - 1
        groups.append(f"{mine[0]}-{mine[-1]}" if contiguous else ",".join(map(str, mine)))
    return "|".join(groups)


def colocated_server_args(
    rollout: RolloutConfig,
    model_path: str,
    launch: EngineLaunch,
    hf_config: Mapping[str, Any],
    *,
    node_rank: int = 0,
    weights_on_disk: bool = True,
) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments of a colocated engine of the model ``hf_config`` describes
    (``rollout.sglang.server_args`` win), of ``launch``'s width and expert parallelism
    (``rollout/placement.py``'s decision), on node ``node_rank`` of the ``launch.nnodes`` it spans; a
    multi-node engine also gets SGLang's ``nnodes``, ``node_rank`` and ``dist_init_addr`` (the same on
    every node, seed included).

    Follows from the job, so that ``rollout.engine=sglang`` needs no other setting:
    - a CPU ``launch.device``: the arguments SGLang's CPU engine requires (``CPU_SERVER_ARGS``); an
      unset one is a GPU's (a plan's, a further node's);
    - no weight files at ``model_path`` (a model the trainer initialises, like the demo's), a
      quantized checkpoint (``quantization_config``: the engine starts from ``engine_config``'s
      unquantized config, ``start_colocated``), or FP8 serving (``rollout.weight_dtype=fp8``: started
      from ``engine_config``'s FP8 config): SGLang starts with random weights
      (``load_format="dummy"``, ``model_config.starts_on_dummy``); the run's first weight sync, before
      any generation, replaces them;
    - ``model.hf_overrides`` (``launch.hf_overrides``) reach SGLang's copy of the config
      (``json_model_override_args``, ``engine_overrides``);
    - routed experts are reported only by a MoE engine whose routes are replayed (``launch.routes``)."""
    tp_size, ep_size = launch.shape(rollout)
    nnodes, dist_init_addr = launch.nnodes, launch.dist_init_addr
    device = torch.device(launch.device).type if launch.device else "cuda"
    moe = "num_experts_per_tok" in hf_config
    hf_overrides = engine_overrides(hf_config, launch.hf_overrides)
    if nnodes > 1:
        fixed = sorted(k for k in _SET_BY_LAYOUT if k in rollout.sglang.server_args)
        if fixed:
            raise ValueError(
                f"rollout.sglang.server_args sets {fixed}: an engine across nodes gets them from "
                f"its width ({tp_size} GPUs, rollout.sglang.tp) and the ranks' layout; remove them"
            )
        if dist_init_addr is None:
            raise ValueError("an SGLang engine across nodes needs dist_init_addr (agree_engine_address)")
    args: dict[str, Any] = {
        "model_path": model_path,
        "tp_size": tp_size,
        "ep_size": ep_size,
        "base_gpu_id": launch.base_gpu_id,
        "mem_fraction_static": rollout.gpu_memory_utilization,
        "enable_memory_saver": True,
        "dtype": launch.dtype,
        "random_seed": launch.seed,
        # Routed experts only where they are replayed (algorithm.routing_replay=r3): each request that
        # asks gets about 2 KB per token through SGLang's detokenizer (protocol.py:generate_request).
        "enable_return_routed_experts": moe and launch.routes and rollout.sglang.routed_experts,
        "log_level": "error",
        # Idle, SGLang's scheduler polls its sockets without pause: a host core per engine spent while
        # the trainer trains beside it (on CPU, the trainer's own cores: seen 75% of each of 2).
        "sleep_on_idle": True,
    }
    if device == "cpu":
        args.update(CPU_SERVER_ARGS)
    if starts_on_dummy(hf_config, weights_on_disk, rollout.weight_dtype == "fp8"):
        args["load_format"] = "dummy"  # the run's first sync, before any generation, fills them
    if hf_overrides:
        args["json_model_override_args"] = json.dumps(hf_overrides)
    if nnodes > 1:
        args.update(nnodes=nnodes, node_rank=node_rank, dist_init_addr=dist_init_addr)
    else:
        # The TCP port of the engine's own torch.distributed group. SGLang draws it from Python's
        # `random`, which every trainer rank seeds alike: engines starting together on one host
        # drew the same port and their schedulers waited on each other's rendezvous for good.
        args["nccl_port"] = free_port("")
    return {**args, **rollout.sglang.server_args}


@dataclasses.dataclass(frozen=True)
class EngineLaunch:
    """What a colocated engine is started with beside the rollout section and the model path
    (``SGLangEngine.from_config`` fills it from the job's ``EngineSpec`` and placement; tests and
    benches give what they need). An engine over given servers, or disaggregated servers, uses only
    ``device``, ``dtype``, ``seed``, ``routes``, ``max_staleness`` and (disaggregated) ``group_timeout``."""

    dtype: str = "bfloat16"
    seed: int = 0
    """SGLang's ``random_seed``, and the base of the sampling seeds drawn for unseeded requests."""
    device: str = ""
    """A torch device ("cuda", "cuda:1", "cpu": SGLang's CPU engine); "" = cuda where available, else cpu."""
    base_gpu_id: int = 0
    tp_size: int = 0
    """The engine's GPUs (SGLang's ``tp_size``): the placement's width; 0 = ``rollout.sglang.tp`` or 1."""
    ep_size: int = 0
    """Expert parallelism inside the engine: the placement's; 0 = ``rollout.sglang.ep`` or 1."""
    nnodes: int = 1
    dist_init_addr: str | None = None
    """A multi-node engine's address (``agree_engine_address``)."""
    hf_overrides: Mapping[str, Any] | None = None
    """``model.hf_overrides``: SGLang's copy of the config gets them too."""
    rank: int = 0
    """The trainer rank that starts (leads) the engine: its log file's name."""
    log_dir: str | os.PathLike | None = None
    """Where its processes log; None = the system's temporary directory."""
    tokenizer_path: str | None = None
    """``data.tokenizer_path``, beside the model's; None = the model's."""
    routes: bool = True
    """Start a MoE engine able to report routed experts (``enable_return_routed_experts``): only when
    the job replays them (``EngineSpec.record_routes``: ``algorithm.routing_replay=r3``)."""
    group_timeout: timedelta | None = None
    """Disaggregated servers: the collective timeout of the weight group the trainer joins them in,
    the job's (``parallel.timeout_minutes``); None: ``rollout.sglang.request_timeout_s``."""
    max_staleness: int = 0
    """``train.max_staleness``: with ``rollout.partial.keep_kv``, how many versions the KV in the prefix
    cache may lag the weights that read it (``weights.py:KeptPrefixes``)."""

    def torch_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def shape(self, rollout: RolloutConfig) -> tuple[int, int]:
        """(tp_size, ep_size): as given (``from_config`` passes the placement's), else for an engine
        built directly ``rollout.sglang.tp`` / ``rollout.sglang.ep`` (0 = 1)."""
        return self.tp_size or rollout.sglang.tp or 1, self.ep_size or rollout.sglang.ep or 1


def freeze_engine_gc(engine: Any) -> bool:
    """Move what the engine's scheduler and detokenizer processes hold after start-up (modules, the
    model, the pools) out of Python's cyclic garbage collector (``sglang.Engine.freeze_gc``, where the
    engine has it; True if it did). SGLang's CPU platform "empties the device cache" with a full
    ``gc.collect()``, which walks that heap: in every ``flush_cache()`` call and in each release of
    ``kv_cache`` (``weight_updater.py``), seen ~400 ms of a 0.4 s ``release_memory`` on the demo's
    model (``bench/sglang_profile.py``). Objects created later are still collected. The call also
    freezes the process that drives the engine (its tokenizer manager lives here): that process's
    collector is given back as it was (unfrozen unless it already was, its thresholds)."""
    import gc

    freeze = getattr(engine, "freeze_gc", None)
    if not callable(freeze):
        return False
    frozen_before, thresholds = gc.get_freeze_count() > 0, gc.get_threshold()
    try:
        freeze()
    finally:
        if not frozen_before:
            gc.unfreeze()
        gc.set_threshold(*thresholds)
    return True


def start_colocated(
    rollout: RolloutConfig,
    model_path: str,
    launch: EngineLaunch,
    hf_config: Mapping[str, Any],
    *,
    weights_on_disk: bool,
    node_rank: int = 0,
) -> tuple[Any, EngineProcesses, dict[str, Any]]:
    """Start this rank's part of a colocated ``sglang.Engine``: the leader's (``node_rank`` 0, the
    whole engine on one node), or node ``node_rank``'s of an engine across nodes (``start_node_part``);
    ``(engine, its processes, the server arguments it got)``. Every part is started alike: its
    processes log to ``<log_dir>/engine-rank<R>-<pid>.log``, start with SIGTERM ignored (a Slurm
    preemption's SIGTERM reaches the trainer, which saves first) and without the launcher's variables,
    are recorded for the health checks; from the main thread, the trainer's signal handlers that
    SGLang replaces are taken back and SIGQUIT names the engine (``rollout/sglang/health.py``)."""
    device = launch.torch_device()
    sglang, _, _ = import_sglang(device)
    if device.type == "cpu":
        refuse_cpu_path(rollout.sglang.cpu_path, launch, sglang)
    launch = dataclasses.replace(launch, device=str(device))
    server_args = colocated_server_args(
        rollout, model_path, launch, hf_config, node_rank=node_rank, weights_on_disk=weights_on_disk
    )
    server_args["model_path"], changes = engine_model_path(
        model_path, hf_config, launch.log_dir, launch.rank, rollout.weight_dtype == "fp8"
    )
    if "tokenizer_path" not in server_args and changes:
        server_args["tokenizer_path"] = model_path
    if launch.tokenizer_path and "tokenizer_path" not in rollout.sglang.server_args:
        server_args["tokenizer_path"] = str(launch.tokenizer_path)  # data.tokenizer_path, beside the model's
    log_path = Path(launch.log_dir or tempfile.gettempdir()) / f"engine-rank{launch.rank}-{os.getpid()}.log"
    health = EngineProcesses(launch.rank, log_path)
    signals = SignalState() if threading.current_thread() is threading.main_thread() else None
    with compat.child_environment(engine_environment(device, rollout.sglang.cpu_path)), health.start():
        engine = sglang.Engine(**server_args, **start_signal_handler(signals is not None))
    health.recoverable = rollout.recovery.max_restarts > 0  # a lost part is restarted, not the rank ended
    if signals is not None:
        health.take_back_signals(engine, signals)
    if (
        node_rank == 0
    ):  # a further node's part has no tokenizer manager; the leader's call reaches its schedulers
        freeze_engine_gc(engine)
    part = f" (node {node_rank} of {launch.nnodes})" if launch.nnodes > 1 else ""
    print(f"[rollout] SGLang engine of rank {launch.rank}{part}: its processes log to {log_path}", flush=True)
    if changes:
        print(
            f"[rollout] SGLang engine of rank {launch.rank} reads {server_args['model_path']}: {'; '.join(changes)}"
        )
    return engine, health, server_args


@dataclasses.dataclass
class Launched:
    """An SGLang engine's servers and its weight transport, as ``launch_servers`` built them."""

    servers: list[Any]
    transport: WeightTransport
    routes: bool
    """The servers report routed experts (asked per request, ``SamplingParams.routes``)."""
    health: EngineProcesses | None = None
    """A colocated engine started here: its processes (restartable in place); else None."""
    dummy: bool = False
    """It holds dummy weights (``model_config.starts_on_dummy``): the first sync fills them."""
    started: bool = True
    """Launched here (False: servers given, used as they are)."""


def launch_servers(
    rollout: RolloutConfig,
    model_path: str,
    launch: EngineLaunch,
    hf_config: Mapping[str, Any],
    *,
    weights_on_disk: bool,
    given: Sequence[Any] | None = None,
) -> Launched:
    """The engine's servers and weight transport by ``rollout.sglang.mode``, decided here once:
    colocated, this rank's ``sglang.Engine`` (``start_colocated``) fed by CUDA IPC (on CPU: shared
    memory); disaggregated, HTTP clients of ``rollout.sglang.server_urls`` fed by an NCCL broadcast
    from rank 0. ``given`` servers (tests, custom launchers) replace starting anything."""
    device = launch.torch_device()
    _, flattened_cls, serializer = import_sglang(device)
    routes = launch.routes and rollout.sglang.routed_experts
    transport: WeightTransport
    if rollout.sglang.mode == "colocated":
        transport = CudaIpcTransport(launch.shape(rollout)[0], (flattened_cls, serializer), device)
    else:
        transport = NcclBroadcastTransport(rollout, flattened_cls, device, launch.group_timeout)
    if given is not None:
        return Launched(list(given), transport, routes, started=False)
    if rollout.sglang.mode != "colocated":
        clients = [SGLangHttpClient(u, rollout.sglang.request_timeout_s) for u in rollout.sglang.server_urls]
        return Launched(clients, transport, routes)
    server, health, args = start_colocated(
        rollout, model_path, launch, hf_config, weights_on_disk=weights_on_disk
    )
    dummy = starts_on_dummy(hf_config, weights_on_disk, rollout.weight_dtype == "fp8")
    return Launched([server], transport, bool(args["enable_return_routed_experts"]), health, dummy)


def refuse_cpu_path(setting: str, launch: EngineLaunch, sglang: ModuleType) -> None:
    """Raise ``EngineStartError`` naming the fix where the path SGLang's CPU engine takes here
    (``rollout/sglang/cpu_path.py``) cannot serve this engine: an fp32 model on the intel_amx path,
    or the intel_amx path in an SGLang without weight-update sessions (before 0.5.21: its packed
    weights cannot take an update, ``compat.amx_packed_weights_reload``)."""
    path = sglang_cpu_path(setting)
    refused = cpu_path_errors(path, launch.dtype)
    if path == "intel_amx" and not callable(getattr(sglang.Engine, "begin_weight_update", None)):
        refused.append(
            f"SGLang {getattr(sglang, '__version__', '?')} has no weight-update sessions (begin_weight_update, "
            "0.5.21 on), and on this CPU (AMX: SGLang's intel_amx path) the weights it packs after loading "
            "cannot take the trainer's updates without them; install SGLang >= 0.5.21, or set "
            "rollout.sglang.cpu_path=torch_native"
        )
    if refused:
        raise EngineStartError(f"the SGLang engine of rank {launch.rank} cannot start: {'; '.join(refused)}")


def start_signal_handler(main_thread: bool) -> dict[str, Any]:
    """The server argument that makes a scheduler failing at start name its engine
    (``custom_sigquit_handler=health.sigquit_while_starting``; SGLang sets it from the main thread
    only), where this SGLang's ``ServerArgs`` has the field (0.5.17 and 0.5.23 do); else none."""
    from sglang.srt.server_args import ServerArgs

    if not main_thread or "custom_sigquit_handler" not in inspect.signature(ServerArgs).parameters:
        return {}
    return {"custom_sigquit_handler": sigquit_while_starting}


def start_node_part(
    spec: EngineSpec,
    layout: ColocatedLayout,
    address: str,
    ep_size: int,
    ps: ParallelState,
    *,
    weights_on_disk: bool,
) -> tuple[Any, EngineProcesses]:
    """Node ``layout.node_rank`` >= 1's part of a multi-node colocated engine, started by this rank (the
    node's first of the engine) through ``start_colocated``, as the leader's part is: the same
    arguments (seed included) but this node's rank, and the same protections (SIGTERM ignored in its
    schedulers, their log, their health, the trainer's signals taken back). SGLang's Engine on such a
    node runs only the schedulers and by default never returns from its constructor; with
    ``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0`` it returns once they are up (see the module docstring)."""
    rollout, model = spec.rollout, spec.model
    launch = EngineLaunch(
        model.dtype,
        spec.seed + layout.leader,
        str(ps.device),
        base_gpu_id=layout.base_gpu_id,
        tp_size=len(layout.members),
        ep_size=ep_size,
        nnodes=layout.nnodes,
        dist_init_addr=address,
        hf_overrides=model.hf_overrides,
        rank=ps.rank,
        log_dir=spec.log_dir,
        tokenizer_path=spec.tokenizer_path,
        routes=spec.record_routes,
    )
    hf_config = {**read_hf_config(model.hf_path), **(model.hf_overrides or {})}
    os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"  # read by SGLang in this process only
    engine, health, _ = start_colocated(
        rollout,
        str(model.hf_path),
        launch,
        hf_config,
        weights_on_disk=weights_on_disk,
        node_rank=layout.node_rank,
    )
    return engine, health


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of SGLang's ``dtype`` argument (``EngineLaunch.dtype``: "bfloat16", "float32",
    "float16")."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"SGLang engine dtype {name!r} is not a torch dtype (bfloat16, float16, float32)")
    return dtype
