"""Core attention without TransformerEngine: packed sequences (THD) and multi-latent attention.

``LocalCoreAttention`` is megatron's local ``DotProductAttention`` plus packed sequences: given
``PackedSeqParams`` (training/packing.py) it runs causal attention segment by segment along
``cu_seqlens``, so rows never see each other and memory grows with the sum of the squared row
lengths, not the square of the packed length (no dense ``[T, T]`` mask). The builder puts it in
the local layer spec; with TransformerEngine, TE's varlen attention reads the same parameters.

megatron-core's local ``DotProductAttention`` (0.16.1) assumes one head width for queries, keys
and values; MLA has query/key heads of ``qk_head_dim + qk_pos_emb_head_dim`` and value heads of
``v_head_dim``, and ``MLASelfAttention`` passes ``k_channels``/``v_channels`` that only the TE
module accepts. This module is what the builder puts in the DeepSeek-V3 layer spec in place of
the local one (through megatron's ModuleSpec mechanism, not by patching megatron). On GPUs with
TransformerEngine, TE's attention is used instead.

Shape legend: S sequence, B batch, T packed tokens, H attention heads on this TP rank, Dk
query/key head width, Dv value head width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def segment_attention(
    query_thd: torch.Tensor,
    key_thd: torch.Tensor,
    value_thd: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    dropout_p: float,
) -> torch.Tensor:
    """Causal attention within each segment ``cu_seqlens[i] .. cu_seqlens[i+1]`` of a packed
    sequence, ``[T, H, Dk] x [T, Hkv, Dk] x [T, Hkv, Dv] -> [T, H, Dv]``. Grouped-query attention:
    ``H`` a multiple of ``Hkv``. One SDPA call per segment: the work and memory of attention are those
    of the rows alone."""
    groups = query_thd.shape[1] // key_thd.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        q_hsd, k_hsd, v_hsd = (t[start:end].transpose(0, 1) for t in (query_thd, key_thd, value_thd))
        if groups > 1:
            k_hsd, v_hsd = (t.repeat_interleave(groups, dim=0) for t in (k_hsd, v_hsd))
        outs.append(
            F.scaled_dot_product_attention(q_hsd, k_hsd, v_hsd, is_causal=True, dropout_p=dropout_p, scale=scale)
        )
    return torch.cat(outs, dim=1).transpose(0, 1)


def _check_packed(packed_seq_params, config: TransformerConfig, who: str) -> None:
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"{who}: packed sequences must be in the thd format, got {packed_seq_params.qkv_format!r}")
    if config.context_parallel_size != 1:
        raise ValueError(f"{who}: context parallelism needs TransformerEngine's attention")
    if config.window_size is not None:
        raise ValueError(f"{who}: sliding-window attention of packed sequences needs TransformerEngine")


class LocalCoreAttention(DotProductAttention):
    """megatron's local ``DotProductAttention``, plus packed sequences (``segment_attention``)."""

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        _check_packed(packed_seq_params, self.config, "LocalCoreAttention")
        # megatron's local attention divides the scores by the layer number under query-key layer
        # scaling and multiplies them back in its fp32 softmax: the net scale is the unscaled one.
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        out_thd = segment_attention(
            query,
            key,
            value,
            packed_seq_params.cu_seqlens_q,
            scale=scale,
            dropout_p=self.config.attention_dropout if self.training else 0.0,
        )
        return out_thd.reshape(out_thd.shape[0], -1)


class LocalMLACoreAttention(MegatronModule):
    """softmax(Q K^T * scale + mask) V with separate key and value head widths (causal)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("LocalMLACoreAttention does not support context parallelism: use TransformerEngine")
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query_sbhd: torch.Tensor,
        key_sbhd: torch.Tensor,
        value_sbhd: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            _check_packed(packed_seq_params, self.config, "LocalMLACoreAttention")
            out_thd = segment_attention(
                query_sbhd,
                key_sbhd,
                value_sbhd,
                packed_seq_params.cu_seqlens_q,
                scale=self.softmax_scale,
                dropout_p=self.dropout_p if self.training else 0.0,
            )
            return out_thd.reshape(out_thd.shape[0], -1)
        s, b, h, _ = query_sbhd.shape
        q_bhsd, k_bhsd, v_bhsd = (t.permute(1, 2, 0, 3) for t in (query_sbhd, key_sbhd, value_sbhd))
        # megatron's masks are True where attention is NOT allowed; SDPA's bool masks the opposite.
        mask = None if attention_mask is None else ~attention_mask
        out_bhsd = F.scaled_dot_product_attention(
            q_bhsd,
            k_bhsd,
            v_bhsd,
            attn_mask=mask,
            is_causal=attention_mask is None,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale,
        )
        return out_bhsd.permute(2, 0, 1, 3).reshape(s, b, -1)
