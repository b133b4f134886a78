"""Context parallelism over packed sequences: megatron's load-balanced split, and the gathers back.

Shape legend: T tokens of the whole packed sequence (every segment a multiple of 2 x cp long),
L = T / cp tokens held by one CP rank.

The split megatron expects (and its THD RoPE assumes): every segment ``cu_seqlens[j] ..
cu_seqlens[j+1]`` is cut into ``2 x cp`` equal chunks and CP rank ``i`` holds chunks ``i`` and
``2cp-1-i``, so with causal attention every rank has the same work (an early chunk, cheap, with a
late one, expensive). A rank's ``L`` tokens are its two chunks of segment 0, then of segment 1, ...

Two gathers undo it, differing only in their backward:
- ``gather_keys_values``: attention needs every key and value of a segment; each rank's queries
  send gradient to all keys, so the backward sums the gradients of all ranks (then takes this
  rank's slice);
- ``gather_outputs``: per-token logprobs / entropy go back to whole rows, and every CP rank then
  computes the same loss on them, so the backward only takes this rank's slice (a sum would count
  the loss cp times).
gloo has no reduce-scatter, so the backward of the first is an all-reduce and a slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def local_index(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Positions in the whole sequence of CP rank ``rank``'s ``L`` tokens (see the module docstring)."""
    bounds = cu_seqlens.tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if (end - start) % (2 * cp):
            raise ValueError(
                f"a segment of {end - start} tokens does not split into 2 x cp = {2 * cp} chunks"
            )
        chunk = (end - start) // (2 * cp)
        for k in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + k * chunk, start + (k + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def restore_index(cu_seqlens: torch.Tensor, cp: int) -> torch.Tensor:
    """For each position of the whole sequence, its place in the concatenation of every rank's ``L``
    tokens (rank 0's first): ``whole = gathered[restore_index(...)]``."""
    gathered = torch.cat([local_index(cu_seqlens, cp, r) for r in range(cp)])
    return torch.argsort(gathered)


def _all_gather(x_l: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(x_l) for _ in range(group.size())]
    dist.all_gather(parts, x_l.contiguous(), group=group)
    return torch.cat(parts)


class _GatherSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_l: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.n = group, x_l.shape[0]
        return _all_gather(x_l, group)

    @staticmethod
    def backward(ctx: Any, grad_g: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad_g = grad_g.contiguous()
        dist.all_reduce(grad_g, group=ctx.group)
        rank = ctx.group.rank()
        return grad_g[rank * ctx.n : (rank + 1) * ctx.n], None


class _GatherSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_l: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.n = group.rank(), x_l.shape[0]
        return _all_gather(x_l, group)

    @staticmethod
    def backward(ctx: Any, grad_g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_g[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None


def gather_keys_values(x_l: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's ``[L, ...]`` keys or values -> the whole sequence's ``[T, ...]``, in order;
    gradients of all ranks are summed on the way back."""
    gathered = _GatherSum.apply(x_l, group)
    return gathered[restore_index(cu_seqlens, group.size()).to(x_l.device)]


def gather_outputs(x_l: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's ``[L, ...]`` per-token outputs -> ``[T, ...]`` in order, for a loss every CP rank
    computes alike (the backward keeps this rank's slice)."""
    gathered = _GatherSlice.apply(x_l, group)
    return gathered[restore_index(cu_seqlens, group.size()).to(x_l.device)]
