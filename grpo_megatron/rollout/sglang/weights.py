"""How weights reach a SGLang engine: the load protocol (its state in one object), the checks a bucket
passes before it is sent, the tied output head, and the interface both transports implement.

The load protocol (``WeightLoad``): each version's buckets are checked (floating point; name and
shape as in the checkpoint the engine started from) before they are sent, and loaded inside one
weight-update session where the server has them (``begin_weight_update`` / ``end_weight_update``,
SGLang 0.5.21 on: 0.5.23 refuses a load outside one, 0.5.17 has neither; ``update_sessions``). Its
states (``WeightLoad.state``)::

    serving(v) --a bucket of w--> loading(w) --the last bucket, with every name v had--> serving(w)
                                      |  a bad bucket after others of w, or a last bucket
                                      v  without names v had; a server restarted
                                    stale --(a version loads, still stale)--> a complete one --> serving

A ``stale`` engine refuses to generate until a complete version has loaded: it never serves a
half-updated model silently. A bucket refused before anything of its version was loaded leaves the
engine serving its version. A session left open by an abandoned version serves the next one
(SGLang refuses a second ``begin``); a restarted server has none. These are the seams a partial
rollout (generation paused across a load) or an engine restart would extend.

A ``WeightTransport`` moves one bucket of the export stream (Hugging Face names, full tensors) into
the engine's servers; the engine checks the bucket, keeps the protocol and calls the transport,
whatever it is. One module per transport, each with its own differences (what an empty bucket
means, who else takes part in a round, what a restarted server needs):

- ``rollout/sglang/ipc.py``: colocated engines, CUDA IPC handles through ``update_weights_from_tensor``;
- ``rollout/sglang/nccl.py``: disaggregated servers, an NCCL broadcast through
  ``update_weights_from_distributed``.

Both send a bucket as SGLang's ``FlattenedTensorBucket`` (one flat byte tensor plus metadata); the
class is passed in, so this module never imports SGLang.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from grpo_megatron.bridge.fp8 import Fp8Weights
from grpo_megatron.rollout.engine import Bucket, Manifest


class WeightTransport(Protocol):
    """One way of loading buckets into an engine's servers (inside the session the engine opened).
    Every call comes from the engine inside its ``ServerGuard``, with the servers it guards."""

    def send(
        self, servers: Sequence[Any], bucket: Bucket, *, last: bool, version: int, flush: bool = True
    ) -> None:
        """Load ``bucket`` (already checked; may be empty); ``last`` closes the version (the servers
        flush their prefix caches unless ``flush`` is False (``KeptPrefixes``) and, where the endpoint
        takes one, record ``version``)."""
        ...

    def refuse(self, reason: str) -> None:
        """The engine refused a bucket before sending it: let whoever else takes part in this call
        (the other GPUs of a colocated engine) fail with ``reason`` too, instead of waiting."""
        ...

    def bind_group(self, ranks: Sequence[int], group: Any) -> None:
        """The process group of the trainer ranks that feed the engine together (one per engine GPU)."""
        ...

    def restarted_servers(
        self, servers: Sequence[Any], timeout_s: float, restart: Callable[[str], None] | None
    ) -> list[int]:
        """Make every server answer again (restarting those that do not, where the transport can);
        the indices of the servers restarted (their checkpoint's weights again, no session)."""
        ...

    def reset(self, servers: Sequence[Any]) -> None:
        """Forget any connection to the servers: the next ``send`` opens a new one."""
        ...

    def manifest_refusal(self, quantized: bool, model_path: str, version: int) -> str | None:
        """Why servers this transport feeds cannot take a version at all (from a ``quantized``
        checkpoint at ``model_path``), before any byte moves; None: they can."""
        ...


class KeptPrefixes:
    """``rollout.partial.keep_kv``: which weight loads flush the engine's prefix (radix) cache. The
    cache may hold KV computed under any version since the last flush (``oldest``); a load of version
    ``v`` keeps it while ``v - oldest <= max_staleness`` and flushes it otherwise, so no cached KV lags
    the weights that read it by more than ``train.max_staleness`` (the bound a token's own lag has).
    Off (``keep`` False), every load flushes, as SGLang's default does."""

    def __init__(self, keep: bool, max_staleness: int) -> None:
        self.keep, self.max_staleness = keep, max_staleness
        self.oldest: int | None = None
        """The oldest version whose KV the cache may hold; None: unknown (the engine's first weights)."""

    def due(self, version: int) -> bool:
        """Whether the load that completes ``version`` flushes the cache (``flushed`` once it did)."""
        return not (self.keep and self.oldest is not None and version - self.oldest <= self.max_staleness)

    def older_than(self, version: int) -> bool:
        """Whether the cache may hold KV of a version before ``version`` (a score must not read it)."""
        return self.keep and (self.oldest is None or self.oldest < version)

    def flushed(self, version: int) -> None:
        self.oldest = version


def raise_on_failure(result: Any, what: str) -> None:
    """SGLang's engine methods return ``(success, message)`` (or a dict) instead of raising."""
    if isinstance(result, tuple) and len(result) >= 2 and result[0] is False:
        raise RuntimeError(f"SGLang {what} failed: {result[1]}")
    if isinstance(result, dict) and result.get("success") is False:
        raise RuntimeError(f"SGLang {what} failed: {result.get('message')}")


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


# ----------------------------------------------------------------------------------------------------
# Checks of a bucket before it is sent, and the tied output head (pure)


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


ENGINE_FLOAT32 = ("mlp.gate.e_score_correction_bias",)
"""Tensors SGLang keeps in float32 whatever its ``dtype`` (DeepSeek-V3's routing bias with
``topk_method=noaux_tc``, ``srt/models/deepseek_v2.py``): any floating dtype loads into them exactly."""


@dataclass(frozen=True)
class EngineTensors:
    """What an SGLang engine holds, per Hugging Face name, as the weight sync addresses it: the full
    (unsharded) shape of every tensor of the checkpoint it starts from, its scales left out when the
    engine starts unquantized (``model_config.py:engine_config``) and each FP8 weight's scales added
    when it serves FP8 (``rollout.weight_dtype=fp8``), and the dtype it holds them in."""

    shapes: Mapping[str, tuple[int, ...]]
    """Name -> full shape; empty: unknown (no weight files), then only dtypes are judged."""
    dtype: torch.dtype
    """The engine's ``dtype`` (server argument), which every weight is loaded in (float8 ones too,
    once the quantization is removed); ``ENGINE_FLOAT32`` ones excepted."""
    dummy: bool
    """Started from dummy weights (``load_format=dummy``): a sync must bring every tensor."""
    num_layers: int = 0
    """``num_hidden_layers``: tensors of layers past it (DeepSeek-V3's multi-token-prediction layer)
    are in the checkpoint but not in the engine's model; 0: no such cut."""
    fp8: Fp8Weights | None = None
    """An FP8 engine's rule (bridge/fp8.py): which tensors it holds in another dtype than ``dtype``, its
    float8 weights and their float32 ``weight_scale_inv``, judged by name and shape, so also where
    ``shapes`` is empty (no weight files: a model the trainer initialises, as the demo's and the GPU
    check's); None: it holds none."""

    def held_dtype(self, name: str, shape: Sequence[int] = ()) -> torch.dtype:
        quantized = None if self.fp8 is None else self.fp8.held_dtype(name, shape)
        if quantized is not None:
            return quantized
        return torch.float32 if name.endswith(ENGINE_FLOAT32) else self.dtype

    def expected(self) -> dict[str, tuple[int, ...]]:
        """The tensors a complete sync must bring (its layers' only)."""
        return {n: s for n, s in self.shapes.items() if self.num_layers <= 0 or _layer(n) < self.num_layers}


def _layer(name: str) -> int:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return -1


def engine_tensors(
    shapes: Mapping[str, tuple[int, ...]],
    hf_config: Mapping[str, Any],
    dtype: torch.dtype,
    *,
    dummy: bool,
    fp8: Fp8Weights | None = None,
) -> EngineTensors:
    """``EngineTensors`` of an engine of ``dtype`` started from a checkpoint of ``shapes`` and config
    ``hf_config``: a quantized one's scale tensors dropped, as the engine starts without them; with
    ``fp8`` (an FP8 engine, ``model_config.engine_fp8``) every weight it selects held as float8 beside
    its float32 scales, whatever the checkpoint holds."""
    if hf_config.get("quantization_config") is not None or fp8 is not None:
        shapes = {n: s for n, s in shapes.items() if not n.endswith(SCALE_SUFFIXES)}
    held = dict(shapes)
    for name, shape in shapes.items():
        if fp8 is not None and fp8.quantizes(name, shape):
            _, (scales, scales_shape, _) = fp8.manifest(name, shape, dtype)
            held[scales] = scales_shape
    return EngineTensors(held, dtype, dummy, int(hf_config.get("num_hidden_layers") or 0), fp8)


SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale")
"""Tensors of a quantized checkpoint that hold its scales: an engine started unquantized has none."""


def manifest_errors(
    manifest: Manifest, held: EngineTensors, needs: Callable[[str], bool] | None, source: str
) -> list[str]:
    """Why a weight sync of exactly ``manifest``'s tensors (to the engine GPU whose share ``needs``
    selects; None: every tensor) cannot load into the engine ``held`` describes, one line per tensor
    (empty: it can). Judged before any byte moves (``RolloutEngine.check_manifest``): a name the
    engine does not hold, a full shape other than the checkpoint's, a dtype other than the one it
    holds (a float8 tensor sent into an unquantized engine; ``ENGINE_FLOAT32`` tensors take any
    floating dtype), and, for an engine on dummy weights, tensors the sync would leave random. An FP8
    engine's weights and scales are judged alike: a bf16 weight where it holds float8 (or the reverse),
    a weight without its scales, scales of another grid."""
    errors: list[str] = []
    for name, shape, dtype in manifest:
        want = held.held_dtype(name, shape)
        widened = name.endswith(ENGINE_FLOAT32) and want == torch.float32 and dtype.itemsize > 1
        if held.shapes and name not in held.shapes:
            errors.append(f"{name}: no such tensor in {source}")
        elif held.shapes and tuple(shape) != held.shapes[name]:
            errors.append(f"{name}: shape {tuple(shape)}, {source} has {held.shapes[name]}")
        elif not dtype.is_floating_point or (dtype != want and not widened):
            errors.append(f"{name}: dtype {dtype}, the engine holds it as {want} (the sync would cast it)")
    if held.dummy and held.shapes:
        sent = {name for name, _, _ in manifest}
        missing = sorted(n for n in held.expected() if n not in sent and (needs is None or needs(n)))
        if missing:
            errors.append(
                f"{len(missing)} tensors of {source} are never sent and the engine started on dummy weights, "
                f"e.g. {missing[:5]}"
            )
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


LOADED_TOGETHER = (
    ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("self_attn.q_a_proj.weight_scale_inv", "self_attn.kv_a_proj_with_mqa.weight_scale_inv"),
)
"""Pairs of tensors SGLang loads only when both come in the same load call: its DeepSeek model fuses a
layer's ``q_a_proj`` and ``kv_a_proj_with_mqa`` into one parameter and caches the first it sees until
the second arrives, in a cache local to one ``load_weights`` call
(``srt/models/deepseek_common/deepseek_weight_loader.py``, ``cached_a_proj``): one of them alone in a
bucket is silently never loaded. An FP8 engine's two scales are fused the same way."""


class PairedLoads:
    """Keeps each ``LOADED_TOGETHER`` pair in one bucket: a tensor whose partner is neither in its
    bucket nor held is held (copied: bucket tensors may be views valid only during the call) and sent
    with the bucket that brings the partner."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}
        self.version: int | None = None

    @staticmethod
    def partner(name: str) -> str | None:
        for a, b in LOADED_TOGETHER:
            if name.endswith(a):
                return name[: -len(a)] + b
            if name.endswith(b):
                return name[: -len(b)] + a
        return None

    def arrange(self, bucket: Bucket, *, version: int, last: bool) -> list[tuple[str, torch.Tensor]]:
        """``bucket`` of ``version`` with the tensors held for it added and the unpaired ones taken out
        (held; a new version drops what an abandoned one left); ``last``: nothing may stay held
        (ValueError naming the tensors whose partner never came)."""
        if version != self.version:
            self.held, self.version = {}, version
        names = {name for name, _ in bucket}
        out: list[tuple[str, torch.Tensor]] = []
        for name, t in bucket:
            partner = self.partner(name)
            if partner is None or partner in names:
                out.append((name, t))
            elif partner in self.held:
                out += [(partner, self.held.pop(partner)), (name, t)]
            else:
                self.held[name] = t.detach().clone()
        if last and self.held:
            missing = sorted(self.held)
            self.held = {}
            raise ValueError(
                f"the weight sync ended without the partners of {missing[:5]} ({LOADED_TOGETHER})"
            )
        return out


def checkpoint_output_head(model_path: str | os.PathLike) -> list[tuple[str, torch.Tensor]]:
    """A tied checkpoint's input embedding as ``lm_head.weight`` (what ``with_output_head`` adds), read
    from its safetensors files; empty when it has none."""
    from safetensors import safe_open

    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if INPUT_EMBEDDING in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                return with_output_head([(INPUT_EMBEDDING, f.get_tensor(INPUT_EMBEDDING))], True)[1:]
    return []


def update_sessions(server: Any) -> bool:
    """Whether ``server`` loads weights inside ``begin_weight_update`` / ``end_weight_update``
    sessions: SGLang's Engine from 0.5.21 on (0.5.23 refuses a load outside one; 0.5.17 has
    neither method). An HTTP client says for its server (``SGLangHttpClient.update_sessions``)."""
    ask = getattr(server, "update_sessions", None)
    return bool(ask()) if callable(ask) else callable(getattr(server, "begin_weight_update", None))


# ----------------------------------------------------------------------------------------------------
# The load protocol


class LoadState(enum.Enum):
    SERVING = "serving"
    """Every tensor of ``WeightLoad.version`` (-1: the checkpoint's weights) is loaded."""
    LOADING = "loading"
    """Some buckets of ``WeightLoad.loading`` are loaded, the last has not come."""
    STALE = "stale"
    """A mix of versions (``WeightLoad.stale_reason``): generation is refused until a complete
    version arrives, while one loads too."""


@dataclass
class WeightLoad:
    """The load protocol of one engine (see the module docstring): the version it serves, the version
    arriving and its names, the open sessions, and why its weights are stale. The engine calls it
    around each bucket: ``accept`` (before sending), ``open_sessions``, ``loaded``, and ``finish``
    after the last."""

    shapes: Mapping[str, tuple[int, ...]]
    """The checkpoint's tensor shapes (``checkpoint_shapes``); empty: only dtypes are checked."""
    source: str
    """What the shapes come from, for messages."""
    version: int = -1
    """The last complete version (-1: the weights the engine started with)."""
    loading: int | None = None
    """The version whose buckets are arriving; None: none since the last complete one."""
    names: set[str] = field(default_factory=set)
    """Names loaded of ``loading``."""
    last_names: set[str] | None = None
    """The names the last complete version had: the next must carry them all."""
    stale_reason: str | None = None
    """Why the weights are a mix of versions; None: they are not."""
    sessions: set[int] = field(default_factory=set)
    """Servers (by index) with a weight-update session open."""

    @property
    def state(self) -> LoadState:
        if self.stale_reason is not None:
            return LoadState.STALE
        return LoadState.SERVING if self.loading is None else LoadState.LOADING

    def accept(self, bucket: Bucket, version: int) -> None:
        """Check ``bucket`` of ``version`` before anything is sent: raises ValueError naming every
        problem (the engine then stays on its version, or goes stale if this version's earlier
        buckets are already loaded)."""
        if self.names and version != self.loading:
            self.names = set()  # an earlier version was abandoned half-way
        errors = bucket_errors(bucket, self.shapes, self.source)
        if errors:
            if self.names:  # earlier buckets of this version are already loaded
                self._stale(f"version {version} had a bad bucket after {len(self.names)} tensors")
            raise ValueError(
                f"weight sync of version {version} refused before sending this bucket ({len(errors)} "
                "problems; the export and the engine's model disagree):\n  " + "\n  ".join(errors[:10])
            )
        self.loading = version

    def open_sessions(self, servers: Sequence[Any]) -> None:
        """Open a weight-update session on every server that has them and has none open (an
        abandoned version's session stays open and serves the next version)."""
        for i, server in enumerate(servers):
            if i not in self.sessions and update_sessions(server):
                raise_on_failure(server.begin_weight_update(), "begin_weight_update")
                self.sessions.add(i)

    def close_sessions(self, servers: Sequence[Any]) -> None:
        for i in sorted(self.sessions):
            raise_on_failure(servers[i].end_weight_update(), "end_weight_update")
            self.sessions.discard(i)

    def loaded(self, bucket: Bucket) -> None:
        self.names |= {name for name, _ in bucket}

    def finish(self, servers: Sequence[Any], version: int) -> None:
        """The last bucket of ``version`` was loaded: close the sessions, then serve it if it carried
        every name the last complete version had (else stale, raising)."""
        self.close_sessions(servers)
        names, self.names = self.names, set()
        missing = sorted((self.last_names or set()) - names)
        if missing:
            self._stale(f"version {version} left out {len(missing)} tensors")
            raise RuntimeError(
                f"weight sync of version {version} ended without {len(missing)} tensors that version "
                f"{self.version} had, e.g. {missing[:5]}: the engine holds a mix of versions"
            )
        self.last_names, self.version, self.loading, self.stale_reason = names, version, None, None

    def server_restarted(self, index: int, url: str) -> None:
        """Server ``index`` came back with its checkpoint's weights and without a session."""
        self.sessions.discard(index)
        if self.version >= 0:
            self._stale(f"server {url} restarted with its checkpoint's weights")

    def refusal(self) -> str | None:
        """Why the engine must not generate now (None: it may)."""
        if self.stale_reason is None:
            return None
        return (
            f"the SGLang engine's weights are incomplete ({self.stale_reason}): finish a full weight "
            "sync (update_weights ... last=True) before generating"
        )

    def _stale(self, reason: str) -> None:
        self.stale_reason, self.names = reason, set()
