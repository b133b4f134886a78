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
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PackedRows:
    """Where each row of a packed micro-batch lies in its sequence: row ``b`` takes a slot of
    ``slots[b]`` tokens (its ``lengths[b]`` tokens, then padding), the slots end to end."""

    lengths: tuple[int, ...]
    """Tokens of each row, in row order."""
    slots: tuple[int, ...] | None = None
    """Tokens each row occupies in the sequence (>= its length; context parallelism needs every row
    a multiple of 2 x cp long); None = the lengths (no padding between rows)."""

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"packed rows need lengths >= 1, got {list(self.lengths)}")
        if self.slots is not None and (
            len(self.slots) != len(self.lengths)
            or any(s < n for s, n in zip(self.slots, self.lengths, strict=True))
        ):
            raise ValueError(f"slots {list(self.slots)} must hold the rows' lengths {list(self.lengths)}")

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.lengths if self.slots is None else self.slots

    @property
    def total(self) -> int:
        """Tokens of the packed sequence (row padding included)."""
        return sum(self.sizes)

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    def padded_to(self, multiple: int) -> PackedRows:
        """The same rows, each slot rounded up to a multiple of ``multiple`` tokens."""
        return PackedRows(self.lengths, tuple(-(-n // multiple) * multiple for n in self.lengths))

    def cu_seqlens(self, pad_to: int | None = None) -> torch.Tensor:
        """Cumulative slot sizes ``[0, n_0, n_0 + n_1, ...]`` (int32, megatron/TE's convention). With
        ``pad_to`` > total, the tail ``total .. pad_to`` is one more segment: padding tokens then only
        attend to padding, and every token of the sequence belongs to some segment."""
        sizes = list(self.sizes)
        if pad_to is not None and pad_to > self.total:
            sizes.append(pad_to - self.total)
        return torch.tensor([0, *sizes], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def _index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, column, position in the sequence) of every real token."""
        lengths_b = torch.tensor(self.lengths)
        rows_t = torch.repeat_interleave(torch.arange(len(self.lengths)), lengths_b)
        starts_b = torch.tensor([0, *self.sizes[:-1]]).cumsum(0)
        firsts_b = lengths_b.cumsum(0) - lengths_b
        cols_t = torch.arange(int(lengths_b.sum())) - firsts_b[rows_t]
        return rows_t.to(device), cols_t.to(device), (starts_b[rows_t] + cols_t).to(device)

    def unpack(self, x_t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Packed ``[T, ...]`` (or longer: a padded tail is ignored) -> right-padded ``[B, S, ...]``
        with ``fill`` past each row's end. Differentiable (gradients flow back to ``x_t``)."""
        rows_t, cols_t, at_t = self._index(x_t.device)
        out_bs = x_t.new_full((len(self.lengths), self.max_length, *x_t.shape[1:]), fill)
        return out_bs.index_put((rows_t, cols_t), x_t[at_t])

    def pack(self, x_bs: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Right-padded ``[B, S', ...]`` rows (``S' >= S``) -> packed ``[T, ...]`` (``fill`` in the
        slots' padding)."""
        rows_t, cols_t, at_t = self._index(x_bs.device)
        out_t = x_bs.new_full((self.total, *x_bs.shape[2:]), fill)
        return out_t.index_put((at_t,), x_bs[rows_t, cols_t])

    def position_ids(self) -> torch.Tensor:
        """Positions restarting at 0 at the start of every slot, ``[T]``."""
        sizes = torch.tensor(self.sizes)
        starts = sizes.cumsum(0) - sizes
        return torch.arange(self.total) - torch.repeat_interleave(starts, sizes)


def packed_seq_params(
    rows: PackedRows, total_len: int, device: torch.device, cp_group: dist.ProcessGroup | None = None
) -> Any:
    """megatron's ``PackedSeqParams`` for ``rows`` packed into a sequence of ``total_len`` tokens
    (a tail past the rows is one padding segment, see ``PackedRows.cu_seqlens``). Slots wider than
    their rows (context parallelism) go in ``cu_seqlens_*_padded``, as TransformerEngine expects;
    megatron's RoPE and our local attention read those when present."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = rows.cu_seqlens(pad_to=total_len).to(device)
    padded = None
    if rows.slots is not None:
        padded = cu_seqlens
        cu_seqlens = _real_cu_seqlens(rows, total_len).to(device)
    bounds = cu_seqlens if padded is None else padded
    max_len = int((bounds[1:] - bounds[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
        cp_group=cp_group,
    )


def _real_cu_seqlens(rows: PackedRows, total_len: int) -> torch.Tensor:
    """TE's unpadded ``cu_seqlens``: cumulative row lengths (the tail segment counts whole)."""
    tail = [total_len - rows.total] if total_len > rows.total else []
    return torch.tensor([0, *rows.lengths, *tail], dtype=torch.int32).cumsum(0, dtype=torch.int32)


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
