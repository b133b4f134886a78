"""Layout transforms between Hugging Face tensors and canonical megatron tensors.

Adapters (``grpo_megatron/models/*.py``) declare ``WeightRule``s (``models/weight_rules.py``: one
canonical megatron tensor, the Hugging Face tensor(s) it is made of, the transform's kind); the
arithmetic of each kind is here:

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
from typing import TYPE_CHECKING

from grpo_megatron.models.weight_rules import WeightRule

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that need it: importing the bridge stays cheap.

Reader = Callable[[str, "int | None", int, int], "torch.Tensor"]
"""``read(hf_name, dim, start, stop)``: rows/columns ``start:stop`` of ``hf_name`` along ``dim``;
``dim=None`` reads the whole tensor."""


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
        if partition_dim is None or not split:
            return read(rule.hf[0], None, 0, 0)
        n = canonical_shape[partition_dim] // size
        return read(rule.hf[0], partition_dim, rank * n, (rank + 1) * n)
    if split and partition_dim != 0:
        raise ValueError(
            f"{rule.mcore}: kind {rule.kind!r} can only be split along dim 0, not {partition_dim}"
        )
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
        [
            q.reshape(groups, q_rows, *rest),
            k.reshape(groups, g.head_dim, *rest),
            v.reshape(groups, g.head_dim, *rest),
        ],
        dim=1,
    )
    return fused.reshape(-1, *rest)
