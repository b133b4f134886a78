"""Every supported model_type builds from a tiny HF config and runs forward/backward (real
megatron-core); the adapters map HF configs faithfully and refuse what they cannot represent."""

from __future__ import annotations

import pytest

from grpo_megatron.models.adapter import HFConfigError
from grpo_megatron.models.builder import padded_vocab_size
from grpo_megatron.models.config import SUPPORTED_MODEL_TYPES
from grpo_megatron.models.registry import ADAPTERS, UnsupportedModelError, get_adapter
from tests.helpers.dist import run_distributed
from tests.helpers.tiny_configs import TINY_CONFIGS, tiny_hf_config


def test_registry_covers_exactly_the_supported_types() -> None:
    assert set(ADAPTERS) == set(SUPPORTED_MODEL_TYPES) == set(TINY_CONFIGS)


def test_unknown_model_type_lists_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError) as err:
        get_adapter({"model_type": "qwen2_moe"})  # a near miss must not resolve to qwen2
    assert "qwen2_moe" in str(err.value)
    for supported in SUPPORTED_MODEL_TYPES:
        assert supported in str(err.value)


def test_qwen3_moe_routing_and_dense_layers() -> None:
    adapter = get_adapter("qwen3_moe")
    kw = adapter.transformer_config_kwargs(
        tiny_hf_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[1])
    )
    assert kw["moe_layer_freq"] == [1, 0, 1, 1]
    assert kw["moe_router_pre_softmax"] is False  # norm_topk_prob=True: softmax over the top-k
    kw = adapter.transformer_config_kwargs(tiny_hf_config("qwen3_moe", norm_topk_prob=False))
    assert kw["moe_router_pre_softmax"] is True
    assert kw["qk_layernorm"] and kw["kv_channels"] == 16 and kw["num_query_groups"] == 2


def test_deepseek_v3_mapping() -> None:
    kw = get_adapter("deepseek_v3").transformer_config_kwargs(tiny_hf_config("deepseek_v3"))
    assert kw["moe_layer_freq"] == [0, 1]  # first_k_dense_replace=1
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_topk_scaling_factor"] == 2.5
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"]) == (2, 1)
    assert kw["moe_shared_expert_intermediate_size"] == 32
    assert (kw["q_lora_rank"], kw["kv_lora_rank"], kw["qk_head_dim"], kw["qk_pos_emb_head_dim"]) == (
        32,
        16,
        16,
        8,
    )


def test_deepseek_v3_group_scoring_mismatch_is_refused() -> None:
    with pytest.raises(HFConfigError, match="num_experts_per_tok = 2 \\* topk_group"):
        get_adapter("deepseek_v3").transformer_config_kwargs(
            tiny_hf_config("deepseek_v3", num_experts_per_tok=3)
        )


def test_unsupported_rope_scaling_names_the_fix() -> None:
    hf = tiny_hf_config("qwen3") | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    with pytest.raises(HFConfigError, match="rope_scaling"):
        get_adapter("qwen3").transformer_config_kwargs(hf)


def test_vocab_padding() -> None:
    assert padded_vocab_size(96, 128, 1) == 128
    assert padded_vocab_size(151936, 128, 8) == 152576  # Qwen's vocabulary at TP8
    assert padded_vocab_size(256, 128, 2) == 256


@pytest.mark.launches
def test_every_model_type_builds_and_trains_one_step() -> None:
    configs = {t: tiny_hf_config(t) for t in SUPPORTED_MODEL_TYPES}
    (results,) = run_distributed(
        "tests.workers.layout_workers:build_all_types", 1, timeout_s=240, configs=configs
    )
    for model_type, r in results.items():
        assert r["params"] > 0, model_type
        assert r["with_grad"] == r["total"], (
            f"{model_type}: {r['total'] - r['with_grad']} parameters got no gradient"
        )
        assert r["grad_norm"] > 0 and r["grad_norm"] == r["grad_norm"], model_type
        assert r["loss"] == r["loss"], f"{model_type}: NaN loss"
