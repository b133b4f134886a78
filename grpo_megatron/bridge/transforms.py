"""Layout transforms between Hugging Face tensors and canonical megatron tensors.

A ``WeightRule`` ties one canonical megatron tensor (layout-independent: global layer and expert
indices, unsharded; see ``bridge/layout.py``) to the Hugging Face tensor(s) it is made of, and
names the transform. Adapters (``grpo_megatron/models/*.py``) only list rules; the arithmetic is
here, in four kinds:

- ``copy``: the same tensor on both sides;
- ``glu``: megatron's ``linear_fc1`` holds ``[gate; up]`` along dim 0 (HF ``gate_proj``, ``up_proj``);
  a TP/ETP shard holds ``[gate_r; up_r]``, the r-th slice of each half;
- ``qkv``: megatron's fused ``linear_qkv`` holds, per query group g, ``[q heads of g; k_g; v_g]``
  along dim 0 (HF ``q_proj``, ``k_proj``, ``v_proj``; weights and biases alike); a TP shard holds
  whole groups;
- ``vocab``: megatron pads the vocabulary rows with zeros up to ``padded_vocab_size``; HF holds only
  the real rows.

Loading reads shards, never whole tensors: ``read_shard`` asks a ``Reader`` for exactly the HF rows
or columns one rank owns (safetensors lazy slices), so a rank's memory is its shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

# Adapters import this module to declare their rules, and the CLI imports adapters: torch is
# imported inside the functions that need it, so `grpo-megatron --help` stays instant.

Kind = Literal["copy", "glu", "qkv", "vocab"]

Reader = Callable[[str, "int | None", int, int], "torch.Tensor"]
"""``read(hf_name, dim, start, stop)``: rows/columns ``start:stop`` of ``hf_name`` along ``dim``;
``dim=None`` reads the whole tensor."""


@dataclass(frozen=True)
class QKVGroups:
    """Grouped-query attention geometry of a fused ``linear_qkv``."""

    heads: int  # query heads
    groups: int  # key/value heads (query groups)
    head_dim: int

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups


@dataclass(frozen=True)
class WeightRule:
    """One canonical megatron tensor and the Hugging Face tensors it maps to."""

    mcore: str  # canonical megatron name, e.g. "decoder.layers.3.self_attention.linear_qkv.weight"
    hf: tuple[str, ...]  # HF names, in the order the transform concatenates them
    kind: Kind = "copy"
    qkv: QKVGroups | None = None  # kind == "qkv" only
    vocab_size: int | None = None  # kind == "vocab" only: real (unpadded) rows
    buffer: bool = False  # a megatron buffer (e.g. the router's expert_bias), not a parameter
    export: bool = True  # False: load-only (the tied output layer is exported as the embedding)

    def __post_init__(self) -> None:
        expected = {"copy": 1, "glu": 2, "qkv": 3, "vocab": 1}[self.kind]
        if len(self.hf) != expected:
            raise ValueError(f"{self.mcore}: kind {self.kind!r} takes {expected} HF names, got {self.hf}")
        if (self.kind == "qkv") != (self.qkv is not None):
            raise ValueError(f"{self.mcore}: qkv geometry must be given exactly for kind 'qkv'")
        if (self.kind == "vocab") != (self.vocab_size is not None):
            raise ValueError(f"{self.mcore}: vocab_size must be given exactly for kind 'vocab'")


# ---- rule constructors: what adapters call -------------------------------------------------------
def copy(mcore: str, hf: str, *, buffer: bool = False) -> WeightRule:
    return WeightRule(mcore, (hf,), buffer=buffer)


def glu(mcore: str, gate: str, up: str) -> WeightRule:
    return WeightRule(mcore, (gate, up), "glu")


def qkv(mcore: str, q: str, k: str, v: str, geometry: QKVGroups) -> WeightRule:
    return WeightRule(mcore, (q, k, v), "qkv", qkv=geometry)


def vocab(mcore: str, hf: str, vocab_size: int, *, export: bool = True) -> WeightRule:
    return WeightRule(mcore, (hf,), "vocab", vocab_size=vocab_size, export=export)


# ---- megatron -> HF ---------------------------------------------------------------------------
def to_hf(rule: WeightRule, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one canonical megatron tensor (views where possible; callers copy)."""
    if rule.kind == "copy":
        return [(rule.hf[0], full)]
    if rule.kind == "glu":
        gate, up = full.chunk(2, dim=0)
        return [(rule.hf[0], gate), (rule.hf[1], up)]
    if rule.kind == "vocab":
        return [(rule.hf[0], full[: rule.vocab_size])]
    g = rule.qkv
    assert g is not None
    rest = full.shape[1:]
    per_group = full.reshape(g.groups, (g.heads_per_group + 2) * g.head_dim, *rest)
    q, k, v = per_group.split([g.heads_per_group * g.head_dim, g.head_dim, g.head_dim], dim=1)
    return [(name, t.reshape(-1, *rest)) for name, t in zip(rule.hf, (q, k, v), strict=True)]


