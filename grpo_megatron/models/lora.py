"""LoRA adapters on megatron-core's linear layers (``model.lora``).

Each targeted linear layer ``W`` (``linear_qkv``, ``linear_proj``, MLA's projections, the MLPs'
``linear_fc1`` / ``linear_fc2`` of routed experts, shared experts and dense layers) gets a sibling
module ``<linear>_lora`` holding ``lora_A`` [r, in] and ``lora_B`` [out, r]; a forward hook on the
base layer adds ``scale * B (A x)`` to its output (PEFT's ``lora_B(lora_A(dropout(x))) * scaling``,
``scale = alpha / r``). The base layer, its parameter names and its checkpoint keys stay as they were;
every base parameter is frozen (no gradient, so megatron's DDP gives it no gradient buffer and its
optimizer no state).

Sharding follows the base layer (A or B is split as the base weight is):

=========================  ========================  ==============================================
base layer                 A, B                      what the adapter's forward communicates
=========================  ========================  ==============================================
column-parallel (TP/ETP    A [r, in] whole,          u = A x: all-gathered over the sequence (SP),
split the output rows)     B [out/tp, r] split       else identity forward / all-reduce backward
row-parallel (the input    A [r, in/tp] split,       u = A_r x_r is partial: all-reduced (no SP) or
columns)                   B [out, r] whole          reduce-scattered over the sequence (SP)
expert layers (the MoE     as above, over ETP        nothing: the token dispatcher gathers the
dispatcher communicates)                             inputs and reduces the outputs, as for W
=========================  ========================  ==============================================

The whole factor's gradient is partial where each rank sees only part of the sum (its sequence
slice under SP, its ETP slice of the experts' outputs): ``reduce_partial_grads`` all-reduces those
over the base layer's group before megatron's own gradient reduction (``training/policy.py``).
GLU ``linear_fc1``: B's rows are laid out as the weight's, ``[gate_r; up_r]`` per shard, so that
``W_r + scale * B_r A`` is this rank's shard of the merged weight (``merged``: the weight sync).
Experts' adapters live with their experts (EP), one per expert; pipeline and context parallelism
change nothing (the adapters act on each token alone).

Initialisation as PEFT's default: B = 0 (the policy starts as the base model), A uniform in
+-1/sqrt(in) from a generator seeded by ``seed`` and the layer's canonical name, drawn whole and then
sliced, so every parallel layout starts from the same adapters.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from grpo_megatron.models.config import LORA_GROUPS, LoRAConfig


@dataclass(frozen=True)
class Sharding:
    """How an adapter is split and what its forward communicates (see the module docstring)."""

    mode: str  # "column" | "row" | "duplicated" (the base weight is whole on every rank)
    size: int  # ranks of the base layer's TP (or ETP) group
    sequence_parallel: bool  # the layer's input / output is split over the sequence
    explicit: bool  # an expert layer whose dispatcher does the communication


def layer_sharding(base: Any, *, is_expert: bool = False, expert_parallel: bool = False) -> Sharding:
    """The base layer's sharding, read from megatron's own attributes on the layer and its weight.
    TransformerEngine's layers (megatron's wrappers keep the group as ``_tp_group`` and decide an
    expert layer's explicit communication without storing it) follow megatron's rule: an expert
    layer's communication is the dispatcher's when ETP > 1 or EP > 1 (``expert_parallel``)."""
    weight = base.weight
    group = getattr(base, "_tp_group", None) or getattr(base, "tp_group", None)
    size = group.size() if group is not None else 1
    if not getattr(weight, "tensor_model_parallel", False):
        mode = "duplicated"
    else:
        mode = "column" if weight.partition_dim == 0 else "row"
    explicit = getattr(base, "explicit_expert_comm", None)
    if explicit is None:  # TransformerEngine
        if is_expert and size > 1:
            raise ValueError(
                "model.lora: expert adapters under expert tensor parallelism on TransformerEngine layers are "
                "not supported (not run yet): set parallel.etp=1, or model.transformer_impl=local"
            )
        explicit = is_expert and expert_parallel
    sp = bool(getattr(base, "sequence_parallel", False)) and size > 1 and not explicit
    return Sharding(mode, size, sp, bool(explicit))


def _kaiming_a(rows: int, cols: int, key: str, seed: int) -> torch.Tensor:
    """PEFT's A initialisation (kaiming-uniform, a = sqrt(5): bound 1/sqrt(in)) from a generator
    seeded by ``seed`` and ``key``: the same whole tensor at every layout."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    bound = 1.0 / math.sqrt(cols)
    return (torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).float()


