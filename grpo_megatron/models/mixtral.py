"""Mixtral: GQA without biases, softmax top-k routing (renormalised over the top-k), SwiGLU experts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_megatron.models.adapter import HFConfigError, ModelAdapter
from grpo_megatron.models.weight_rules import WeightRule, copy


class MixtralAdapter(ModelAdapter):
    model_type = "mixtral"

    def num_experts(self, hf: Mapping[str, Any]) -> int | None:
        return int(self.get(hf, "num_local_experts"))

    def transformer_config_kwargs(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        self.reject_rope_scaling(hf)
        window = hf.get("sliding_window")
        if window is not None and window < int(self.get(hf, "max_position_embeddings")):
            raise HFConfigError(
                f"mixtral: sliding_window={window} is not supported (megatron's local attention has "
                "no window): set sliding_window=null in config.json or model.hf_overrides"
            )
        return {
            **self.dense_attention_kwargs(hf),
            "ffn_hidden_size": int(self.get(hf, "intermediate_size")),
            "num_moe_experts": self.num_experts(hf),
            "moe_router_topk": int(self.get(hf, "num_experts_per_tok")),
            "moe_router_pre_softmax": False,  # softmax over all experts, then renormalised top-k
            "moe_router_score_function": "softmax",
        }

    def mlp_rules(self, hf: Mapping[str, Any], layer: int, m: str, h: str) -> list[WeightRule]:
        moe = h + "block_sparse_moe."
        # Mixtral's w1 is the gate, w3 the up projection, w2 the down projection.
        return [
            copy(m + "router.weight", moe + "gate.weight"),
            *self.expert_rules(hf, m, moe + "experts.", "w1", "w3", "w2"),
        ]