def hf_shapes(rule: WeightRule, canonical_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """The HF shapes ``rule`` expects, given the full canonical megatron shape."""
    import torch

    return [tuple(t.shape) for _, t in to_hf(rule, torch.empty(tuple(canonical_shape), device="meta"))]


# ---- HF -> megatron shard -----------------------------------------------------------------------
def read_shard(
    rule: WeightRule,
    read: Reader,
    canonical_shape: Sequence[int],
    partition_dim: int | None,
    size: int,
    rank: int,
) -> torch.Tensor:
    """Rank ``rank``'s shard (of ``size`` along ``partition_dim``) of the canonical tensor,
    reading only the HF slices it is made of. ``size=1`` gives the whole canonical tensor."""
    import torch

    split = partition_dim is not None and size > 1
    if rule.kind == "copy":
        if not split:
            return read(rule.hf[0], None, 0, 0)
        n = canonical_shape[partition_dim] // size
        return read(rule.hf[0], partition_dim, rank * n, (rank + 1) * n)
    if split and partition_dim != 0:
        raise ValueError(f"{rule.mcore}: kind {rule.kind!r} can only be split along dim 0, not {partition_dim}")
    if not split:
        size, rank = 1, 0
    if rule.kind == "glu":
        n = canonical_shape[0] // 2 // size
        return torch.cat([read(name, 0, rank * n, (rank + 1) * n) for name in rule.hf], dim=0)
    if rule.kind == "vocab":
        n = canonical_shape[0] // size
        real = rule.vocab_size
        assert real is not None
        start, stop = min(rank * n, real), min((rank + 1) * n, real)
        rows = read(rule.hf[0], 0, start, stop)
        pad = rows.new_zeros((n - rows.shape[0], *rows.shape[1:]))  # megatron's padding rows are zero
        return torch.cat([rows, pad], dim=0)
    g = rule.qkv
    assert g is not None
    groups = g.groups // size
    g0 = rank * groups
    q_rows = g.heads_per_group * g.head_dim
    q = read(rule.hf[0], 0, g0 * q_rows, (g0 + groups) * q_rows)
    k = read(rule.hf[1], 0, g0 * g.head_dim, (g0 + groups) * g.head_dim)
    v = read(rule.hf[2], 0, g0 * g.head_dim, (g0 + groups) * g.head_dim)
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, q_rows, *rest), k.reshape(groups, g.head_dim, *rest), v.reshape(groups, g.head_dim, *rest)],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def dict_reader(tensors: dict[str, torch.Tensor]) -> Reader:
    """A ``Reader`` over in-memory HF tensors (tests, engines that already hold a state dict)."""

    def read(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        if name not in tensors:
            raise KeyError(f"HF tensor {name!r} missing")
        t = tensors[name]
        return t if dim is None else t.narrow(dim, start, stop - start)

    return read
