"""Tiny Hugging Face configs, one per supported ``model_type``, shared by the model and bridge tests.

``tiny_hf_config`` goes through ``transformers.AutoConfig.for_model`` so the dicts are exactly what a
real ``config.json`` holds (every default filled in): the adapters are tested against real keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe.yaml"
"""The tiny MoE job config most config tests start from."""

_COMMON: dict[str, Any] = {
    "vocab_size": 61,  # not a multiple of 8 (or 16 at TP2): padding is exercised
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.1,  # larger than usual so routing and logits are far from uniform
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": _COMMON
    | {
        "model_type": "qwen2",
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "use_sliding_window": False,
    },
    "qwen3": _COMMON
    | {
        "model_type": "qwen3",
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": _COMMON
    | {
        "model_type": "qwen3_moe",
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mixtral": _COMMON
    | {
        "model_type": "mixtral",
        "num_key_value_heads": 2,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
    "deepseek_v3": _COMMON
    | {
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,  # transformers' DeepSeek-V3 needs equal counts (see GUIDE)
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "rope_interleave": True,
        "rope_scaling": None,
    },
}


def tiny_hf_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """A tiny config dict for ``model_type`` as transformers would write it to config.json."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**(TINY_CONFIGS[model_type] | overrides)).to_dict()
