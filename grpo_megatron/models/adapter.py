"""The per-architecture adapter interface: one subclass per Hugging Face ``model_type``.

An adapter knows everything architecture-specific about moving between a Hugging Face model
and a megatron-core ``GPTModel``: how the HF ``config.json`` maps onto megatron's
``TransformerConfig`` (this module), and how parameter names and layouts map (added by the
weight bridge). The registry (``registry.py``) keys adapters on the exact ``model_type``; the
builder, the conversion tools and the per-iteration resharding all go through it, so one
architecture's knowledge lives in one file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from grpo_megatron.models.weight_rules import QKVGroups, WeightRule, copy, glu, qkv, vocab


class HFConfigError(ValueError):
    """A Hugging Face config.json value that megatron cannot represent faithfully."""


def hf_get(hf: Mapping[str, Any], key: str, default: Any = ..., *, model_type: str = "") -> Any:
    """Read ``key`` from an HF config dict; a missing required key is an error naming it."""
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise HFConfigError(
            f"config.json of model_type={model_type or hf.get('model_type')!r} lacks required key "
            f"{key!r}: add it to config.json or to model.hf_overrides"
        )
    return default


class ModelAdapter:
    """Base adapter. Subclasses set ``model_type`` and implement ``transformer_config_kwargs``."""

    model_type: ClassVar[str]
    #: megatron config class name: "TransformerConfig" or "MLATransformerConfig"
    config_class: ClassVar[str] = "TransformerConfig"

    def get(self, hf: Mapping[str, Any], key: str, default: Any = ...) -> Any:
        return hf_get(hf, key, default, model_type=self.model_type)

    # ---- config mapping ---------------------------------------------------------------------
    def transformer_config_kwargs(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """Architecture fields of megatron's TransformerConfig (no parallelism, no dtype)."""
        raise NotImplementedError

    def gpt_model_kwargs(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """Architecture arguments of megatron's GPTModel, except the (padded) vocabulary size."""
        return {
            "max_sequence_length": int(self.get(hf, "max_position_embeddings")),
            "share_embeddings_and_output_weights": bool(self.get(hf, "tie_word_embeddings", False)),
            "position_embedding_type": "rope",
            "rotary_base": int(self.rope_theta(hf)),
        }

    def vocab_size(self, hf: Mapping[str, Any]) -> int:
        return int(self.get(hf, "vocab_size"))

    def num_layers(self, hf: Mapping[str, Any]) -> int:
        return int(self.get(hf, "num_hidden_layers"))

    def num_experts(self, hf: Mapping[str, Any]) -> int | None:
        """Routed experts per MoE layer, or None for a dense model."""
        return None

    # ---- weight mapping (names are megatron-core's local layer spec, canonical indices) ----------
    def weight_rules(self, hf: Mapping[str, Any]) -> list[WeightRule]:
        """Every canonical megatron tensor of the whole model and its HF tensors, in HF order."""
        real_vocab = self.vocab_size(hf)
        tied = bool(self.get(hf, "tie_word_embeddings", False))
        rules = [vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight", real_vocab)]
        for i in range(self.num_layers(hf)):
            m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
            rules.append(copy(m + "input_layernorm.weight", h + "input_layernorm.weight"))
            rules += self.attention_rules(hf, m + "self_attention.", h + "self_attn.")
            rules.append(copy(m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight"))
            rules += self.mlp_rules(hf, i, m + "mlp.", h)
        rules.append(copy("decoder.final_layernorm.weight", "model.norm.weight"))
        # Tied: HF saves no lm_head; a last pipeline stage still holds its own copy of the
        # embedding as output_layer.weight, loaded from the embedding and never exported twice.
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        rules.append(vocab("output_layer.weight", head, real_vocab, export=not tied))
        return rules

    def attention_rules(self, hf: Mapping[str, Any], m: str, h: str) -> list[WeightRule]:
        """Grouped-query attention: HF q/k/v fused into megatron's linear_qkv (and its bias)."""
        hidden = int(self.get(hf, "hidden_size"))
        heads = int(self.get(hf, "num_attention_heads"))
        geometry = QKVGroups(
            heads=heads,
            groups=int(self.get(hf, "num_key_value_heads", heads)),
            head_dim=int(hf.get("head_dim") or hidden // heads),
        )
        rules = [
            qkv(
                m + "linear_qkv.weight",
                f"{h}q_proj.weight",
                f"{h}k_proj.weight",
                f"{h}v_proj.weight",
                geometry,
            )
        ]
        if self.transformer_config_kwargs(hf).get("add_qkv_bias"):
            rules.append(
                qkv(m + "linear_qkv.bias", f"{h}q_proj.bias", f"{h}k_proj.bias", f"{h}v_proj.bias", geometry)
            )
        if self.transformer_config_kwargs(hf).get("qk_layernorm"):
            rules += [
                copy(m + "q_layernorm.weight", h + "q_norm.weight"),
                copy(m + "k_layernorm.weight", h + "k_norm.weight"),
            ]
        rules.append(copy(m + "linear_proj.weight", h + "o_proj.weight"))
        return rules

    def mlp_rules(self, hf: Mapping[str, Any], layer: int, m: str, h: str) -> list[WeightRule]:
        """Layer ``layer``'s MLP (``m``: megatron "decoder.layers.i.mlp.", ``h``: HF "model.layers.i.")."""
        return self.swiglu_rules(m, h + "mlp.")

    @staticmethod
    def swiglu_rules(
        m: str, h: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
    ) -> list[WeightRule]:
        """A SwiGLU MLP: HF gate/up fused into megatron's linear_fc1 as [gate; up]."""
        return [
            glu(m + "linear_fc1.weight", f"{h}{gate}.weight", f"{h}{up}.weight"),
            copy(m + "linear_fc2.weight", f"{h}{down}.weight"),
        ]

    def expert_rules(
        self,
        hf: Mapping[str, Any],
        m: str,
        h: str,
        gate: str = "gate_proj",
        up: str = "up_proj",
        down: str = "down_proj",
    ) -> list[WeightRule]:
        """Routed experts (``h``: the HF experts prefix, e.g. "model.layers.i.mlp.experts."): one HF
        key per expert and projection <-> megatron's per-expert ``local_experts.E`` (global E)."""
        rules = []
        for e in range(self.num_experts(hf) or 0):
            rules += self.swiglu_rules(f"{m}experts.local_experts.{e}.", f"{h}{e}.", gate, up, down)
        return rules

    # ---- shared pieces ----------------------------------------------------------------------
    def rope_theta(self, hf: Mapping[str, Any]) -> float:
        # transformers 5 moved rope_theta into rope_parameters; older configs keep it top-level.
        params = hf.get("rope_parameters") or {}
        return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))

    def rope_scaling(self, hf: Mapping[str, Any]) -> dict[str, Any] | None:
        """The rope scaling dict if it changes anything, else None ("default" rope)."""
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        return None if kind in (None, "default") else dict(scaling)

    def reject_rope_scaling(self, hf: Mapping[str, Any]) -> None:
        scaling = self.rope_scaling(hf)
        if scaling is not None:
            raise HFConfigError(
                f"model_type={self.model_type!r}: rope scaling {scaling!r} is not supported yet; "
                "remove rope_scaling from config.json (or model.hf_overrides.rope_scaling=null) "
                "to train at the native context length"
            )

    def dense_attention_kwargs(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """Grouped-query attention with a fused QKV projection (Qwen2/3, Mixtral)."""
        hidden = int(self.get(hf, "hidden_size"))
        heads = int(self.get(hf, "num_attention_heads"))
        head_dim = int(hf.get("head_dim") or hidden // heads)
        return {
            "num_layers": self.num_layers(hf),
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_query_groups": int(self.get(hf, "num_key_value_heads", heads)),
            "kv_channels": head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": float(self.get(hf, "rms_norm_eps", 1e-6)),
            "add_bias_linear": False,
            "gated_linear_unit": True,  # SwiGLU: fc1 holds [gate; up]
            "activation": "silu",
            "attention_dropout": float(hf.get("attention_dropout", 0.0) or 0.0),
            "hidden_dropout": 0.0,
        }

    @staticmethod
    def moe_layer_pattern(num_layers: int, dense_layers: set[int]) -> list[int]:
        """megatron's ``moe_layer_freq`` list: 1 for an MoE layer, 0 for a dense one."""
        return [0 if i in dense_layers else 1 for i in range(num_layers)]
