"""Core attention without TransformerEngine: packed sequences (THD), context parallelism, and
multi-latent attention (MLA), in one module the builder puts in every local layer spec.

megatron-core's local ``DotProductAttention`` (0.16.1) refuses packed sequences and context
parallelism (both need TransformerEngine) and assumes one head width for queries, keys and values,
which MLA breaks (query/key heads of ``qk_head_dim + qk_pos_emb_head_dim``, value heads of
``v_head_dim``; ``MLASelfAttention`` passes ``k_channels``/``v_channels`` that only the TE module
accepts). ``LocalCoreAttention`` takes its place through megatron's ModuleSpec mechanism (not by
patching megatron); on GPUs with TransformerEngine, TE's attention is used instead.

- Right-padded rows: causal SDPA over ``[B, H, S, S]``.
- Packed rows (``PackedSeqParams``, training/packing.py): one causal SDPA per segment of
  ``cu_seqlens``, so rows never see each other and memory grows with the sum of the squared row
  lengths, not the square of the packed length (no dense ``[T, T]`` mask).
- Context parallelism (packed only): this rank holds two chunks of every segment
  (distributed/context_parallel.py); keys and values are gathered over the CP group and each local
  query attends to the keys at or before its position in its segment.
- Batch-invariant (``key_length`` set: ``rollout.true_on_policy``): each segment, or right-padded
  row, through ``models/batch_invariant.py:aligned_attention``, whose result for a query does not
  depend on the segment's length or on the other segments.

Shape legend: S sequence, B batch, T packed tokens (L of them on this CP rank), H attention heads
on this TP rank (Hkv key/value heads), Dk query/key head width, Dv value head width.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from grpo_megatron.distributed.context_parallel import gather_keys_values, local_index


def segment_attention(
    query_lhd: torch.Tensor,
    key_lhd: torch.Tensor,
    value_lhd: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    dropout_p: float,
    cp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Causal attention within each segment ``cu_seqlens[i] .. cu_seqlens[i+1]`` of a packed
    sequence, ``[L, H, Dk] x [L, Hkv, Dk] x [L, Hkv, Dv] -> [L, H, Dv]`` (grouped-query: ``H`` a
    multiple of ``Hkv``). Without context parallelism ``L = T``; with it, the tensors hold this CP
    rank's chunks and ``cu_seqlens`` describes the whole sequence."""
    groups = query_lhd.shape[1] // key_lhd.shape[1]
    cp = 1 if cp_group is None else cp_group.size()
    if cp_group is not None and cp > 1:
        key_lhd = gather_keys_values(key_lhd, cu_seqlens, cp_group)
        value_lhd = gather_keys_values(value_lhd, cu_seqlens, cp_group)
        position_l = local_index(cu_seqlens, cp, cp_group.rank()).to(query_lhd.device)
    bounds = cu_seqlens.tolist()
    if cp == 1:
        return _attention_by_length(
            query_lhd, key_lhd, value_lhd, bounds, groups, scale=scale, dropout_p=dropout_p
        )
    outs, q_start = [], 0
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        k_hsd, v_hsd = (t[start:end].transpose(0, 1) for t in (key_lhd, value_lhd))
        if groups > 1:
            k_hsd, v_hsd = (t.repeat_interleave(groups, dim=0) for t in (k_hsd, v_hsd))
        q_len = (end - start) // cp
        q_hqd = query_lhd[q_start : q_start + q_len].transpose(0, 1)
        if cp == 1:
            out = F.scaled_dot_product_attention(
                q_hqd, k_hsd, v_hsd, is_causal=True, dropout_p=dropout_p, scale=scale
            )
        else:  # this rank's queries sit at two places of the segment: mask by position
            q_pos = position_l[q_start : q_start + q_len] - start
            allowed_qs = torch.arange(end - start, device=q_pos.device)[None, :] <= q_pos[:, None]
            out = F.scaled_dot_product_attention(
                q_hqd, k_hsd, v_hsd, attn_mask=allowed_qs, dropout_p=dropout_p, scale=scale
            )
        outs.append(out)
        q_start += q_len
    return torch.cat(outs, dim=1).transpose(0, 1)


