"""Batch-invariant numerics (``rollout.true_on_policy``): a token's logits, bit for bit, whatever other
tokens share its forward pass.

The rollout engine under ``rollout.true_on_policy`` is the trainer's own megatron-core model
(``training/policy_engine.py``): it computes the logits of position ``t`` from a forward of the prefix
``0..t`` beside the other sequences of a decode step, the trainer computes them from a forward of the
whole packed micro-batch. The two agree bitwise only where no kernel's result for one row depends on
the rest of the batch. Three places do on CPU, and are replaced while the switch is on:

- **Matrix products.** A GEMM's reduction order can depend on the number of rows (seen: fp32
  ``F.linear`` of one row and of 300 differs on an AVX2 EPYC; bf16 at M=17 on an AMX Xeon, GUIDE
  section 12). ``BatchInvariantMode`` (a ``TorchFunctionMode``) routes every ``F.linear``,
  ``torch.matmul``/``@`` with a 2-D right operand, ``torch.mm`` and ``torch.addmm`` through
  ``tiled_rows_mm``: the rows padded with zeros to a multiple of ``ROW_TILE`` (16), one product,
  the padding dropped. Every row then goes through a GEMM of at least 16 rows, whose per-row result
  was seen not to depend on the row count or on the row's place (``tests/test_true_on_policy.py``
  checks it on the machine it runs on). The same idea as the batch-invariant ops of Thinking Machines
  ("Defeating Nondeterminism in LLM Inference", 2025) and SGLang's ``enable_deterministic_inference``,
  which fix a GEMM's split instead of letting the batch choose it.
- **Attention.** SDPA's CPU kernels block queries and keys by the sequence's length, so position
  ``t`` of a sequence of ``n`` tokens and of its prefix of ``t + 1`` reduce otherwise.
  ``aligned_attention`` lays each segment's keys and values at positions ``0..n-1`` of a fixed width
  ``key_length`` (the job's longest sequence, rounded up to ``ROW_TILE``), zeros beyond: each query's
  softmax and weighted sum then run over the same ``key_length`` entries, the masked ones exactly
  zero, whatever the segment's length (``LocalCoreAttention(key_length=...)``). Every segment of a
  pass (and every key/value head) is one item of the same shape, and the items go through batched
  products of ``ITEM_TILE`` items each (``tiled_items_bmm``): one call per 16 items, not one per
  segment and head.
- **Tensor-parallel sums** need nothing: two ranks' partial sums add commutatively (``a + b = b + a``),
  which is why the switch allows TP and EP of at most 2 ranks (``validation.true_on_policy_errors``).

Everything else the supported models run per token is a row-wise op whose result for a row depends
on that row only: RMSNorm (``models/local_norm.py``), rotary embeddings (positions restart per
segment), the MoE router's softmax and top-k, the experts (through the products above), the
combine (each token's expert outputs summed in expert order), the vocab-parallel log-softmax
(``models/logprobs.py``). Backward passes go through the same ops (results equal to the plain ones
up to rounding; only the forward is compared).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_TILE = 16
"""Rows are padded to a multiple of this before every product (and a key width to it)."""


def _zero_padded(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` with zeros appended along its first dimension up to a multiple of ``multiple``."""
    pad = -x.shape[0] % multiple
    return torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) if pad else x


def tiled_rows_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a [M, K]``, ``b [K, N]``, with ``a``'s rows padded to a multiple of ``ROW_TILE``."""
    return torch.mm(_zero_padded(a, ROW_TILE), b)[: a.shape[0]]


