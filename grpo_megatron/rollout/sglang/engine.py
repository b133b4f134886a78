"""SGLang rollout engine: a thin adapter from ``RolloutEngine`` to SGLang 0.5.x's API (0.5.17 to 0.5.23,
by capability), on GPUs, or on CPU for a CPU job (SGLang's CPU engine; ``ipc.CPU_SERVER_ARGS``).

Two modes (``rollout.sglang_mode``), each with its weight transport in its own module behind one
interface (``rollout/sglang/weights.py:WeightTransport``):

- **colocated** (``rollout/sglang/ipc.py``): one ``sglang.Engine`` per group of ``rollout.sglang_tp``
  consecutive trainer ranks, on the group's GPUs (with ``enable_memory_saver`` on a GPU, so that it
  can give its memory to the trainer and take it back); weights travel by CUDA IPC (on CPU: shared
  memory). A group of several whole nodes is one SGLang multi-node engine (one ``sglang.Engine`` per
  node, driven from the first). Its processes are watched (``rollout/sglang/health.py``).
- **disaggregated** (``rollout/sglang/nccl.py``): SGLang servers already running on other GPUs or
  nodes (``rollout.sglang_server_urls``), driven over HTTP; weights travel by an NCCL broadcast
  from the trainer's first rank. Health checks before use; a failed server goes through a restart
  hook and must be re-synced before it generates again.

A version's buckets are loaded inside one weight-update session where the server has them
(``begin_weight_update`` / ``end_weight_update``, SGLang 0.5.21 on: 0.5.23 refuses a load outside one,
0.5.17 has neither; ``update_sessions``).

The memory order that keeps the colocated peak low is ``training/offload.py:ColocatedMemory``'s, the
same for every engine; the adapter releases and resumes only what it holds (``released``).

SGLang is imported only inside functions (``import_sglang``, after ``compat.install``). What SGLang
does differently from the interface's conventions is written where it happens (greedy logprobs,
teacher-forced logprobs at temperature 1, input ids it reports as 0, stopping at the model's EOS).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import torch

from grpo_megatron.rollout.config import RolloutConfig
from grpo_megatron.rollout.engine import (
    ALL_MEMORY_TAGS,
    Bucket,
    Completion,
    EngineSpec,
    Manifest,
    MemoryTag,
    RolloutEngine,
    SamplingParams,
    stamped,
)
from grpo_megatron.rollout.hf_routes import RouteLayout, route_dtype
from grpo_megatron.rollout.placement import RolloutPlacement, runtime_placement
from grpo_megatron.rollout.sglang import compat
from grpo_megatron.rollout.sglang.health import EngineProcesses, SignalState
from grpo_megatron.rollout.sglang.ipc import (
    ColocatedLayout,
    CudaIpcTransport,
    EngineGroupFeed,
    agree_engine_address,
    colocated_layout,
    colocated_server_args,
    contribution,
    cpu_threads_bind,
)
from grpo_megatron.rollout.sglang.nccl import (
    NcclBroadcastTransport,
    SGLangHttpClient,
    SGLangServerError,
    wait_healthy,
)
from grpo_megatron.rollout.sglang.shards import check_expert_placement, rank_needs
from grpo_megatron.rollout.sglang.weights import WeightTransport, raise_on_failure

if TYPE_CHECKING:
    from grpo_megatron.distributed.bootstrap import ParallelState
    from grpo_megatron.rollout.sglang.shards import ExpertBlock

INSTALL_HINT = (
    "rollout.engine=sglang needs SGLang: on a CUDA machine pip install 'grpo-megatron[gpu]'; on CPU "
    "`make setup` installs SGLang's engine from the lock and its CPU kernels from WHEELHOUSE "
    "(README: SGLang on CPU)"
)
_SEED_MODULUS = 2**63 - 1  # SGLang's sampling_seed is a signed int64


class SGLangUnavailableError(ImportError):
    """SGLang is not importable here: the message says how to install it."""


def import_sglang() -> tuple[ModuleType, type, type]:
    """``(sglang, FlattenedTensorBucket, MultiprocessingSerializer)``, imported now, or
    ``SGLangUnavailableError`` naming the install command."""
    compat.install()  # before SGLang's first import: it imports torchvision and registers configs
    try:
        import sglang
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError as e:
        raise SGLangUnavailableError(f"{INSTALL_HINT} (import failed: {e})") from e
    return sglang, FlattenedTensorBucket, MultiprocessingSerializer


# ----------------------------------------------------------------------------------------------------
# Sampling requests and their outputs (pure)


def sample_seeds(seed: int | None, num_prompts: int, n: int, rng: random.Random) -> list[int]:
    """One sampling seed per (prompt, sample), prompt-major.

    SGLang seeds each token by (seed, position) only, so the ``n`` samples of a prompt must carry
    different seeds or they come out identical. A given ``seed`` fixes them all (reproducible
    calls); ``seed=None`` draws a fresh base from ``rng``. Seeds are only honoured by engines
    started with ``enable_deterministic_inference`` (else SGLang samples without them).
    """
    base = rng.randrange(_SEED_MODULUS) if seed is None else seed
    return [(base * 1_000_003 + i) % _SEED_MODULUS for i in range(num_prompts * n)]


def sampling_params_dict(params: SamplingParams, seed: int) -> dict[str, Any]:
    """SGLang's sampling_params for one sample of ``params`` (``n`` is expanded by the caller).

    ``no_stop_trim`` keeps a matched stop string in the response, as the interface requires
    (stop tokens are kept by SGLang anyway). SGLang also stops at the model's own EOS tokens.
    Greedy is ``top_k=1``: SGLang then reports logprobs at temperature 1 (its greedy path skips the
    temperature), which equals the interface's convention only when ``temperature == 1``.
    """
    return {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": 1 if params.greedy else params.top_k,
        "stop_token_ids": list(params.stop_token_ids),
        "stop": list(params.stop_strings),
        "no_stop_trim": True,
        "sampling_seed": seed,
    }


def decode_routed_experts(
    encoded: str | None, num_rows: int, layout: RouteLayout | None = None
) -> torch.Tensor | None:
    """SGLang's ``meta_info["routed_experts"]`` (base64 int32, ``[rows, layers, top_k]`` flattened)
    in the ``Completion.routed_experts`` layout ``[moe_layers, rows, top_k]``. Row ``i`` is the
    routing of the token at position ``i`` of prompt + response (the last sampled token is never
    fed, so ``num_rows = len(prompt) + len(response) - 1``). With ``layout``, a report that covers
    every layer (dense ones included) keeps only the MoE layers; without it, top_k is taken as the
    whole row (one layer)."""
    if not encoded:
        return None
    ids = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)  # little-endian
    if num_rows <= 0 or ids.numel() % num_rows:
        raise ValueError(f"SGLang returned {ids.numel()} routed expert ids, not a multiple of {num_rows} tokens")
    top_k = layout.top_k if layout is not None else ids.numel() // num_rows
    if (ids.numel() // num_rows) % top_k:
        raise ValueError(f"SGLang returned {ids.numel() // num_rows} expert ids per token, not a multiple of top_k={top_k}")
    routes_mrk = ids.view(num_rows, -1, top_k).transpose(0, 1)
    if layout is not None:
        layers = routes_mrk.shape[0]
        if layers == layout.num_layers and layers != len(layout.moe_layers):
            routes_mrk = routes_mrk[list(layout.moe_layers)]
        elif layers != len(layout.moe_layers):
            raise ValueError(
                f"SGLang returned routes of {layers} layers; the model has {layout.num_layers} layers, "
                f"{len(layout.moe_layers)} of them MoE"
            )
        routes_mrk = routes_mrk.to(route_dtype(layout.num_experts))
    return routes_mrk.contiguous()


def completion_from_output(
    output: Mapping[str, Any], prompt_len: int, layout: RouteLayout | None = None
) -> Completion:
    """One SGLang generate output (``output_ids`` and ``meta_info``) as a ``Completion``."""
    meta = output["meta_info"]
    token_ids = [int(t) for t in output["output_ids"]]
    entries = meta.get("output_token_logprobs") or []
    # Each entry is (logprob, token_id, text-or-None); the token ids must be the response's.
    if [int(e[1]) for e in entries] != token_ids:
        raise RuntimeError(
            f"SGLang's output_token_logprobs ({len(entries)} entries) do not match its output_ids "
            f"({len(token_ids)} tokens): was the engine asked for return_logprob=True?"
        )
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind not in ("stop", "length"):
        raise RuntimeError(f"SGLang ended a request with finish_reason={reason!r} (aborted or failed)")
    finish: Literal["stop", "length"] = "stop" if kind == "stop" else "length"
    routed = decode_routed_experts(meta.get("routed_experts"), prompt_len + len(token_ids) - 1, layout)
    return Completion(token_ids, [float(e[0]) for e in entries], finish, routed)


def teacher_forced_logprobs(
    output: Mapping[str, Any], sequence: Sequence[int], prompt_len: int, vocab_size: int | None = None
) -> list[float]:
    """Logprobs of ``sequence[prompt_len:]`` from a scoring request's ``input_token_logprobs``
    (``logprob_start_len=0``: entry ``i`` is token ``i`` given the tokens before it).

    SGLang (0.5.23, ``logprob_result_processor.py``) reports an input token id of ``vocab_size - 1``
    or more as 0 (a clip meant for image placeholders, one too wide); its logprob is still that
    token's, so such an entry matches its token when ``vocab_size`` is given."""
    entries = output["meta_info"].get("input_token_logprobs") or []

    def same(reported: int, token: int) -> bool:
        return reported == token or (vocab_size is not None and reported == 0 and token >= vocab_size - 1)

    if len(entries) != len(sequence) or not all(same(int(e[1]), int(t)) for e, t in zip(entries, sequence, strict=True)):
        raise RuntimeError(
            f"SGLang returned {len(entries)} input logprobs for a {len(sequence)}-token sequence "
            "(or other token ids): it must be scored from position 0 (logprob_start_len=0)"
        )
    return [float(e[0]) for e in entries[prompt_len:]]


