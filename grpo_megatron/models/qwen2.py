"""Qwen2 / Qwen2.5 (dense): GQA with QKV bias, SwiGLU, RMSNorm, RoPE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_megatron.models.adapter import HFConfigError, ModelAdapter


class Qwen2Adapter(ModelAdapter):
    model_type = "qwen2"

    def transformer_config_kwargs(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        self.reject_rope_scaling(hf)
        if hf.get("use_sliding_window"):
            raise HFConfigError(
                "qwen2: use_sliding_window=true is not supported (megatron's local attention has no "
                "window): set use_sliding_window=false in config.json or model.hf_overrides"
            )
        return {
            **self.dense_attention_kwargs(hf),
            "add_qkv_bias": True,  # Qwen2 has biases on q, k and v projections only
            "ffn_hidden_size": int(self.get(hf, "intermediate_size")),
        }