class LoRAAdapter(torch.nn.Module):
    """``scale * B (A x)`` added to one base linear layer's output (a forward hook on it)."""

    def __init__(
        self,
        base: Any,
        key: str,
        cfg: LoRAConfig,
        seed: int,
        *,
        glu: bool = False,
        expert_parallel: bool | None = None,
    ) -> None:
        """``expert_parallel``: None for a layer that is not a routed expert's, else whether EP > 1."""
        super().__init__()
        self.is_glu = glu  # a SwiGLU fc1: B's rows are [gate; up] per shard, as the weight's
        weight = base.weight
        out_local, in_local = weight.shape
        self.is_expert = expert_parallel is not None  # bridge/layout.py finds expert parameters by it
        self.sharding = layer_sharding(base, is_expert=self.is_expert, expert_parallel=bool(expert_parallel))
        self.key = (
            key  # canonical name of the base layer: "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1"
        )
        self.scale = cfg.scale
        self.dropout = cfg.dropout
        self.enabled = True
        self._base = (base,)  # a tuple: not registered as a child (its parameters stay the base layer's)
        self.group = getattr(base, "_tp_group", None) or getattr(base, "tp_group", None)
        split_a = self.sharding.mode == "row"
        a_full = _kaiming_a(cfg.rank, in_local * (self.sharding.size if split_a else 1), key, seed)
        if split_a and self.group is not None:
            a_full = a_full.chunk(self.sharding.size, dim=1)[self.group.rank()]
        self.lora_A = torch.nn.Parameter(a_full.to(dtype=weight.dtype, device=weight.device).contiguous())
        self.lora_B = torch.nn.Parameter(
            torch.zeros(out_local, cfg.rank, dtype=weight.dtype, device=weight.device)
        )
        self._mark_parameters(base)
        self.handle = base.register_forward_hook(self._hook)

    def _mark_parameters(self, base: Any) -> None:
        """megatron's tensor attributes (so DDP, the optimizer, checkpoints and the bridge treat each
        factor as the base weight's kind of tensor), plus which factor's gradient is partial."""
        mode, s = self.sharding.mode, self.sharding
        split = {"column": self.lora_B, "row": self.lora_A}.get(mode)
        whole = [p for p in (self.lora_A, self.lora_B) if p is not split]
        allreduce = getattr(base.weight, "allreduce", True)
        for param in (self.lora_A, self.lora_B):
            param.is_lora = True  # type: ignore[attr-defined]
            param.allreduce = allreduce  # type: ignore[attr-defined]  # False: an expert's, under EP
            param.tensor_model_parallel = param is split  # type: ignore[attr-defined]
            param.partition_dim = (0 if mode == "column" else 1) if param is split else -1  # type: ignore[attr-defined]
            param.partition_stride = 1  # type: ignore[attr-defined]
            param.lora_partial_grad_group = None  # type: ignore[attr-defined]
        if s.sequence_parallel or (s.explicit and s.size > 1):
            # The whole factor sees only this rank's sequence slice (SP) or ETP slice (experts).
            for param in whole:
                param.lora_partial_grad_group = self.group  # type: ignore[attr-defined]

    @property
    def base(self) -> Any:
        """The base linear layer (megatron's or TransformerEngine's)."""
        return self._base[0]

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not self.enabled:
            return output
        out, bias = output
        return out + self.delta(_layer_input(module, args[0])).to(out.dtype), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B (A dropout(x))`` in the layout of the base layer's output."""
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        u = self._communicate(F.linear(x, self.lora_A))
        return F.linear(u, self.lora_B) * self.scale

    def _communicate(self, u: torch.Tensor) -> torch.Tensor:
        """What the base layer communicates, applied to the rank-r activations ``u = A x``."""
        from megatron.core.tensor_parallel import mappings

        s, group = self.sharding, self.group
        if s.size == 1 or s.explicit or s.mode == "duplicated":
            return u
        if s.mode == "column":
            if s.sequence_parallel:  # [s/tp, b, r] -> [s, b, r]; backward: reduce-scatter
                return mappings.gather_from_sequence_parallel_region(u, group=group)
            return mappings.copy_to_tensor_model_parallel_region(u, group=group)  # backward: all-reduce
        if s.sequence_parallel:  # partial [s, b, r] -> summed [s/tp, b, r]
            return mappings.reduce_scatter_to_sequence_parallel_region(u, group=group)
        return mappings.reduce_from_tensor_model_parallel_region(u, group=group)

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``W + scale * B A`` (fp32 sum, rounded once to W's dtype)."""
        delta = self.lora_B.float() @ self.lora_A.float()
        return torch.add(weight.float(), delta, alpha=self.scale).to(
            weight.dtype
        )  # never in place: W is live

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """megatron's sharded checkpoint tensors of A and B: the split factor along its TP/ETP axis
        (GLU fc1's B as megatron shards the fc1 weight), the whole one replicated."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {"column": {"lora_B": 0}, "row": {"lora_A": 1}}.get(self.sharding.mode, {})
        state = self.state_dict(prefix="", keep_vars=True)
        kwargs: dict[str, Any] = {"tp_group": self.group}
        if metadata is not None and "dp_cp_group" in metadata:
            kwargs["dp_cp_group"] = metadata["dp_cp_group"]
        out = make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, **kwargs)
        if self.is_glu and "lora_B" in axes:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            out[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(
                out[f"{prefix}lora_B"], sharded_offsets, singleton
            )
        return out


def _layer_input(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input the base layer's weight multiplies: TransformerEngine's fused-norm linears
    (``TELayerNormColumnParallelLinear``) normalise their input first."""
    weight = getattr(module, "layer_norm_weight", None)
    if weight is None:
        return x
    eps = float(getattr(module, "eps", 1e-5))
    gamma = weight + 1 if getattr(module, "zero_centered_gamma", False) else weight
    if getattr(module, "normalization", "RMSNorm") == "RMSNorm":
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * gamma
    return F.layer_norm(x, (x.shape[-1],), gamma, getattr(module, "layer_norm_bias", None), eps)


# ---- placing adapters on a GPTModel ---------------------------------------------------------------
def _places(layer: Any) -> Iterator[tuple[str, torch.nn.Module, str, bool | None]]:
    """(group, module holding the linear layers, canonical prefix, for routed experts whether EP > 1)
    of one transformer layer."""
    prefix = f"decoder.layers.{layer.layer_number - 1}."
    yield "attention", layer.self_attention, prefix + "self_attention.", None
    mlp = layer.mlp
    experts = getattr(mlp, "experts", None)
    if experts is None:
        yield "dense_mlp", mlp, prefix + "mlp.", None
        return
    local = getattr(experts, "local_experts", None)
    if local is None:
        raise ValueError(
            f"model.lora: {type(experts).__name__} (grouped GEMM experts) takes no per-expert adapters; "
            "LoRA needs megatron's SequentialMLP experts (moe_grouped_gemm off, as the builder sets it)"
        )
    first = experts.ep_group.rank() * experts.num_local_experts
    for j, expert in enumerate(local):
        yield (
            "experts",
            expert,
            f"{prefix}mlp.experts.local_experts.{first + j}.",
            experts.ep_group.size() > 1,
        )
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None:
        yield "shared_experts", shared, prefix + "mlp.shared_experts.", None


def add_lora(gpt: Any, cfg: LoRAConfig, seed: int, *, gated: bool) -> list[LoRAAdapter]:
    """Put ``cfg``'s adapters on ``gpt`` (this rank's chunk of a GPTModel) and freeze every other
    parameter. ``gated``: the MLPs' fc1 holds [gate; up] (SwiGLU). Returns the adapters."""
    adapters: list[LoRAAdapter] = []
    for layer in gpt.decoder.layers:
        for group, parent, prefix, expert_parallel in _places(layer):
            for linear in LORA_GROUPS[group]:
                base = getattr(parent, linear, None)
                if base is None or not isinstance(getattr(base, "weight", None), torch.Tensor):
                    continue
                if not cfg.targeted(group, linear):
                    continue
                glu = gated and linear == "linear_fc1"
                adapter = LoRAAdapter(
                    base, prefix + linear, cfg, seed, glu=glu, expert_parallel=expert_parallel
                )
                parent.add_module(f"{linear}_lora", adapter)
                adapters.append(adapter)
    for param in gpt.parameters():
        if not getattr(param, "is_lora", False):
            param.requires_grad_(False)
    # What a checkpoint records of the adapters (checkpoint/integrity.py:model_shape).
    gpt.lora_shape = {"rank": cfg.rank, "alpha": cfg.alpha, "targets": sorted(cfg.targets)}
    return adapters


def lora_adapters(model: torch.nn.Module) -> list[LoRAAdapter]:
    """Every adapter of ``model`` (any wrapper around a GPTModel), in module order."""
    return [m for m in model.modules() if isinstance(m, LoRAAdapter)]


def is_lora_param(param: torch.Tensor) -> bool:
    return bool(getattr(param, "is_lora", False))


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """``model`` computes as its frozen base inside the block: the reference model of a LoRA policy."""
    adapters = lora_adapters(model)
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def reduce_partial_grads(model: torch.nn.Module) -> None:
    """All-reduce the gradients each rank holds only a part of (the whole factor of an adapter under
    sequence parallelism, or of an expert adapter under ETP) over the base layer's group, one
    coalesced all-reduce per group. Before megatron's DP reduction (linear: the order is free)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_group: dict[Any, list[torch.Tensor]] = {}
    for param in model.parameters():
        group = getattr(param, "lora_partial_grad_group", None)
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if group is not None and grad is not None:
            by_group.setdefault(group, []).append(grad)
    for group, grads in by_group.items():
        flat = _flatten_dense_tensors(grads)
        torch.distributed.all_reduce(flat, group=group)
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(synced)


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, all) parameters of this rank's chunk."""
    total = trainable = 0
    for param in model.parameters():
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return trainable, total