# ----------------------------------------------------------------------------------------------------
# Checks of a bucket before it is sent (pure)


def checkpoint_shapes(model_path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the safetensors files of ``model_path`` (headers only);
    empty when there are none."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def bucket_errors(bucket: Bucket, shapes: Mapping[str, tuple[int, ...]], source: str) -> list[str]:
    """Why ``bucket`` cannot be loaded into a model whose checkpoint has ``shapes`` (empty = fine)."""
    errors = []
    for name, t in bucket:
        if not t.is_floating_point():
            errors.append(f"{name}: dtype {t.dtype} is not a floating-point weight")
        elif shapes and name not in shapes:
            errors.append(f"{name}: no such tensor in {source}")
        elif shapes and tuple(t.shape) != shapes[name]:
            errors.append(f"{name}: shape {tuple(t.shape)}, {source} has {shapes[name]}")
    return errors


OUTPUT_HEAD, INPUT_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def tied_output_head(hf_config: Mapping[str, Any]) -> bool:
    """Whether the model ties its output head to its input embedding (``tie_word_embeddings``)."""
    return bool(hf_config.get("tie_word_embeddings", False))


def with_output_head(bucket: Bucket, tied: bool) -> list[tuple[str, torch.Tensor]]:
    """``bucket``, plus the input embedding once more as ``lm_head.weight`` for a tied model.

    SGLang's Qwen3-MoE (and other models of its) ignore ``tie_word_embeddings`` and always keep an
    ``lm_head`` of their own, which a tied checkpoint never fills: they would serve all-zero logits.
    The models of SGLang's that do tie (Qwen2, Qwen3) have no ``lm_head.weight`` parameter and skip
    the name, so sending it is right for both kinds."""
    out = list(bucket)
    if tied:
        out += [(OUTPUT_HEAD, t) for name, t in bucket if name == INPUT_EMBEDDING]
    return out


LAUNCHER_VARIABLES = (
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
)  # fmt: skip
"""torchrun's variables, kept from an engine's processes: with ``TORCHELASTIC_USE_AGENT_STORE=True``
torch.distributed in SGLang's scheduler connects to the trainer's launcher store instead of its own
rendezvous and waits there for good (seen: a colocated engine under torchrun never started)."""


def engine_environment(device: torch.device) -> dict[str, str | None]:
    """The environment an engine's processes start with, over the trainer's: no launcher variables
    (``LAUNCHER_VARIABLES``); on CPU its schedulers' cores, one group per trainer rank of this node
    (``cpu_threads_bind``; a binding the user set is kept)."""
    env: dict[str, str | None] = dict.fromkeys(LAUNCHER_VARIABLES)
    if device.type == "cpu" and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
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


def update_sessions(server: Any) -> bool:
    """Whether ``server`` loads weights inside ``begin_weight_update`` / ``end_weight_update``
    sessions: SGLang's Engine from 0.5.21 on (0.5.23 refuses a load outside one; 0.5.17 has
    neither method). An HTTP client says for its server (``SGLangHttpClient.update_sessions``)."""
    ask = getattr(server, "update_sessions", None)
    return bool(ask()) if callable(ask) else callable(getattr(server, "begin_weight_update", None))


# ----------------------------------------------------------------------------------------------------
# The engine


class InFlight:
    """At most one generation running in a thread of this rank (``SGLangEngine.submit``), its work
    done by SGLang's scheduler processes. ``sglang.Engine`` drives its requests on one asyncio loop,
    which one thread may run at a time: every other call of the engine ``settle``s first."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._running: Future[Any] | None = None

    def start(self, work: Callable[[], Any]) -> Future[Any]:
        self.settle()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sglang-generate")
        self._running = self._pool.submit(work)
        return self._running

    def settle(self) -> None:
        """Wait for the running generation, if any (its error is its caller's, at ``collect``)."""
        running, self._running = self._running, None
        if running is not None:
            wait([running])

    def close(self) -> None:
        self.settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class SGLangEngine(RolloutEngine):
    """``RolloutEngine`` over one colocated ``sglang.Engine`` or a set of SGLang servers.

    Build it with ``SGLangEngine.from_config(spec, ps)`` (colocated: on each group leader, ``None``
    elsewhere) or directly. ``servers`` (tests, custom launchers) replaces starting anything: objects
    with ``sglang.Engine``'s methods, used as given.

    Weight updates stream: each bucket is checked (floating point; name and shape as in the
    checkpoint at ``model_path``) before it is sent, then loaded. A bucket that fails the check, or a
    version whose last bucket leaves out names an earlier version carried, raises; the engine is
    then marked stale and refuses to generate until a complete version arrives, so it never serves
    a half-updated model silently.
    """

    def __init__(
        self,
        rollout: RolloutConfig,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        seed: int = 0,
        base_gpu_id: int = 0,
        device: torch.device | str | None = None,
        servers: Sequence[Any] | None = None,
        restart_server: Callable[[str], None] | None = None,
        nnodes: int = 1,
        dist_init_addr: str | None = None,
        hf_overrides: Mapping[str, Any] | None = None,
        rank: int = 0,
        log_dir: str | os.PathLike | None = None,
        tokenizer_path: str | None = None,
        tp_size: int = 0,
        ep_size: int = 0,
        group_timeout: timedelta | None = None,
    ):
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cpu":
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read when SGLang is imported, here and in its children
        sglang, flattened_cls, serializer = import_sglang()
        self.rollout = rollout
        self.model_path = str(model_path)
        self.mode = rollout.sglang_mode
        self._rng = random.Random(seed)
        self._restart_server = restart_server
        self._expected_shapes = checkpoint_shapes(model_path)
        self._names_of_last_version: set[str] | None = None
        self._names_this_version: set[str] = set()
        self._stale_reason: str | None = None
        self._version_in_progress = -1
        # Servers (by index) with a weight-update session open: a version's loads run inside one.
        self._sessions_open: set[int] = set()
        self.health: EngineProcesses | None = None
        """The engine's processes when this adapter started them (a colocated engine), else None."""
        self.inflight = InFlight()  # the generation ``submit`` started, while it runs
        self.released: set[str] = set()
        """Memory tags the engine has released and not resumed: only those may be resumed (SGLang's
        scheduler raises KeyError on, and then kills the process tree for, a resume of a tag it
        holds)."""
        hf_config = {**_read_hf_config(model_path), **(hf_overrides or {})}
        self._hf_config = hf_config
        self.tied_head = tied_output_head(hf_config)
        # Width and EP: rollout/placement.py's (from_config passes them; engine_shape when built directly).
        # The EP decides which experts each GPU loads; server args placing experts otherwise are refused.
        self.tp_size, self.ep_size = engine_shape(rollout, tp_size, ep_size)
        check_expert_placement(rollout.sglang_server_args)
        moe = "num_experts_per_tok" in hf_config
        self.servers: list[Any]
        if servers is not None:
            self.servers = list(servers)
            server_args: dict[str, Any] = {}
        elif self.mode == "colocated":
            server_args = colocated_server_args(
                rollout, self.model_path, base_gpu_id=base_gpu_id, dtype=dtype, seed=seed, moe=moe,
                tp_size=self.tp_size, ep_size=self.ep_size, nnodes=nnodes, node_rank=0, dist_init_addr=dist_init_addr, device=device.type,
                weights_on_disk=bool(self._expected_shapes), hf_overrides=engine_overrides(hf_config, hf_overrides),
            )  # fmt: skip
            if tokenizer_path and "tokenizer_path" not in rollout.sglang_server_args:
                server_args["tokenizer_path"] = str(tokenizer_path)  # data.tokenizer_path, beside the model's
            log_path = Path(log_dir or tempfile.gettempdir()) / f"engine-rank{rank}-{os.getpid()}.log"
            self.health = EngineProcesses(rank, log_path)
            main_thread = threading.current_thread() is threading.main_thread()
            signals = SignalState() if main_thread else None
            with compat.child_environment(engine_environment(device)), self.health.start():
                self.servers = [sglang.Engine(**server_args)]
            if signals is not None:
                self.health.take_back_signals(self.servers[0], signals)
            print(f"[rollout] SGLang engine of rank {rank}: its processes log to {log_path}", flush=True)
        else:
            self.servers = [
                SGLangHttpClient(u, rollout.sglang_request_timeout_s) for u in rollout.sglang_server_urls
            ]
            server_args = {"enable_return_routed_experts": rollout.sglang_routed_experts}
        self._routed_experts = moe and bool(server_args.get("enable_return_routed_experts", rollout.sglang_routed_experts))
        self._route_layout = RouteLayout.from_hf(hf_config) if self._routed_experts else None
        self.transport: WeightTransport
        if self.mode == "colocated":
            self.transport = CudaIpcTransport(self.servers, self.tp_size, (flattened_cls, serializer), device)
        else:
            self.transport = NcclBroadcastTransport(self.servers, rollout, flattened_cls, device, group_timeout)
            if servers is None:
                self.ensure_healthy()
        if servers is None and self.tied_head and self._expected_shapes:
            self._load_tied_head_from_disk()

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
        if rollout.sglang_mode == "disaggregated":
            if ps.rank != 0:
                return None
            return cls(rollout, model.hf_path, dtype=model.dtype, seed=spec.seed, device=ps.device,
                       group_timeout=ps.timeout)  # fmt: skip
        placement = placement or runtime_placement(spec, ps, _read_hf_config(model.hf_path))
        layout, gpus_per_node, local_rank = _layout_of(placement, ps)
        if ps.rank != layout.leader:
            return None  # a multi-node engine's other ranks agree on its address in SGLangSyncMember
        address = agree_engine_address(layout, gpus_per_node, local_rank) if layout.multi_node else None
        engine = cls(
            rollout, model.hf_path, dtype=model.dtype, seed=spec.seed + ps.rank,
            base_gpu_id=layout.base_gpu_id, device=ps.device, nnodes=layout.nnodes, dist_init_addr=address,
            hf_overrides=model.hf_overrides, rank=ps.rank, log_dir=spec.log_dir,
            tokenizer_path=spec.tokenizer_path, tp_size=placement.gpus_per_engine, ep_size=placement.engine_ep,
        )  # fmt: skip
        engine.sync_group_ranks = layout.members  # every GPU of the engine receives its own share
        return engine

    # -- the weight sync's view of this engine's GPUs

    def weight_needs(self) -> ExpertBlock | None:
        """The leader's share (SGLang TP rank 0): every dense tensor, and with ``ep_size`` > 1 the
        experts of MoE EP rank 0 (``rollout/sglang/shards.py``); everything when it feeds alone."""
        if len(self.sync_group_ranks) <= 1:
            return None
        return rank_needs(self._hf_config, self.tp_size, self.ep_size, 0)

    def bind_sync_group(self, group: Any) -> None:
        if isinstance(self.transport, CudaIpcTransport) and len(self.sync_group_ranks) > 1:
            self.transport.feed = EngineGroupFeed(self.sync_group_ranks)
            self.transport.feed.group = group

    # -- generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        self.inflight.settle()
        self._refuse_if_stale()
        return self._generate(prompts, params)

    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> Callable[[], list[list[Completion]]]:
        """Start generating and return at once (the asynchronous loop: SGLang's scheduler processes
        generate while this rank trains); calling the result waits for the completions, stamped with
        the weight version they were submitted under. One generation at a time, in submission order:
        every other call of the engine (weights, scores, memory, shutdown) first waits for it
        (``InFlight``), so a batch is generated with exactly the weights it was submitted under."""
        self.inflight.settle()
        self._refuse_if_stale()
        version = self.weight_version
        future = self.inflight.start(lambda: self._generate(prompts, params))
        return lambda: stamped(future.result(), version)

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        seeds = sample_seeds(params.seed, len(prompts), params.n, self._rng)
        flat_ids = [list(p) for p in prompts for _ in range(params.n)]
        flat_params = [sampling_params_dict(params, s) for s in seeds]
        outputs = self._scatter(
            flat_ids, flat_params, return_logprob=True, return_routed_experts=self._routed_experts
        )
        flat = [
            completion_from_output(o, len(ids), self._route_layout) for o, ids in zip(outputs, flat_ids, strict=True)
        ]
        return [flat[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def score(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float
    ) -> list[list[float]]:
        # SGLang 0.5.x computes prompt (input) logprobs from unscaled logits: only temperature 1
        # matches the interface's convention.
        if temperature != 1.0:
            raise ValueError(
                f"SGLang scores sequences at temperature 1 only (asked for {temperature}): run the "
                "mismatch probe at temperature 1.0 with the sglang engine"
            )
        self.inflight.settle()
        self._refuse_if_stale()
        ids = [list(s) for s in sequences]
        params = [{"max_new_tokens": 0, "temperature": 1.0} for _ in ids]
        outputs = self._scatter(ids, params, return_logprob=True, logprob_start_len=0)
        vocab = self._hf_config.get("vocab_size")
        return [
            teacher_forced_logprobs(o, s, n, vocab) for o, s, n in zip(outputs, ids, prompt_lens, strict=True)
        ]

    def _scatter(self, input_ids: list[list[int]], params: list[dict[str, Any]], **options: Any) -> list[Any]:
        """Split requests over the servers in contiguous chunks; outputs in request order."""
        if not input_ids:
            return []
        k = len(self.servers)
        bounds = [len(input_ids) * i // k for i in range(k + 1)]
        chunks = [
            (s, bounds[i], bounds[i + 1]) for i, s in enumerate(self.servers) if bounds[i] < bounds[i + 1]
        ]

        def run(chunk: tuple[Any, int, int]) -> list[Any]:
            server, lo, hi = chunk
            out = server.generate(input_ids=input_ids[lo:hi], sampling_params=params[lo:hi], **options)
            return out if isinstance(out, list) else [out]

        if len(chunks) == 1:
            return run(chunks[0])
        with ThreadPoolExecutor(len(chunks)) as pool:
            return [o for part in pool.map(run, chunks) for o in part]

    # -- weights

    def update_weights(self, bucket: Bucket, *, version: int, last: bool) -> None:
        self.inflight.settle()  # a submitted batch finishes under the weights it was submitted with
        if self._names_this_version and version != self._version_in_progress:
            self._names_this_version = set()  # an earlier version was abandoned half-way
        try:
            self._before_send(bucket, version)
        except Exception as exc:
            # The engine's other GPUs are in this round too: they fail with the reason, not wait.
            self.transport.refuse(f"{type(exc).__name__}: {exc}")
            raise
        if bucket or self.mode == "colocated":  # colocated: every call is a round of the engine's GPUs
            self.transport.send(with_output_head(bucket, self.tied_head), last=last, version=version)
        elif last:
            self.flush_cache()  # an empty closing bucket: the flush it would have carried
        self._names_this_version |= {name for name, _ in bucket}
        if not last:
            return
        self._end_sessions()
        names, self._names_this_version = self._names_this_version, set()
        missing = sorted((self._names_of_last_version or set()) - names)
        if missing:
            self._mark_stale(f"version {version} left out {len(missing)} tensors")
            raise RuntimeError(
                f"weight sync of version {version} ended without {len(missing)} tensors that version "
                f"{self.weight_version} had, e.g. {missing[:5]}: the engine holds a mix of versions"
            )
        self._names_of_last_version = names
        self._stale_reason = None
        self.weight_version = version

    def _before_send(self, bucket: Bucket, version: int) -> None:
        """Everything a bucket needs before it is sent: its check, a live engine, an open session."""
        errors = bucket_errors(bucket, self._expected_shapes, f"the checkpoint at {self.model_path}")
        if errors:
            if self._names_this_version:  # earlier buckets of this version are already loaded
                self._mark_stale(f"version {version} had a bad bucket after {len(self._names_this_version)} tensors")
            raise ValueError(
                f"weight sync of version {version} refused before sending this bucket ({len(errors)} "
                "problems; the export and the engine's model disagree):\n  " + "\n  ".join(errors[:10])
            )
        self._version_in_progress = version
        self.check_alive()
        self._begin_sessions()

    def _begin_sessions(self) -> None:
        """Open a weight-update session on every server that has them and has none open (an
        abandoned version's session stays open and serves the next version: SGLang refuses a
        second ``begin``)."""
        for i, server in enumerate(self.servers):
            if i not in self._sessions_open and update_sessions(server):
                raise_on_failure(server.begin_weight_update(), "begin_weight_update")
                self._sessions_open.add(i)

    def _end_sessions(self) -> None:
        for i in sorted(self._sessions_open):
            raise_on_failure(self.servers[i].end_weight_update(), "end_weight_update")
            self._sessions_open.discard(i)

    def _load_tied_head_from_disk(self) -> None:
        """A tied checkpoint just loaded by SGLang: give its own ``lm_head`` the input embedding
        (``with_output_head``), by name, as ``update_weights_from_tensor``'s named-tensor path."""
        from safetensors import safe_open

        for path in sorted(Path(self.model_path).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                if INPUT_EMBEDDING in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    head = with_output_head([(INPUT_EMBEDDING, f.get_tensor(INPUT_EMBEDDING))], True)[1:]
                    self._begin_sessions()
                    for server in self.servers:
                        raise_on_failure(server.update_weights_from_tensor(head), "update_weights_from_tensor")
                    self._end_sessions()
                    return

    def _mark_stale(self, reason: str) -> None:
        self._stale_reason = reason
        self._names_this_version = set()

    def check_alive(self) -> None:
        """Raise ``EngineDiedError`` naming the engine, rank, host and last log lines if one of its
        processes is gone (cheap: the process table)."""
        if self.health is not None:
            self.health.check()

    def _refuse_if_stale(self) -> None:
        self.check_alive()
        if self.released & {"weights", "kv_cache"}:
            raise RuntimeError(
                f"the SGLang engine has released its {sorted(self.released)} memory (to the trainer): "
                "resume_memory before generating"
            )
        if self._stale_reason is not None:
            raise RuntimeError(
                f"the SGLang engine's weights are incomplete ({self._stale_reason}): finish a full weight "
                "sync (update_weights ... last=True) before generating"
            )

    # -- health (disaggregated)

    def ensure_healthy(self, timeout_s: float | None = None) -> None:
        """Wait until every server answers ``/health_generate``. A server that does not in time goes
        through ``restart_server(url)`` (or raises naming it); a restarted server has its
        checkpoint's weights again, so the engine then needs a full sync before it generates."""
        timeout_s = timeout_s or self.rollout.sglang_request_timeout_s
        self.inflight.settle()
        for server in self.servers:
            if not hasattr(server, "healthy") or wait_healthy(server, timeout_s):
                continue
            if self._restart_server is None:
                raise SGLangServerError(
                    f"SGLang server {server.url} is not healthy after {timeout_s:.0f}s "
                    "(rollout.sglang_request_timeout_s); restart it, or pass restart_server= to SGLangEngine"
                )
            self._restart_server(server.url)
            self._sessions_open.discard(self.servers.index(server))  # a restarted server has none
            if not wait_healthy(server, timeout_s):
                raise SGLangServerError(f"SGLang server {server.url} is not healthy after its restart")
            self.transport.reset()
            if self.weight_version >= 0:
                self._mark_stale(f"server {server.url} restarted with its checkpoint's weights")

    # -- memory and lifetime

    def release_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        """Release ``tags`` (None: all) that the engine still holds; the others are left alone."""
        self.inflight.settle()
        wanted = [t for t in (ALL_MEMORY_TAGS if tags is None else tags) if t not in self.released]
        if not wanted:
            return
        for server in self.servers:
            server.release_memory_occupation(tags=list(wanted))
        self.released.update(wanted)

    def resume_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        """Take back ``tags`` (None: all) that the engine released; asking for one it holds (e.g.
        the run's first sync resuming ``weights``) does nothing, by construction."""
        self.inflight.settle()
        wanted = [t for t in (ALL_MEMORY_TAGS if tags is None else tags) if t in self.released]
        if not wanted:
            return
        for server in self.servers:
            server.resume_memory_occupation(tags=list(wanted))
        self.released.difference_update(wanted)

    def flush_cache(self) -> None:
        self.inflight.settle()
        for server in self.servers:
            server.flush_cache()

    def shutdown(self) -> None:
        """Stop the engine: its own processes only (``EngineProcesses.engine_only_shutdown``), not
        the rank's other children (reward workers, wandb)."""
        self.inflight.close()
        self.transport.reset()
        for server in self.servers:
            with self.health.engine_only_shutdown() if self.health is not None else contextlib.nullcontext():
                server.shutdown()
        self.servers = []


class SGLangSyncMember:
    """The weight sync on a GPU of a colocated SGLang engine other than its leader's (SGLang TP rank
    ``tp_rank`` runs on it): it receives exactly what that rank loads (``weight_needs``), makes each
    round's bucket one payload on this GPU and hands it to the leader, which loads every GPU's
    payload in one ``update_weights_from_tensor`` call (``rollout/sglang/ipc.py``). It generates
    nothing (generation goes through the leader). A ``WeightSink`` (``rollout/engine.py``).

    On the first GPU of a further node of an engine that spans several nodes it also holds
    ``node_engine``, the ``sglang.Engine`` of that node's part (``node_rank`` >= 1): SGLang's
    schedulers of the node's GPUs, driven from the leader's Engine (requests, weight loads and
    memory release/resume reach them through SGLang's own TP group), so it is only kept alive and
    shut down."""

    weight_version: int = -1

    def __init__(
        self,
        rollout: RolloutConfig,
        model_path: str,
        members: Sequence[int],
        tp_rank: int,
        device: torch.device | str,
        node_engine: Any = None,
        ep_size: int = 1,
    ):
        _, flattened_cls, serializer = import_sglang()
        self.rollout = rollout
        self.model_path = str(model_path)
        self.sync_group_ranks = tuple(members)
        self.tp_rank = tp_rank
        self.device = device
        self.node_engine = node_engine
        self._classes = (flattened_cls, serializer)
        self._hf_config = _read_hf_config(model_path)
        self.tied_head = tied_output_head(self._hf_config)
        self.tp_size = len(self.sync_group_ranks)
        self.ep_size = ep_size  # rollout/placement.py's engine EP
        self._expected_shapes = checkpoint_shapes(model_path)
        self.feed = EngineGroupFeed(members)

    @classmethod
    def from_config(
        cls, spec: EngineSpec, ps: ParallelState, placement: RolloutPlacement | None = None
    ) -> SGLangSyncMember | None:
        """This rank's member, when a colocated engine led from another rank uses its GPU; on a
        multi-node engine (collective: every non-leader rank calls it once while the fleet is built),
        the first rank of each further node also starts that node's part of the engine."""
        rollout = spec.rollout
        placement = placement or runtime_placement(spec, ps, _read_hf_config(spec.model.hf_path))
        layout, gpus_per_node, local_rank = _layout_of(placement, ps)
        if ps.rank == layout.leader:
            return None
        node_engine = None
        if layout.multi_node:
            address = agree_engine_address(layout, gpus_per_node, local_rank)
            if layout.starter:
                node_engine = start_node_part(spec, layout, address, placement.engine_ep)
        return cls(rollout, spec.model.hf_path, layout.members, ps.rank - layout.leader, ps.device, node_engine,
                   ep_size=placement.engine_ep)  # fmt: skip

    def shutdown(self) -> None:
        """Stop this node's part of the engine, if this rank started one."""
        if self.node_engine is not None:
            self.node_engine.shutdown()
            self.node_engine = None

    def weight_needs(self) -> ExpertBlock | None:
        return rank_needs(self._hf_config, self.tp_size, self.ep_size, self.tp_rank)

    def bind_sync_group(self, group: Any) -> None:
        self.feed.group = group

    def check_manifest(self, manifest: Manifest, version: int) -> list[str]:
        return []  # as the leader: SGLang judges a tensor when it loads it

    def load_target(self, name: str) -> torch.Tensor | None:
        return None  # SGLang's loader copies from the payload

    def abort_update(self, version: int) -> None:
        return None

    def update_weights(self, bucket: Bucket, *, version: int, last: bool) -> None:
        try:
            errors = bucket_errors(bucket, self._expected_shapes, f"the checkpoint at {self.model_path}")
            if errors:
                raise ValueError(f"weight sync of version {version}: {'; '.join(errors[:5])}")
            mine = contribution(with_output_head(bucket, self.tied_head), self._classes, self.device)
        except Exception as exc:  # handed to the leader like a payload: every GPU fails this round together
            self.feed.contribute((None, False, f"{type(exc).__name__}: {exc}"))
            raise
        self.feed.contribute(mine)
        if last:
            self.weight_version = version


def start_node_part(spec: EngineSpec, layout: ColocatedLayout, address: str, ep_size: int) -> Any:
    """``sglang.Engine`` for node ``layout.node_rank`` >= 1 of a multi-node colocated engine: the same
    arguments as the leader's (seed included) but this node's rank. SGLang's Engine on such a node
    runs only the schedulers and by default never returns from its constructor; with
    ``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0`` it returns once they are up (``rollout/sglang/ipc.py``)."""
    sglang, _, _ = import_sglang()
    rollout, model = spec.rollout, spec.model
    args = colocated_server_args(
        rollout, str(model.hf_path), base_gpu_id=layout.base_gpu_id, dtype=model.dtype,
        seed=spec.seed + layout.leader, moe="num_experts_per_tok" in _read_hf_config(model.hf_path),
        tp_size=len(layout.members), ep_size=ep_size, nnodes=layout.nnodes, node_rank=layout.node_rank, dist_init_addr=address,
    )  # fmt: skip
    os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"  # read by SGLang in this process only
    with compat.child_environment(engine_environment(torch.device("cuda"))):
        return sglang.Engine(**args)


def engine_shape(rollout: RolloutConfig, tp_size: int, ep_size: int) -> tuple[int, int]:
    """(tp_size, ep_size) of an engine: as given (``from_config`` passes the placement's), else for an
    engine built directly ``rollout.sglang_tp`` / ``rollout.sglang_ep`` (0 = 1)."""
    return tp_size or rollout.sglang_tp or 1, ep_size or rollout.sglang_ep or 1


def _layout_of(placement: RolloutPlacement, ps: ParallelState) -> tuple[ColocatedLayout, int, int]:
    """(this rank's ``ColocatedLayout``, GPUs per node, local rank) for the placement's engine width
    (the launcher's LOCAL_RANK; torchrun and the launch scripts set it)."""
    gpus_per_node = placement.gpus_per_node
    local_rank = int(os.environ.get("LOCAL_RANK", ps.rank % gpus_per_node))
    layout = colocated_layout(ps.rank, ps.world_size, placement.gpus_per_engine, gpus_per_node, local_rank)
    return layout, gpus_per_node, local_rank


def _read_hf_config(model_path: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