def _rows_matmul(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ b [K, N]`` through ``tiled_rows_mm``."""
    out = tiled_rows_mm(x.reshape(-1, x.shape[-1]), b)
    return out.view(*x.shape[:-1], b.shape[-1])


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = _rows_matmul(x, weight.t())
    return out + bias if bias is not None else out


def _matmul(a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor | None:
    """The row-tiled product where it applies (``a`` rows of a 2-D ``b``), else None (the plain op)."""
    if kwargs or not isinstance(b, torch.Tensor) or b.dim() != 2 or a.dim() < 2:
        return None
    return _rows_matmul(a, b)


def _addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1
) -> torch.Tensor:
    out = tiled_rows_mm(a, b)
    out = out if alpha == 1 else out * alpha
    return out + (bias if beta == 1 else bias * beta)


class BatchInvariantMode(TorchFunctionMode):
    """While active (``with BatchInvariantMode():``, on every rank around every forward of the policy
    and of its engine), products of the module docstring's kinds go through ``tiled_rows_mm``."""

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            return _linear(*args, **kwargs)
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            out = _matmul(*args, **kwargs)
            if out is not None:
                return out
        elif func is torch.mm and not kwargs:
            return tiled_rows_mm(*args)
        elif func is torch.addmm and set(kwargs) <= {"beta", "alpha"}:
            return _addmm(*args, **kwargs)
        return func(*args, **kwargs)


def key_width(longest: int) -> int:
    """The attention key width of a job whose sequences are at most ``longest`` tokens."""
    return -(-longest // ROW_TILE) * ROW_TILE


ITEM_TILE = 16
"""Attention items (segment x key/value head) per batched product: a fixed batch of fixed shapes."""

_CHUNK_BYTES = 64 << 20
"""A product of ``ITEM_TILE`` items over wide keys is cut to fewer items (a job's constant)."""


def tiled_items_bmm(a_bmk: torch.Tensor, b_bkn: torch.Tensor, items: int) -> torch.Tensor:
    """``torch.bmm`` of ``[B, M, K] x [B, K, N]`` in products of exactly ``items`` items (the last
    padded with zeros): every item goes through a product of one shape, wherever it lies and
    whatever shares it (checked by ``tests/test_true_on_policy.py`` on the machine it runs on)."""
    count = a_bmk.shape[0]
    a_bmk, b_bkn = (_zero_padded(t, items).contiguous() for t in (a_bmk, b_bkn))
    out = [torch.bmm(a_bmk[i : i + items], b_bkn[i : i + items]) for i in range(0, a_bmk.shape[0], items)]
    return torch.cat(out)[:count]


def segment_index(
    bounds: list[int], key_length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[S, key_length]`` token index of each position of each non-empty segment of a packed
    sequence of ``bounds[-1]`` tokens, beyond its end ``bounds[-1]`` (one past the last token);
    ``[S, key_length]`` True where a position is inside its segment)."""
    pairs = [(start, end) for start, end in zip(bounds[:-1], bounds[1:], strict=True) if end > start]
    pairs = pairs or [(0, 0)]  # no tokens: one empty segment
    longest = max(end - start for start, end in pairs)
    if longest > key_length:
        raise ValueError(
            f"a sequence of {longest} tokens is longer than the attention key width {key_length} of "
            "rollout.true_on_policy (data.max_prompt_tokens + the response budget)"
        )
    starts_s, ends_s = (
        torch.tensor(col, dtype=torch.long, device=device).view(-1, 1) for col in zip(*pairs, strict=True)
    )
    index_sk = starts_s + torch.arange(key_length, device=device)
    inside_sk = index_sk < ends_s
    return index_sk.masked_fill(~inside_sk, bounds[-1]), inside_sk


def aligned_attention(
    query_lhd: torch.Tensor,
    key_lhd: torch.Tensor,
    value_lhd: torch.Tensor,
    bounds: list[int],
    *,
    scale: float,
    key_length: int,
) -> torch.Tensor:
    """Causal attention within each segment ``bounds[i] .. bounds[i+1]`` of a packed sequence,
    ``[L, H, Dk] x [L, Hkv, Dk] x [L, Hkv, Dv] -> [L, H, Dv]``, in fp32, every segment laid out at a
    fixed width: its ``n`` tokens at positions ``0..n-1`` of ``key_length``, zeros after, for the
    queries as for the keys and values. Each (segment, key/value head) is one item of ``[key_length *
    groups, Dk] x [Dk, key_length]`` scores, masked causally (-inf, exactly 0 after the softmax), and
    ``[key_length * groups, key_length] x [key_length, Dv]`` outputs, in products of ``ITEM_TILE``
    items (``tiled_items_bmm``): query ``t``'s output depends on keys and values ``0..t`` of its
    segment and on ``key_length`` only, not on the segment's length or on the other segments."""
    total, heads, _ = query_lhd.shape
    if bounds[-1] != total:  # the index past the last token must be laid_out's zero row
        raise ValueError(f"cu_seqlens ends at {bounds[-1]}, the packed sequence has {total} tokens")
    kv_heads, width = key_lhd.shape[1], key_length
    groups = heads // kv_heads
    index_sk, inside_sk = segment_index(bounds, width, query_lhd.device)
    segments = index_sk.shape[0]

    def laid_out(
        x_lhd: torch.Tensor,
    ) -> torch.Tensor:  # [S, width, h, d], zeros beyond each segment (row total)
        x_lhd = x_lhd.float()
        return torch.cat([x_lhd, x_lhd.new_zeros((1, *x_lhd.shape[1:]))])[index_sk]

    # one item per (segment, key/value head); its rows (position t, query head j of the group): t * groups + j
    q_bmd = laid_out(query_lhd).view(segments, width, kv_heads, groups, -1).transpose(1, 2)
    q_bmd = q_bmd.reshape(segments * kv_heads, width * groups, -1)
    k_bdk = laid_out(key_lhd).permute(0, 2, 3, 1).reshape(segments * kv_heads, -1, width)
    v_bkd = laid_out(value_lhd).transpose(1, 2).reshape(segments * kv_heads, width, -1)
    items = max(1, min(ITEM_TILE, _CHUNK_BYTES // (4 * width * groups * width)))
    position = torch.arange(width, device=query_lhd.device)
    blocked_mk = (position[None, :] > position[:, None]).repeat_interleave(groups, dim=0)
    scores_bmk = (tiled_items_bmm(q_bmd, k_bdk, items) * scale).masked_fill(blocked_mk, float("-inf"))
    out_bmd = tiled_items_bmm(torch.softmax(scores_bmk, dim=-1), v_bkd, items)
    out_skhd = out_bmd.view(segments, kv_heads, width, groups, -1).transpose(1, 2)
    out_skhd = out_skhd.reshape(segments, width, heads, -1)
    out_lhd = query_lhd.new_zeros((total, heads, value_lhd.shape[2]))
    out_lhd[index_sk[inside_sk]] = out_skhd[inside_sk].to(out_lhd.dtype)
    return out_lhd
