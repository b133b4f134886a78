"""Registry of architecture adapters, keyed on the exact Hugging Face ``model_type``.

Exact keys, never substring matching: ``qwen2_moe`` must not silently resolve to ``qwen2``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_megatron.models.adapter import ModelAdapter
from grpo_megatron.models.deepseek_v3 import DeepseekV3Adapter
from grpo_megatron.models.mixtral import MixtralAdapter
from grpo_megatron.models.qwen2 import Qwen2Adapter
from grpo_megatron.models.qwen3 import Qwen3Adapter
from grpo_megatron.models.qwen3_moe import Qwen3MoeAdapter

ADAPTERS: Mapping[str, type[ModelAdapter]] = {
    cls.model_type: cls
    for cls in (Qwen2Adapter, Qwen3Adapter, Qwen3MoeAdapter, DeepseekV3Adapter, MixtralAdapter)
}


class UnsupportedModelError(ValueError):
    pass


def get_adapter(hf_or_model_type: Mapping[str, Any] | str) -> ModelAdapter:
    """The adapter for an HF config dict (or a ``model_type`` string)."""
    if isinstance(hf_or_model_type, str):
        model_type = hf_or_model_type
    else:
        model_type = hf_or_model_type.get("model_type")  # type: ignore[assignment]
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"model_type={model_type!r} (config.json 'model_type') is not supported; supported: "
            f"{', '.join(sorted(ADAPTERS))}. Add an adapter in grpo_megatron/models/ to support it."
        )
    return ADAPTERS[model_type]()
