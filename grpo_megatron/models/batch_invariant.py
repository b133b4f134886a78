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
  zero, whatever the segment's length (``LocalCoreAttention(key_length=...)``).
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


def tiled_rows_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a [M, K]``, ``b [K, N]``, with ``a``'s rows padded to a multiple of ``ROW_TILE``."""
    pad = -a.shape[0] % ROW_TILE
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    out = torch.mm(a, b)
    return out[: out.shape[0] - pad] if pad else out


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


def aligned_attention(
    query_nhd: torch.Tensor, key_nhd: torch.Tensor, value_nhd: torch.Tensor, *, scale: float, key_length: int
) -> torch.Tensor:
    """Causal attention of one segment, ``[n, H, Dk] x [n, Hkv, Dk] x [n, Hkv, Dv] -> [n, H, Dv]``,
    each query's scores, softmax and weighted sum over ``key_length`` key positions (the segment's
    ``n`` at ``0..n-1``, zeros after; masked ones -inf, so exactly 0 after the softmax), in fp32:
    query ``t``'s output depends on keys and values ``0..t`` and ``key_length`` only."""
    n, heads, _ = query_nhd.shape
    if n > key_length:
        raise ValueError(
            f"a sequence of {n} tokens is longer than the attention key width {key_length} of "
            "rollout.true_on_policy (data.max_prompt_tokens + the response budget)"
        )
    kv_heads = key_nhd.shape[1]
    groups = heads // kv_heads
    keys_hld = key_nhd.new_zeros((kv_heads, key_length, key_nhd.shape[2]), dtype=torch.float32)
    values_hld = value_nhd.new_zeros((kv_heads, key_length, value_nhd.shape[2]), dtype=torch.float32)
    keys_hld[:, :n] = key_nhd.transpose(0, 1).float()
    values_hld[:, :n] = value_nhd.transpose(0, 1).float()
    device = query_nhd.device
    blocked_nl = torch.arange(key_length, device=device)[None, :] > torch.arange(n, device=device)[:, None]
    out_nhd = query_nhd.new_empty((n, heads, value_nhd.shape[2]))
    for g in range(kv_heads):
        # this key/value head's query heads, one row per (token, head): [n * groups, Dk]
        q_rd = query_nhd[:, g * groups : (g + 1) * groups].float().reshape(n * groups, -1)
        scores_rl = tiled_rows_mm(q_rd, keys_hld[g].t()) * scale
        scores_rl.view(n, groups, key_length).masked_fill_(blocked_nl[:, None, :], float("-inf"))
        probs_rl = torch.softmax(scores_rl, dim=-1)
        out_rd = tiled_rows_mm(probs_rl, values_hld[g])
        out_nhd[:, g * groups : (g + 1) * groups] = out_rd.view(n, groups, -1).to(out_nhd.dtype)
    return out_nhd
