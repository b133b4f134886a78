"""Sequence packing: the rows of a micro-batch laid end to end in one sequence (megatron's THD format).

Shape legend: B rows, S the longest row, T = sum of the row lengths (the packed sequence).

A padded micro-batch of rows with lengths ``n_b`` costs ``B x max(n_b)`` tokens of compute; packed,
it costs ``sum(n_b)``. Attention must not cross rows and RoPE positions must restart per row: the
model gets megatron's ``PackedSeqParams`` (cumulative row lengths, ``qkv_format="thd"``), which
TransformerEngine's varlen attention and our local attention (models/local_attention.py) read,
and which megatron's RoPE uses to restart positions at every ``cu_seqlens`` boundary.

Everything the trainer reads per token (logprobs, entropy, and with routing replay the expert
routes) comes out of the model in packed order; ``PackedRows.unpack`` turns it back into
right-padded rows and ``PackedRows.pack`` goes the other way, so the loss functions and the rest
of the trainer see the same ``[B, S]`` tensors with or without packing.

Bin-packing rule (``first_fit_decreasing``): rows sorted longest first (ties by index) each go into
the first micro-batch whose token total stays within the budget, else open a new one. A row longer
than the budget gets a micro-batch of its own. With a row cap instead of a token budget
(``train.max_tokens_per_micro_batch`` unset), consecutive rows of the sorted order are grouped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """Where each row of a packed micro-batch lies in its sequence of ``sum(lengths)`` tokens."""

    lengths: tuple[int, ...]
    """Tokens of each row, in row order (the packed sequence holds them end to end)."""

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"packed rows need lengths >= 1, got {list(self.lengths)}")

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    def cu_seqlens(self, pad_to: int | None = None) -> torch.Tensor:
        """Cumulative lengths ``[0, n_0, n_0 + n_1, ...]`` (int32, megatron/TE's convention). With
        ``pad_to`` > total, the tail ``total .. pad_to`` is one more segment: padding tokens then only
        attend to padding, and every token of the sequence belongs to some segment."""
        lengths = list(self.lengths)
        if pad_to is not None and pad_to > self.total:
            lengths.append(pad_to - self.total)
        return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def _index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows_t = torch.repeat_interleave(torch.arange(len(self.lengths)), torch.tensor(self.lengths))
        starts_b = torch.tensor([0, *self.lengths[:-1]]).cumsum(0)
        cols_t = torch.arange(self.total) - starts_b[rows_t]
        return rows_t.to(device), cols_t.to(device)

    def unpack(self, x_t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Packed ``[T, ...]`` (or longer: a padded tail is ignored) -> right-padded ``[B, S, ...]``
        with ``fill`` past each row's end. Differentiable (gradients flow back to ``x_t``)."""
        rows_t, cols_t = self._index(x_t.device)
        out_bs = x_t.new_full((len(self.lengths), self.max_length, *x_t.shape[1:]), fill)
        return out_bs.index_put((rows_t, cols_t), x_t[: self.total])

    def pack(self, x_bs: torch.Tensor) -> torch.Tensor:
        """Right-padded ``[B, S', ...]`` rows (``S' >= S``) -> packed ``[T, ...]``."""
        rows_t, cols_t = self._index(x_bs.device)
        return x_bs[rows_t, cols_t]

    def position_ids(self) -> torch.Tensor:
        """Positions restarting at 0 at the start of every row, ``[T]``."""
        return self._index(torch.device("cpu"))[1]


def packed_seq_params(rows: PackedRows, total_len: int, device: torch.device):
    """megatron's ``PackedSeqParams`` for ``rows`` packed into a sequence of ``total_len`` tokens
    (a tail past the rows is one padding segment, see ``PackedRows.cu_seqlens``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = rows.cu_seqlens(pad_to=total_len).to(device)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


def first_fit_decreasing(lengths: Sequence[int], indices: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Bins of ``indices`` whose lengths sum to at most ``max_tokens`` (a longer row gets a bin of
    its own): longest first, each row into the first bin it fits (see the module docstring)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for k, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[k].append(i)
                loads[k] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins
