"""Build a megatron-core ``GPTModel`` from a Hugging Face ``config.json``.

Path: HF config dict -> adapter (registry, exact ``model_type``) -> architecture kwargs ->
``TransformerConfig`` (+ parallelism, dtype, runtime switches) -> decoder block spec (local
modules, or TransformerEngine's when present) -> ``GPTModel`` for this pipeline stage.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_megatron.models.registry import get_adapter

if TYPE_CHECKING:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from grpo_megatron.distributed.bootstrap import ParallelState
    from grpo_megatron.models.config import ModelConfig

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocabulary up so every TP rank holds an equal, aligned slice (megatron's rule)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def use_transformer_engine(impl: str, device: torch.device) -> bool:
    """Resolve ``model.transformer_impl`` for a job on ``device``: TE only when asked for or (auto)
    installed and the job runs on CUDA (a CPU job on a GPU machine uses the local spec)."""
    have_te = importlib.util.find_spec("transformer_engine") is not None and device.type == "cuda"
    if impl == "transformer_engine" and not have_te:
        raise RuntimeError(
            f"model.transformer_impl=transformer_engine but TransformerEngine is not usable for this "
            f"job (device {device}): install the gpu extra in an NVIDIA PyTorch container and run on "
            "CUDA (parallel.backend=nccl), or set model.transformer_impl=local"
        )
    return impl == "transformer_engine" or (impl == "auto" and have_te)


@dataclass(frozen=True)
class PolicySpec:
    """What the builder derived from the HF config; kept beside the model for later stages."""

    model_type: str
    vocab_size: int  # the tokenizer's vocabulary (HF config), without padding
    padded_vocab_size: int
    num_experts: int | None
    transformer_config: TransformerConfig
    use_te: bool


def build_transformer_config(
    hf: Mapping[str, Any], model_cfg: ModelConfig, ps: ParallelState
) -> tuple[TransformerConfig, bool]:
    """megatron TransformerConfig (or MLATransformerConfig) for ``hf`` at layout ``ps``."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    adapter = get_adapter(hf)
    arch = adapter.transformer_config_kwargs(hf)
    activation = arch.pop("activation")
    arch["activation_func"] = {"silu": F.silu, "gelu": F.gelu}[activation]
    if arch.get("num_moe_experts") is not None:
        moe_type = "aux_loss" if model_cfg.moe_aux_loss_coeff > 0 else "none"
        arch |= {
            "moe_token_dispatcher_type": model_cfg.moe_token_dispatcher,
            "moe_router_load_balancing_type": moe_type,
            "moe_aux_loss_coeff": model_cfg.moe_aux_loss_coeff,
            "moe_grouped_gemm": False,  # per-expert GEMMs: portable (no grouped_gemm kernels on CPU)
        }
    else:
        # Fix (weight bridge, PP2 of a dense model): megatron checks the dispatcher even without
        # experts, and its default (allgather) refuses the variable sequence lengths PP needs.
        arch["moe_token_dispatcher_type"] = "alltoall"
    dtype = getattr(torch, _DTYPES[model_cfg.dtype])
    use_te = use_transformer_engine(model_cfg.transformer_impl, ps.device)
    on_cpu = ps.device.type == "cpu"
    recompute: dict[str, Any] = {}
    if model_cfg.recompute == "full":
        recompute = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    elif model_cfg.recompute == "selective":
        recompute = {"recompute_granularity": "selective"}
    config_cls = MLATransformerConfig if adapter.config_class == "MLATransformerConfig" else TransformerConfig
    if config_cls is TransformerConfig:
        arch.pop("rotary_base", None)  # dense models take RoPE settings on GPTModel instead
    config = config_cls(
        **arch,
        **recompute,
        tensor_model_parallel_size=ps.tp,
        pipeline_model_parallel_size=ps.pp,
        context_parallel_size=ps.cp,
        expert_model_parallel_size=ps.ep,
        expert_tensor_parallel_size=ps.etp,
        sequence_parallel=ps.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Our per-token loss is normalised by a global count we compute ourselves (see
        # training/forward_backward.py): megatron must neither divide by the number of
        # micro-batches nor average gradients over data-parallel ranks.
        calculate_per_token_loss=True,
        # Micro-batches are packed by token budget, so their lengths vary: pipeline stages must
        # exchange shapes. Only PP needs it (and megatron's allgather dispatcher refuses it).
        variable_seq_lengths=ps.pp > 1,
        use_cpu_initialization=on_cpu,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        deallocate_pipeline_outputs=not on_cpu,
        attention_softmax_in_fp32=True,
    )
    return config, use_te


def build_gpt_model(
    hf: Mapping[str, Any],
    model_cfg: ModelConfig,
    ps: ParallelState,
    *,
    vp_stage: int | None = None,
    key_length: int | None = None,
) -> tuple[GPTModel, PolicySpec]:
    """This rank's ``GPTModel`` (its pipeline stage, its TP/EP shards) and the derived spec.
    ``key_length``: batch-invariant attention over that many key positions (``rollout.true_on_policy``,
    models/batch_invariant.py); local layer spec only."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    adapter = get_adapter(hf)
    config, use_te = build_transformer_config(hf, model_cfg, ps)
    block_spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=config.normalization, vp_stage=vp_stage
    )
    if not use_te and config.normalization == "RMSNorm":
        from grpo_megatron.models.local_norm import use_local_rms_norm

        # megatron's torch norm keeps an fp32 weight in a bf16 model and computes otherwise than
        # the HF models the rollout engines run (models/local_norm.py).
        use_local_rms_norm(block_spec)
    if key_length is not None and use_te:
        raise ValueError(
            "batch-invariant attention (rollout.true_on_policy) needs model.transformer_impl=local"
        )
    if not use_te:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from grpo_megatron.models.local_attention import LocalCoreAttention

        # megatron's local DotProductAttention refuses packed sequences and context parallelism, and
        # cannot take MLA's distinct key/value head widths (models/local_attention.py).
        core: Any = (
            LocalCoreAttention
            if key_length is None
            else ModuleSpec(module=LocalCoreAttention, params={"key_length": key_length})
        )
        for layer_spec in block_spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = core
    vocab = adapter.vocab_size(hf)
    padded = padded_vocab_size(vocab, model_cfg.make_vocab_size_divisible_by, ps.tp)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=padded,
        pre_process=ps.is_first_pp_stage,
        post_process=ps.is_last_pp_stage,
        parallel_output=True,  # logits stay vocab-sharded over TP: see models/logprobs.py
        pg_collection=ps.pg_collection,
        vp_stage=vp_stage,
        **adapter.gpt_model_kwargs(hf),
    )
    model.to(ps.device)
    spec = PolicySpec(
        model_type=adapter.model_type,
        vocab_size=vocab,
        padded_vocab_size=padded,
        num_experts=adapter.num_experts(hf),
        transformer_config=config,
        use_te=use_te,
    )
    return model, spec
