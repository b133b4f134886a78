"""Qwen3-MoE: Qwen3 attention, softmax top-k routing over fine-grained experts, no shared expert."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_megatron.models.qwen3 import Qwen3Adapter
from grpo_megatron.models.weight_rules import WeightRule, copy


class Qwen3MoeAdapter(Qwen3Adapter):
    model_type = "qwen3_moe"

    def num_experts(self, hf: Mapping[str, Any]) -> int | None:
        # Hub checkpoints say num_experts; transformers 5 writes the same value as num_local_experts.
        return int(hf.get("num_experts") or self.get(hf, "num_local_experts"))

    def dense_layers(self, hf: Mapping[str, Any]) -> set[int]:
        # transformers: layer i is sparse iff i not in mlp_only_layers and (i+1) % decoder_sparse_step == 0
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        only_mlp = set(hf.get("mlp_only_layers") or [])
        return {i for i in range(self.num_layers(hf)) if i in only_mlp or (i + 1) % step != 0}

    def transformer_config_kwargs(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        return {
            **self.qwen3_attention_kwargs(hf),
            "ffn_hidden_size": int(hf.get("intermediate_size") or self.get(hf, "moe_intermediate_size")),
            "num_moe_experts": self.num_experts(hf),
            "moe_ffn_hidden_size": int(self.get(hf, "moe_intermediate_size")),
            "moe_router_topk": int(self.get(hf, "num_experts_per_tok")),
            # norm_topk_prob=True renormalises the top-k softmax probabilities, which equals a
            # softmax over the top-k logits (megatron's pre_softmax=False); False keeps the
            # full-softmax probabilities of the chosen experts (pre_softmax=True).
            "moe_router_pre_softmax": not bool(hf.get("norm_topk_prob", True)),
            "moe_router_score_function": "softmax",
            "moe_layer_freq": self.moe_layer_pattern(self.num_layers(hf), self.dense_layers(hf)),
        }

    def mlp_rules(self, hf: Mapping[str, Any], layer: int, m: str, h: str) -> list[WeightRule]:
        if layer in self.dense_layers(hf):
            return self.swiglu_rules(m, h + "mlp.")
        return [
            copy(m + "router.weight", h + "mlp.gate.weight"),
            *self.expert_rules(hf, m, h + "mlp.experts."),
        ]
