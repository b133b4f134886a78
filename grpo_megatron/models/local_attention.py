"""Core attention for multi-latent attention (MLA) without TransformerEngine.

megatron-core's local ``DotProductAttention`` (0.16.1) assumes one head width for queries, keys
and values; MLA has query/key heads of ``qk_head_dim + qk_pos_emb_head_dim`` and value heads of
``v_head_dim``, and ``MLASelfAttention`` passes ``k_channels``/``v_channels`` that only the TE
module accepts. This module is what the builder puts in the DeepSeek-V3 layer spec in place of
the local one (through megatron's ModuleSpec mechanism, not by patching megatron). On GPUs with
TransformerEngine, TE's attention is used instead.

Shape legend: S sequence, B batch, H attention heads on this TP rank, Dk query/key head width,
Dv value head width.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class LocalMLACoreAttention(MegatronModule):
    """softmax(Q K^T * scale + mask) V with separate key and value head widths (causal)."""

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
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("LocalMLACoreAttention: packed_seq_params (THD) needs TransformerEngine; pass a mask")
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
