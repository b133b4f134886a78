"""DeepSeek-V3: multi-latent attention, dense first layers, shared experts, sigmoid routing with a
selection-only bias (``e_score_correction_bias``), group-limited top-k and a routed scaling factor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_megatron.models.adapter import HFConfigError, ModelAdapter
from grpo_megatron.models.weight_rules import WeightRule, copy


class DeepseekV3Adapter(ModelAdapter):
    model_type = "deepseek_v3"
    config_class = "MLATransformerConfig"

    def num_experts(self, hf: Mapping[str, Any]) -> int | None:
        return int(self.get(hf, "n_routed_experts"))

    def rope_kwargs(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        if not hf.get("rope_interleave", True):
            # megatron's MLA always de-interleaves the rotary half (HF's rope_interleave=True).
            raise HFConfigError("deepseek_v3: rope_interleave=false is not supported: set it to true")
        scaling = self.rope_scaling(hf)
        if scaling is None:
            return {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
        if scaling.get("rope_type", scaling.get("type")) != "yarn":
            raise HFConfigError(f"deepseek_v3: rope scaling {scaling!r} unsupported: use yarn or none")
        return {
            "rope_type": "yarn",
            "rotary_scaling_factor": float(scaling["factor"]),
            "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
            "beta_fast": float(scaling.get("beta_fast", 32)),
            "beta_slow": float(scaling.get("beta_slow", 1)),
            "mscale": float(scaling.get("mscale", 1.0)),
            "mscale_all_dim": float(scaling.get("mscale_all_dim", 0.0)),
        }

    def transformer_config_kwargs(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        heads = int(self.get(hf, "num_attention_heads"))
        topk = int(self.get(hf, "num_experts_per_tok"))
        n_group = int(hf.get("n_group") or 1)
        topk_group = int(hf.get("topk_group") or 1)
        if n_group > 1 and topk != 2 * topk_group:
            # transformers scores a group by the sum of its top-2 experts; megatron by the sum of
            # its top-(topk // topk_group). They agree only when topk == 2 * topk_group (V3: 8, 4).
            raise HFConfigError(
                f"deepseek_v3: num_experts_per_tok={topk} with topk_group={topk_group} scores groups "
                "differently in megatron and transformers: use num_experts_per_tok = 2 * topk_group, "
                "or n_group=1"
            )
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or not hf.get("norm_topk_prob", True):
            raise HFConfigError(
                "deepseek_v3: only scoring_func='sigmoid' with norm_topk_prob=true is supported "
                "(megatron always renormalises sigmoid top-k scores)"
            )
        moe_width = int(self.get(hf, "moe_intermediate_size"))
        n_shared = int(hf.get("n_shared_experts") or 0)
        num_layers = self.num_layers(hf)
        first_dense = int(hf.get("first_k_dense_replace") or 0)
        return {
            "num_layers": num_layers,
            "hidden_size": int(self.get(hf, "hidden_size")),
            "num_attention_heads": heads,
            "num_query_groups": heads,  # MLA: every head has its own decompressed K/V
            "q_lora_rank": hf.get("q_lora_rank"),
            "kv_lora_rank": int(self.get(hf, "kv_lora_rank")),
            "qk_head_dim": int(self.get(hf, "qk_nope_head_dim")),
            "qk_pos_emb_head_dim": int(self.get(hf, "qk_rope_head_dim")),
            "v_head_dim": int(self.get(hf, "v_head_dim")),
            "kv_channels": int(self.get(hf, "v_head_dim")),
            "qk_layernorm": True,  # q_a_layernorm / kv_a_layernorm on the compressed latents
            "rotary_base": self.rope_theta(hf),
            **self.rope_kwargs(hf),
            "normalization": "RMSNorm",
            "layernorm_epsilon": float(self.get(hf, "rms_norm_eps", 1e-6)),
            "add_bias_linear": False,
            "add_qkv_bias": bool(hf.get("attention_bias", False)),
            "gated_linear_unit": True,
            "activation": "silu",
            "attention_dropout": float(hf.get("attention_dropout", 0.0) or 0.0),
            "hidden_dropout": 0.0,
            "ffn_hidden_size": int(self.get(hf, "intermediate_size")),
            "num_moe_experts": self.num_experts(hf),
            "moe_ffn_hidden_size": moe_width,
            "moe_shared_expert_intermediate_size": n_shared * moe_width if n_shared else None,
            "moe_layer_freq": self.moe_layer_pattern(num_layers, set(range(first_dense))),
            "moe_router_topk": topk,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": hf.get("topk_method", "noaux_tc") == "noaux_tc",
            # RL keeps the load-balancing bias fixed as loaded (no online bias updates).
            "moe_router_bias_update_rate": 0.0,
            "moe_router_num_groups": n_group if n_group > 1 else None,
            "moe_router_group_topk": topk_group if n_group > 1 else None,
            "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor", 1.0) or 1.0),
            "moe_router_dtype": "fp32",  # transformers computes DeepSeek-V3 router logits in fp32
        }

    def attention_rules(self, hf: Mapping[str, Any], m: str, h: str) -> list[WeightRule]:
        """Multi-latent attention: every projection keeps its HF layout (per-head [nope; rope] rows in
        q_b_proj, [k_nope; v] in kv_b_proj, [latent; rope key] in kv_a_proj_with_mqa), so all copy."""
        if hf.get("q_lora_rank"):
            q = [
                copy(m + "linear_q_down_proj.weight", h + "q_a_proj.weight"),
                copy(m + "q_layernorm.weight", h + "q_a_layernorm.weight"),
                copy(m + "linear_q_up_proj.weight", h + "q_b_proj.weight"),
            ]
        else:
            q = [copy(m + "linear_q_proj.weight", h + "q_proj.weight")]
        return [
            *q,
            copy(m + "linear_kv_down_proj.weight", h + "kv_a_proj_with_mqa.weight"),
            copy(m + "kv_layernorm.weight", h + "kv_a_layernorm.weight"),
            copy(m + "linear_kv_up_proj.weight", h + "kv_b_proj.weight"),
            copy(m + "linear_proj.weight", h + "o_proj.weight"),
        ]

    def mlp_rules(self, hf: Mapping[str, Any], layer: int, m: str, h: str) -> list[WeightRule]:
        if layer < int(hf.get("first_k_dense_replace") or 0):
            return self.swiglu_rules(m, h + "mlp.")
        rules = [copy(m + "router.weight", h + "mlp.gate.weight")]
        if self.transformer_config_kwargs(hf)["moe_router_enable_expert_bias"]:
            # megatron keeps the selection bias as a buffer of the router, not a parameter, in fp32
            # (as HF's files and both engines do): it reaches the engines in fp32, not the export dtype.
            bias = h + "mlp.gate.e_score_correction_bias"
            rules.append(copy(m + "router.expert_bias", bias, buffer=True, dtype="float32"))
        rules += self.expert_rules(hf, m, h + "mlp.experts.")
        if int(hf.get("n_shared_experts") or 0):
            rules += self.swiglu_rules(m + "shared_experts.", h + "mlp.shared_experts.")
        return rules
