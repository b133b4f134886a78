"""SGLang rollout engine (GPU): a thin adapter from ``RolloutEngine`` to SGLang 0.5.x's API.

Two modes (``rollout.sglang_mode``):

- **colocated**: one ``sglang.Engine`` per group of ``rollout.sglang_tp`` consecutive trainer ranks,
  started by the group's first rank on the group's GPUs with ``enable_memory_saver`` so that it can
  give its memory to the trainer and take it back. Weights travel by CUDA IPC: each bucket of the
  export stream becomes one ``FlattenedTensorBucket`` on this rank's GPU, serialized once per SGLang
  TP rank with ``MultiprocessingSerializer`` (each SGLang rank opens its own copy of the handles) and
  loaded with ``update_weights_from_tensor(load_format="flattened_bucket")``.
- **disaggregated**: SGLang servers already running on other GPUs or nodes
  (``rollout.sglang_server_urls``), driven over HTTP. Weights travel by NCCL: the trainer's first
  rank joins one process group with every server's TP ranks (``/init_weights_update_group``) and
  broadcasts each bucket as one flat byte tensor (``/update_weights_from_distributed`` with
  ``load_format="flattened_bucket"``). Health checks before use; a failed server goes through a
  restart hook and must be re-synced before it generates again.

Either way a version's buckets are loaded inside one weight-update session: SGLang 0.5.23 refuses
``update_weights_from_tensor`` / ``_from_distributed`` unless ``begin_weight_update`` opened one, and
``end_weight_update`` finalises the loaded weights (the kernels' in-place layouts) before generation.

The memory order that keeps the colocated peak low is the trainer's (``training/phases.py``:
``trainer_to_device`` releases every engine tag before the trainer onloads; ``sync_weights`` resumes
the engine's weights, streams the new ones, offloads the trainer's parameters, then resumes the KV
cache and CUDA graphs), the same for every engine.

SGLang is imported only inside functions (``import_sglang``): the package and the CPU tests never
need it. What SGLang does differently from the interface's conventions is written where it happens
(greedy logprobs, teacher-forced logprobs at temperature 1, stopping at the model's EOS).
"""

from __future__ import annotations

import base64
import json
import os
import random
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from grpo_megatron.rollout.config import RolloutConfig
from grpo_megatron.rollout.engine import Bucket, Completion, MemoryTag, RolloutEngine, SamplingParams
from grpo_megatron.rollout.hf_routes import RouteLayout, route_dtype

INSTALL_HINT = (
    "rollout.engine=sglang needs SGLang: pip install 'grpo-megatron[gpu]' (or pip install sglang) "
    "on a CUDA machine"
)
WEIGHT_GROUP_NAME = "grpo_megatron_weights"
_SEED_MODULUS = 2**63 - 1  # SGLang's sampling_seed is a signed int64


class SGLangUnavailableError(ImportError):
    """SGLang is not importable here: the message says how to install it."""


def import_sglang() -> tuple[ModuleType, type, type]:
    """``(sglang, FlattenedTensorBucket, MultiprocessingSerializer)``, imported now, or
    ``SGLangUnavailableError`` naming the install command."""
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
    routed = decode_routed_experts(meta.get("routed_experts"), prompt_len + len(token_ids) - 1, layout)
    return Completion(token_ids, [float(e[0]) for e in entries], kind, routed)


def teacher_forced_logprobs(
    output: Mapping[str, Any], sequence: Sequence[int], prompt_len: int
) -> list[float]:
    """Logprobs of ``sequence[prompt_len:]`` from a scoring request's ``input_token_logprobs``
    (``logprob_start_len=0``: entry ``i`` is token ``i`` given the tokens before it)."""
    entries = output["meta_info"].get("input_token_logprobs") or []
    if [int(e[1]) for e in entries] != [int(t) for t in sequence]:
        raise RuntimeError(
            f"SGLang returned {len(entries)} input logprobs for a {len(sequence)}-token sequence "
            "(or other token ids): it must be scored from position 0 (logprob_start_len=0)"
        )
    return [float(e[0]) for e in entries[prompt_len:]]


# ----------------------------------------------------------------------------------------------------
# Weight buckets (pure, given SGLang's classes)


