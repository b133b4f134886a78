"""Tiny Hugging Face configs, one per supported ``model_type``, made by transformers itself.

Going through ``transformers.AutoConfig.for_model`` keeps the dicts exactly what a real
``config.json`` holds (every default filled in), so the adapters are tested against real keys.
"""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

TINY: dict[str, dict[str, Any]] = {
    "qwen2": {"num_key_value_heads": 2, "intermediate_size": 96},
    "qwen3": {"num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96},
    "qwen3_moe": {
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "mixtral": {"num_key_value_heads": 2, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {
        # transformers' DeepSeek-V3 needs num_key_value_heads == num_attention_heads (GUIDE.md).
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "rope_scaling": None,
    },
}


def tiny_hf_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """A tiny config dict for ``model_type`` as transformers would write it to config.json."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **(_COMMON | TINY[model_type] | overrides))
    return config.to_dict()