def _attention_by_length(
    query_lhd: torch.Tensor,
    key_lhd: torch.Tensor,
    value_lhd: torch.Tensor,
    bounds: list[int],
    groups: int,
    *,
    scale: float,
    dropout_p: float,
) -> torch.Tensor:
    """``segment_attention`` without context parallelism: segments of equal length attend in one
    batched causal call, one call per distinct length instead of one per segment (a micro-batch of
    hundreds of short responses would otherwise pay hundreds of calls per layer)."""
    if bounds[-1] != query_lhd.shape[0]:
        raise ValueError(
            f"cu_seqlens ends at {bounds[-1]}, the packed sequence has {query_lhd.shape[0]} tokens"
        )
    out_lhd = query_lhd.new_empty((*query_lhd.shape[:2], value_lhd.shape[2]))
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    device = query_lhd.device
    for n, starts in by_length.items():
        index_bn = (torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)).reshape(-1)
        q_bhnd, k_bhnd, v_bhnd = (
            t[index_bn].view(len(starts), n, *t.shape[1:]).transpose(1, 2)
            for t in (query_lhd, key_lhd, value_lhd)
        )
        if groups > 1:
            k_bhnd, v_bhnd = (t.repeat_interleave(groups, dim=1) for t in (k_bhnd, v_bhnd))
        out_bhnd = F.scaled_dot_product_attention(
            q_bhnd, k_bhnd, v_bhnd, is_causal=True, dropout_p=dropout_p, scale=scale
        )
        out_lhd[index_bn] = out_bhnd.transpose(1, 2).reshape(len(starts) * n, *out_lhd.shape[1:])
    return out_lhd


class LocalCoreAttention(MegatronModule):
    """softmax(Q K^T * scale, causal) V for padded rows, packed rows and context parallelism, with
    separate key and value head widths (see the module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        key_length: int | None = None,
    ) -> None:
        super().__init__(config=config)
        self.key_length = key_length
        """Batch-invariant attention over this many key positions (``rollout.true_on_policy``); None: SDPA."""
        if config.window_size is not None:
            raise ValueError("LocalCoreAttention has no sliding window: use TransformerEngine")
        k_channels = k_channels or config.kv_channels
        # megatron's query-key layer scaling divides the scores by the layer number and multiplies
        # them back in its fp32 softmax: the net scale is the plain one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_group = None if pg_collection is None else getattr(pg_collection, "cp", None)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("LocalCoreAttention: attention_bias is not supported")
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(
                    f"LocalCoreAttention: packed sequences must be thd, got {packed_seq_params.qkv_format!r}"
                )
            cp_group = packed_seq_params.cp_group or self.cp_group
            # Slots wider than their rows (context parallelism) are in the padded boundaries.
            cu_seqlens = packed_seq_params.cu_seqlens_q_padded
            if cu_seqlens is None:
                cu_seqlens = packed_seq_params.cu_seqlens_q
            if self.key_length is not None:
                return self._aligned(query, key, value, cu_seqlens.tolist()).reshape(query.shape[0], -1)
            out_lhd = segment_attention(
                query,
                key,
                value,
                cu_seqlens,
                scale=self.softmax_scale,
                dropout_p=dropout_p,
                cp_group=cp_group if cp_group is not None and cp_group.size() > 1 else None,
            )
            return out_lhd.reshape(out_lhd.shape[0], -1)
        if self.config.context_parallel_size != 1:
            raise ValueError(
                "LocalCoreAttention: context parallelism needs packed sequences (train.packing=true)"
            )
        s, b, h, _ = query.shape
        if self.key_length is not None:  # every row a segment of length s: right padding comes after
            q_lhd, k_lhd, v_lhd = (
                t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (query, key, value)
            )
            out_lhd = self._aligned(q_lhd, k_lhd, v_lhd, list(range(0, b * s + 1, s)))
            return out_lhd.view(b, s, h, -1).transpose(0, 1).reshape(s, b, -1)
        groups = h // key.shape[2]
        q_bhsd, k_bhsd, v_bhsd = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if groups > 1:
            k_bhsd, v_bhsd = (t.repeat_interleave(groups, dim=1) for t in (k_bhsd, v_bhsd))
        # megatron's masks are True where attention is NOT allowed; SDPA's bool masks the opposite.
        mask = None if attention_mask is None else ~attention_mask
        out_bhsd = F.scaled_dot_product_attention(
            q_bhsd,
            k_bhsd,
            v_bhsd,
            attn_mask=mask,
            is_causal=attention_mask is None,
            dropout_p=dropout_p,
            scale=self.softmax_scale,
        )
        return out_bhsd.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _aligned(
        self, query_lhd: torch.Tensor, key_lhd: torch.Tensor, value_lhd: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        """Batch-invariant attention of each segment ``bounds[i] .. bounds[i+1]`` (``key_length`` set)."""
        from grpo_megatron.models.batch_invariant import aligned_attention

        assert self.key_length is not None
        return aligned_attention(
            query_lhd, key_lhd, value_lhd, bounds, scale=self.softmax_scale, key_length=self.key_length
        )


# The name of the MLA-only module this one grew from.
LocalMLACoreAttention = LocalCoreAttention
