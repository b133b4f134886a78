"""Qwen3 (dense): GQA with per-head RMSNorm on queries and keys, SwiGLU, RMSNorm, RoPE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_megatron.models.adapter import ModelAdapter


class Qwen3Adapter(ModelAdapter):
    model_type = "qwen3"

    def qwen3_attention_kwargs(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        self.reject_rope_scaling(hf)
        return {
            **self.dense_attention_kwargs(hf),
            "add_qkv_bias": bool(hf.get("attention_bias", False)),
            "qk_layernorm": True,  # q_norm / k_norm: RMSNorm over head_dim, before RoPE
        }

    def transformer_config_kwargs(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        return {
            **self.qwen3_attention_kwargs(hf),
            "ffn_hidden_size": int(self.get(hf, "intermediate_size")),
        }
