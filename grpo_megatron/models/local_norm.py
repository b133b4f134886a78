"""RMSNorm for megatron's local (non-TransformerEngine) layer spec, computing what the HF models do.

megatron-core's local spec without apex builds ``WrappedTorchNorm``: a ``torch.nn.RMSNorm`` whose
weight is fp32 whatever ``params_dtype`` is. In a bf16 model every norm then ran on bf16 inputs
with an fp32 weight (torch warns "Mismatch dtype between input and weight" in ``rms_norm``),
trained that weight in fp32 while the rollout engine received it rounded to bf16, and computed
something else than the transformers models the engines run (Qwen2/3, Qwen3-MoE, Mixtral,
DeepSeek-V3 all do, with x of dtype T and a weight w of dtype T):

    y = w * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(T)        (the product in T)

``LocalRMSNorm`` is that, with its weight in ``params_dtype`` (so megatron's mixed-precision
optimizer keeps its fp32 master copy, as for every other bf16 parameter). In fp32 it is the
plain RMSNorm. The builder puts it in the local spec wherever megatron put ``WrappedTorchNorm``
with ``normalization=RMSNorm`` (through megatron's ModuleSpec mechanism, not by patching megatron).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class LocalRMSNorm(torch.nn.Module):
    """HF-style RMSNorm: normalise in fp32, round to the input dtype, scale by the weight."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,  # megatron's norm signature; nothing to persist here
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        super().__init__()
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("LocalRMSNorm: zero-centered gamma is not what the supported HF models use")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Under sequence parallelism each TP rank normalises other rows: the weight's gradient is
        # summed over TP by finalize_model_grads for parameters marked so (as TE's norms are).
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def use_local_rms_norm(spec: Any) -> int:
    """Replace megatron's ``WrappedTorchNorm`` by ``LocalRMSNorm`` everywhere in a layer/block spec
    (in place); returns how many places were replaced. Call only for ``normalization=RMSNorm``."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    replaced = 0

    def visit(node: Any) -> Any:
        nonlocal replaced
        if node is WrappedTorchNorm:
            replaced += 1
            return LocalRMSNorm
        if isinstance(node, ModuleSpec):
            node.module = visit(node.module)
            node.submodules = visit(node.submodules)
        elif isinstance(node, list):
            node[:] = [visit(item) for item in node]
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                setattr(node, field.name, visit(getattr(node, field.name)))
        return node

    visit(spec)
    return replaced
