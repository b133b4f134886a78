"""Which experts a transformers MoE model chose for each token: forward hooks on its routers.

transformers 5 gives each supported MoE family one router module per sparse layer whose forward
returns ``(router_logits, top_k_weights, top_k_indices)``; the indices are what the experts of that
layer are then called with, so capturing them records exactly the routes the model used, including
DeepSeek-V3's group-limited choice over ``sigmoid(logits) + e_score_correction_bias``. Dense layers
(DeepSeek-V3's ``first_k_dense_replace``, Qwen3-MoE's ``mlp_only_layers``) have no router and are
skipped, so the recorded layer axis is the model's MoE layers in order (the layout of
``Completion.routed_experts``, ``rollout/engine.py``).

Shape legend: M MoE layers, N tokens of one forward call (batch-major: row, then position), K top-k.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# model_type -> (module, router class): the exact class, not a name pattern.
ROUTER_CLASSES: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter"),
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter"),
    "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter"),
}


@dataclass(frozen=True)
class RouteLayout:
    """Which layers of a Hugging Face MoE config route tokens, and how many experts each picks."""

    num_layers: int
    moe_layers: tuple[int, ...]
    """0-based indices of the layers with a router, ascending (the M axis of a route tensor)."""
    top_k: int
    num_experts: int

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> RouteLayout | None:
        """None for a dense model. MoE layers come from the adapter's megatron ``moe_layer_freq``,
        the same rule the trainer is built with."""
        from grpo_megatron.models.registry import get_adapter

        adapter = get_adapter(hf)
        experts = adapter.num_experts(hf)
        if not experts:
            return None
        layers = adapter.num_layers(hf)
        pattern = adapter.transformer_config_kwargs(hf).get("moe_layer_freq", 1)
        if isinstance(pattern, int):
            pattern = [1 if i % pattern == 0 else 0 for i in range(layers)]
        moe = tuple(i for i, is_moe in enumerate(pattern) if is_moe)
        return cls(layers, moe, int(hf["num_experts_per_tok"]), int(experts))


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype that holds every expert id (routes are kept for whole batches)."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


class RouteRecorder:
    """Forward hooks on every router of ``model`` (in layer order) that keep the top-k expert ids of
    the last forward call; ``take()`` hands them over as ``[M, N, K]`` and forgets them."""

    def __init__(self, model: torch.nn.Module, model_type: str) -> None:
        module_name, class_name = ROUTER_CLASSES[model_type]
        router_cls = getattr(importlib.import_module(module_name), class_name)
        routers = [m for m in model.modules() if isinstance(m, router_cls)]
        if not routers:
            raise ValueError(f"no {class_name} in the {model_type} model: cannot record its routes")
        self.num_layers = len(routers)
        self.dtype = route_dtype(int(routers[0].num_experts))
        self._captured: list[torch.Tensor | None] = [None] * len(routers)
        self.active = True
        """False: the hooks record nothing (a caller that needs no routes for a while)."""
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int) -> Callable[[torch.nn.Module, Any, Any], None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self.active:
                self._captured[layer] = output[2].detach().to(self.dtype)

        return hook

    def take(self) -> torch.Tensor:
        """``[M, N, K]`` expert ids of the last forward call, on the CPU."""
        if any(c is None for c in self._captured):
            raise RuntimeError("RouteRecorder.take: some routers did not run in the last forward call")
        routes_mnk = torch.stack([c for c in self._captured if c is not None]).cpu()
        self._captured = [None] * self.num_layers
        return routes_mnk

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