def aligned_order(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The bucket sorted by element size, largest first (stable within a size).

    SGLang's flattened bucket packs tensors back to back as bytes and views each slice as its
    dtype again; a slice can only be viewed as a dtype whose size divides its byte offset. Putting
    8-byte before 4-, 2- and 1-byte tensors keeps every offset a multiple of its own element size.
    """
    return sorted(bucket, key=lambda kv: -kv[1].element_size())


def flattened_bucket(
    bucket: Bucket, flattened_bucket_cls: type, device: torch.device | str | None = None
) -> Any:
    """SGLang's ``FlattenedTensorBucket`` of ``bucket`` (aligned, contiguous, on ``device``)."""
    if not bucket:
        raise ValueError("an empty weight bucket cannot be sent")
    named = [(name, t.detach().to(device or t.device).contiguous()) for name, t in aligned_order(bucket)]
    return flattened_bucket_cls(named_tensors=named)


def flattened_bucket_payloads(
    bucket: Bucket, tp_size: int, sglang_classes: tuple[type, type], device: torch.device | str | None = None
) -> list[str]:
    """What ``Engine.update_weights_from_tensor(payloads, load_format="flattened_bucket")`` takes:
    one serialized ``{"flattened_tensor", "metadata"}`` per SGLang TP rank (base64 strings, which
    every 0.5.x release accepts). On a GPU the tensor travels as a CUDA IPC handle; each rank gets
    its own serialization so the producer's IPC reference counts drop as each rank loads."""
    flattened_cls, serializer = sglang_classes
    flat = flattened_bucket(bucket, flattened_cls, device)
    payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return [serializer.serialize(payload, output_str=True) for _ in range(tp_size)]


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


def weight_group_layout(tp_sizes: Sequence[int]) -> tuple[int, list[int]]:
    """``(world_size, rank_offsets)`` of the NCCL weight group: the trainer is rank 0, then each
    server's TP ranks in order."""
    offsets, next_rank = [], 1
    for tp in tp_sizes:
        offsets.append(next_rank)
        next_rank += tp
    return next_rank, offsets


def distributed_update_body(
    bucket: Bucket, *, group_name: str, flush_cache: bool, weight_version: str | None
) -> dict[str, Any]:
    """The JSON body of ``/update_weights_from_distributed`` announcing one flattened bucket
    (``bucket`` already in ``aligned_order``; the receiver rebuilds the same byte layout)."""
    body: dict[str, Any] = {
        "names": [name for name, _ in bucket],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "load_format": "flattened_bucket",
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def colocated_group(rank: int, tp: int) -> tuple[int, list[int]]:
    """``(leader, members)`` of the colocated engine group that trainer ``rank`` belongs to."""
    leader = rank - rank % tp
    return leader, list(range(leader, leader + tp))


def colocated_server_args(
    rollout: RolloutConfig, model_path: str, *, base_gpu_id: int, dtype: str, seed: int, moe: bool
) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments of a colocated engine (``rollout.sglang_server_args`` win)."""
    return {
        "model_path": model_path,
        "tp_size": rollout.sglang_tp,
        "base_gpu_id": base_gpu_id,
        "mem_fraction_static": rollout.gpu_memory_utilization,
        "enable_memory_saver": True,
        "dtype": dtype,
        "random_seed": seed,
        "enable_return_routed_experts": moe and rollout.sglang_routed_experts,
        "log_level": "error",
        **rollout.sglang_server_args,
    }


# ----------------------------------------------------------------------------------------------------
# Disaggregated servers: HTTP client and the trainer's end of the NCCL weight group


class SGLangServerError(RuntimeError):
    """A SGLang server did not answer, or answered with an error."""


class SGLangHttpClient:
    """One running SGLang server, called through the HTTP endpoints that mirror ``sglang.Engine``'s
    methods (same names and arguments, so ``SGLangEngine`` drives both alike)."""

    def __init__(self, url: str, timeout_s: float):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, path: str, body: Mapping[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as e:
            raise SGLangServerError(f"{self.url}{path} answered {e.code}: {e.read().decode()[:500]}") from e
        except (urllib.error.URLError, OSError) as e:
            raise SGLangServerError(f"{self.url}{path} unreachable: {e}") from e
        result = json.loads(text) if text.strip() else None
        if isinstance(result, dict) and result.get("success") is False:
            raise SGLangServerError(f"{self.url}{path} failed: {result.get('message')}")
        return result

    def healthy(self, timeout_s: float = 10.0) -> bool:
        """Whether ``/health_generate`` (a real one-token generation) answers 200 in time."""
        try:
            self._call("/health_generate", timeout_s=timeout_s)
            return True
        except SGLangServerError:
            return False

    def tp_size(self) -> int:
        return int(self._call("/get_server_info")["tp_size"])

    def generate(self, **request: Any) -> list[dict[str, Any]]:
        return self._call("/generate", request)

    def flush_cache(self) -> None:
        self._call("/flush_cache", {})

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call("/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call("/resume_memory_occupation", {"tags": tags})

    def init_weights_update_group(self, **body: Any) -> None:
        self._call("/init_weights_update_group", body)

    def update_weights_from_distributed(self, **body: Any) -> None:
        self._call("/update_weights_from_distributed", body)

    def begin_weight_update(self) -> None:
        self._call("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self._call("/end_weight_update", {})

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("/destroy_weights_update_group", {"group_name": group_name})

    def shutdown(self) -> None:
        """Servers are not ours to stop: only our weight group goes."""
        return None


def init_trainer_weight_group(
    master_addr: str, master_port: int, world_size: int, group_name: str, backend: str = "nccl",
    timeout_s: float = 600.0,
) -> torch.distributed.ProcessGroup:  # fmt: skip
    """Rank 0 of a process group outside the trainer's world, joined by the servers' TP ranks.

    It must meet SGLang's side of ``init_weights_update_group``: a TCP store at
    ``master_addr:master_port`` hosted here, keys under a ``group_name`` prefix, a group of its own
    (not the default one). torch has no public call for "a second world", so this goes through
    ``_new_process_group_helper`` exactly as SGLang's side does.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(master_addr, master_port, world_size, is_master=True, timeout=timeout)
    store = torch.distributed.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, 0, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


# ----------------------------------------------------------------------------------------------------
# The engine


class SGLangEngine(RolloutEngine):
    """``RolloutEngine`` over one colocated ``sglang.Engine`` or a set of SGLang servers.

    Build it with ``SGLangEngine.from_config(cfg, ps)`` (colocated: on each group leader, ``None``
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
    ):
        sglang, flattened_cls, serializer = import_sglang()
        self.rollout = rollout
        self.model_path = str(model_path)
        self.mode = rollout.sglang_mode
        self._sglang_classes = (flattened_cls, serializer)
        self._device = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        self._rng = random.Random(seed)
        self._restart_server = restart_server
        self._expected_shapes = checkpoint_shapes(model_path)
        self._names_of_last_version: set[str] | None = None
        self._names_this_version: set[str] = set()
        self._stale_reason: str | None = None
        self._version_in_progress = -1
        self._group: torch.distributed.ProcessGroup | None = None
        # Servers (by index) with a weight-update session open: a version's loads run inside one.
        self._sessions_open: set[int] = set()
        hf_config = _read_hf_config(model_path)
        moe = "num_experts_per_tok" in hf_config
        self._routed_experts = moe and rollout.sglang_routed_experts
        self._route_layout = RouteLayout.from_hf(hf_config) if self._routed_experts else None
        if servers is not None:
            self.servers = list(servers)
        elif self.mode == "colocated":
            args = colocated_server_args(
                rollout, self.model_path, base_gpu_id=base_gpu_id, dtype=dtype, seed=seed, moe=moe
            )
            self.servers = [sglang.Engine(**args)]
        else:
            self.servers = [
                SGLangHttpClient(u, rollout.sglang_request_timeout_s) for u in rollout.sglang_server_urls
            ]
            self.ensure_healthy()

    @classmethod
    def from_config(cls, cfg: Any, ps: Any, **kwargs: Any) -> SGLangEngine | None:
        """The engine this rank drives, from a ``JobConfig`` and ``ParallelState``: colocated, one per
        ``rollout.sglang_tp`` consecutive ranks on this rank's node GPUs, on the first of them
        (others get ``None``); disaggregated, one over all servers on rank 0."""
        import_sglang()
        rollout = cfg.rollout
        if rollout.sglang_mode == "disaggregated":
            if ps.rank != 0:
                return None
            return cls(
                rollout,
                cfg.model.hf_path,
                dtype=cfg.model.dtype,
                seed=cfg.train.seed,
                device=ps.device,
                **kwargs,
            )
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ps.world_size))
        if local_world % rollout.sglang_tp or ps.world_size % rollout.sglang_tp:
            raise ValueError(
                f"rollout.sglang_tp={rollout.sglang_tp} must divide the GPUs per node ({local_world}) "
                f"and the world size ({ps.world_size}): an engine spans consecutive ranks of one node"
            )
        if torch.device(ps.device).type != "cuda":
            # SGLang imports without a GPU (--no-deps), but its Engine needs CUDA kernels (and its
            # server stack: uvloop, ...): refuse here with the fix instead of failing inside it.
            raise RuntimeError(
                f"rollout.engine=sglang (sglang_mode=colocated) needs CUDA GPUs; this rank's device is "
                f"{ps.device}: use rollout.engine=embedded on CPU"
            )
        leader, _ = colocated_group(ps.rank, rollout.sglang_tp)
        if ps.rank != leader:
            return None
        local_rank = int(os.environ.get("LOCAL_RANK", ps.rank % local_world))
        return cls(
            rollout, cfg.model.hf_path, dtype=cfg.model.dtype, seed=cfg.train.seed + ps.rank,
            base_gpu_id=local_rank, device=ps.device, **kwargs,
        )  # fmt: skip

    # -- generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        self._refuse_if_stale()
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
        self._refuse_if_stale()
        ids = [list(s) for s in sequences]
        params = [{"max_new_tokens": 0, "temperature": 1.0} for _ in ids]
        outputs = self._scatter(ids, params, return_logprob=True, logprob_start_len=0)
        return [teacher_forced_logprobs(o, s, n) for o, s, n in zip(outputs, ids, prompt_lens, strict=True)]

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
        if self._names_this_version and version != self._version_in_progress:
            self._names_this_version = set()  # an earlier version was abandoned half-way
        errors = bucket_errors(bucket, self._expected_shapes, f"the checkpoint at {self.model_path}")
        if errors:
            if self._names_this_version:  # earlier buckets of this version are already loaded
                self._mark_stale(
                    f"version {version} had a bad bucket after {len(self._names_this_version)} tensors"
                )
            raise ValueError(
                f"weight sync of version {version} refused before sending this bucket ({len(errors)} "
                "problems; the export and the engine's model disagree):\n  " + "\n  ".join(errors[:10])
            )
        self._version_in_progress = version
        self._begin_sessions()
        if bucket:
            if self.mode == "colocated":
                self._send_tensor_payloads(bucket, last=last)
            else:
                self._broadcast(bucket, last=last, version=version)
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

    def _begin_sessions(self) -> None:
        """Open a weight-update session on every server without one (an abandoned version's session
        stays open and serves the next version: SGLang refuses a second ``begin``)."""
        for i, server in enumerate(self.servers):
            if i not in self._sessions_open:
                _raise_on_failure(server.begin_weight_update(), "begin_weight_update")
                self._sessions_open.add(i)

    def _end_sessions(self) -> None:
        for i in sorted(self._sessions_open):
            _raise_on_failure(self.servers[i].end_weight_update(), "end_weight_update")
            self._sessions_open.discard(i)

    def _send_tensor_payloads(self, bucket: Bucket, *, last: bool) -> None:
        (engine,) = self.servers
        payloads = flattened_bucket_payloads(
            bucket, self.rollout.sglang_tp, self._sglang_classes, self._device
        )
        result = engine.update_weights_from_tensor(payloads, load_format="flattened_bucket", flush_cache=last)
        _raise_on_failure(result, "update_weights_from_tensor")

    def _broadcast(self, bucket: Bucket, *, last: bool, version: int) -> None:
        if self._group is None:
            self._init_weight_group()
        ordered = aligned_order(bucket)
        body = distributed_update_body(
            ordered,
            group_name=WEIGHT_GROUP_NAME,
            flush_cache=last,
            weight_version=str(version) if last else None,
        )
        flat = flattened_bucket(ordered, self._sglang_classes[0], self._device).get_flattened_tensor()
        # Every server's request blocks until the broadcast it waits for has run: send them first.
        with ThreadPoolExecutor(len(self.servers)) as pool:
            pending = [pool.submit(s.update_weights_from_distributed, **body) for s in self.servers]
            torch.distributed.broadcast(flat, src=0, group=self._group)
            for f in pending:
                f.result()

    def _init_weight_group(self) -> None:
        world_size, offsets = weight_group_layout([s.tp_size() for s in self.servers])
        addr = self.rollout.sglang_sync_master_addr or socket.gethostname()
        port = self.rollout.sglang_sync_master_port
        with ThreadPoolExecutor(len(self.servers)) as pool:
            pending = [
                pool.submit(
                    s.init_weights_update_group,
                    master_address=addr,
                    master_port=port,
                    rank_offset=offset,
                    world_size=world_size,
                    group_name=WEIGHT_GROUP_NAME,
                    backend="nccl",
                )  # fmt: skip
                for s, offset in zip(self.servers, offsets, strict=True)
            ]
            self._group = init_trainer_weight_group(
                addr, port, world_size, WEIGHT_GROUP_NAME, timeout_s=self.rollout.sglang_request_timeout_s
            )
            for f in pending:
                f.result()

    def _mark_stale(self, reason: str) -> None:
        self._stale_reason = reason
        self._names_this_version = set()

    def _refuse_if_stale(self) -> None:
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
        for server in self.servers:
            if not hasattr(server, "healthy") or _wait_healthy(server, timeout_s):
                continue
            if self._restart_server is None:
                raise SGLangServerError(
                    f"SGLang server {server.url} is not healthy after {timeout_s:.0f}s "
                    "(rollout.sglang_request_timeout_s); restart it, or pass restart_server= to SGLangEngine"
                )
            self._restart_server(server.url)
            self._sessions_open.discard(self.servers.index(server))  # a restarted server has none
            if not _wait_healthy(server, timeout_s):
                raise SGLangServerError(f"SGLang server {server.url} is not healthy after its restart")
            self._drop_weight_group()
            if self.weight_version >= 0:
                self._mark_stale(f"server {server.url} restarted with its checkpoint's weights")

    def _drop_weight_group(self) -> None:
        if self._group is None:
            return
        for server in self.servers:
            try:  # a restarted server no longer has the group: nothing to destroy there
                server.destroy_weights_update_group(WEIGHT_GROUP_NAME)
            except SGLangServerError:
                pass
        torch.distributed.destroy_process_group(self._group)
        self._group = None

    # -- memory and lifetime

    def release_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        for server in self.servers:
            server.release_memory_occupation(tags=None if tags is None else list(tags))

    def resume_memory(self, tags: Sequence[MemoryTag] | None = None) -> None:
        for server in self.servers:
            server.resume_memory_occupation(tags=None if tags is None else list(tags))

    def flush_cache(self) -> None:
        for server in self.servers:
            server.flush_cache()

    def shutdown(self) -> None:
        self._drop_weight_group()
        for server in self.servers:
            server.shutdown()
        self.servers = []


def _read_hf_config(model_path: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _raise_on_failure(result: Any, what: str) -> None:
    """SGLang's engine methods return ``(success, message)`` (or a dict) instead of raising."""
    if isinstance(result, tuple) and len(result) >= 2 and result[0] is False:
        raise RuntimeError(f"SGLang {what} failed: {result[1]}")
    if isinstance(result, dict) and result.get("success") is False:
        raise RuntimeError(f"SGLang {what} failed: {result.get('message')}")


def _wait_healthy(server: SGLangHttpClient, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.healthy(timeout_s=min(30.0, timeout_s)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


__all__ = [
    "INSTALL_HINT",
    "SGLangEngine",
    "SGLangHttpClient",
    "SGLangServerError",
    "SGLangUnavailableError",
    "aligned_order",
    "bucket_errors",
    "checkpoint_shapes",
    "colocated_group",
    "colocated_server_args",
    "completion_from_output",
    "decode_routed_experts",
    "distributed_update_body",
    "flattened_bucket",
    "flattened_bucket_payloads",
    "import_sglang",
    "init_trainer_weight_group",
    "sample_seeds",
    "sampling_params_dict",
    "teacher_forced_logprobs",
]
