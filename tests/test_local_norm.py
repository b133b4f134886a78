"""models/local_norm.py: the local spec's RMSNorm computes what the HF models compute, in bf16 too."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from grpo_megatron.distributed.megatron_compat import apply_megatron_compat
from grpo_megatron.models.local_norm import LocalRMSNorm, use_local_rms_norm


def _config(dtype: torch.dtype, sequence_parallel: bool = False) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        normalization="RMSNorm",
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        tensor_model_parallel_size=2 if sequence_parallel else 1,
        sequence_parallel=sequence_parallel,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_hf_norm_bitwise(dtype: torch.dtype) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    torch.manual_seed(0)
    ours = LocalRMSNorm(_config(dtype), 64, eps=1e-6)
    hf = Qwen3MoeRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(64) + 0.5)
        hf.weight.copy_(ours.weight)
    x = (torch.randn(3, 5, 64) * 4).to(dtype)
    assert ours.weight.dtype == dtype  # params_dtype, not fp32 (megatron's torch norm)
    assert torch.equal(ours(x), hf(x)) and ours(x).dtype == dtype
    # megatron's torch norm (fp32 weight on bf16 input) does not compute the same thing in bf16.
    if dtype == torch.bfloat16:
        torch_norm = torch.nn.RMSNorm(64, eps=1e-6)
        with torch.no_grad():
            torch_norm.weight.copy_(ours.weight.float())
        assert not torch.equal(torch_norm(x).to(dtype), hf(x))


def test_marks_the_weight_for_sequence_parallel_reduction() -> None:
    assert LocalRMSNorm(_config(torch.float32, sequence_parallel=True), 64).weight.sequence_parallel
    assert not LocalRMSNorm(_config(torch.float32), 64).weight.sequence_parallel


def test_replaces_every_torch_norm_of_the_local_spec() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    apply_megatron_compat("cpu")
    layers = [
        get_gpt_layer_local_spec(
            num_experts=4, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
        )
        for _ in range(2)
    ]
    block = TransformerBlockSubmodules(layer_specs=layers, layer_norm=WrappedTorchNorm)
    # input, q, k and pre-MLP norms of each layer, and the final norm
    assert use_local_rms_norm(block) == 2 * 4 + 1
    assert use_local_rms_norm(block) == 0 and block.layer_norm is LocalRMSNorm
