"""Where each megatron parameter shard sits in the full (unsharded) megatron tensor.

A rank's parameter ``decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight`` is a slice
of a layout-independent *canonical* tensor: global layer index (PP offset applied), global expert
index (EP offset applied), and the TP/ETP slice along ``partition_dim``. ``ShardLayout`` records
that; ``gather`` makes the canonical tensor from the shards. The streaming
exporter and the sharded loader of the weight bridge build on the same rules, and the
layout-equivalence tests use ``full_state`` to compare any layout with a single process.

Rules (megatron-core's own tensor attributes decide, not name patterns, except for GLU):
- ``param.tensor_model_parallel`` / ``partition_dim``: split over TP, or over ETP for experts
  (parameters of modules with ``is_expert=True``; ``allreduce=False`` marks them only when EP > 1);
- GLU ``linear_fc1`` weights hold ``[gate; up]`` per shard, so the canonical tensor is
  ``[gate_full; up_full]``, not the concatenation of shards;
- ``local_experts.{j}`` on EP rank r is global expert ``r * num_local + j``;
- ``decoder.layers.{i}`` is global layer ``layer.layer_number - 1``;
- names are the local layer spec's: TransformerEngine's fused-norm names map back (``TE_FUSED_NORMS``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.models.lora import LoRAAdapter, is_lora_param, lora_adapters
from grpo_megatron.models.registry import get_adapter
from grpo_megatron.models.weight_rules import WeightRule

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\.)")

# TransformerEngine's layer spec fuses a norm into the linear layer that follows it; its weight is
# then named after that linear. Canonical names are the local spec's, so the adapters' rules (and
# every checkpoint written on CPU) serve both specs. Suffix on TE -> suffix on the local spec.
TE_FUSED_NORMS: tuple[tuple[str, str], ...] = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".self_attention.linear_qkv.layer_norm_bias", ".input_layernorm.bias"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_bias", ".pre_mlp_layernorm.bias"),
    # Multi-latent attention: the q / kv latent norms sit before the up-projections.
    (".self_attention.linear_q_up_proj.layer_norm_weight", ".self_attention.q_layernorm.weight"),
    (".self_attention.linear_kv_up_proj.layer_norm_weight", ".self_attention.kv_layernorm.weight"),
)


def local_spec_name(name: str) -> str:
    """``name`` as megatron's local layer spec calls it (TE's fused-norm names mapped back)."""
    for te_suffix, local_suffix in TE_FUSED_NORMS:
        if name.endswith(te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name


_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


@dataclass(frozen=True)
class ShardLayout:
    canonical_name: str
    partition_dim: int | None  # None: replicated over its tensor-parallel group
    is_expert: bool
    glu: bool  # fc1 of a gated MLP: [gate; up] halves are sharded separately


def unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside megatron's DDP (or any ``.module`` wrapper)."""
    inner: Any = model
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def _expert_param_ids(module: torch.nn.Module) -> set[int]:
    """ids of the parameters under modules marked ``is_expert``: one walk that stops at the first
    expert module of each branch (visiting every expert module's whole subtree again would cost
    a pass over its parameters per nested module, on every export)."""
    if getattr(module, "is_expert", False):
        return {id(p) for p in module.parameters()}
    ids: set[int] = set()
    for child in module.children():
        ids |= _expert_param_ids(child)
    return ids


def shard_layouts(
    model: torch.nn.Module, ps: ParallelState
) -> Iterator[tuple[str, torch.nn.Parameter, ShardLayout]]:
    """(local name, parameter, layout) for every parameter of this rank's model chunk."""
    gpt = unwrap(model)
    global_layer = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(gpt.decoder.layers)}
    config = gpt.config
    num_local_experts = (config.num_moe_experts or 0) // ps.ep
    expert_params = _expert_param_ids(gpt)
    for name, param in gpt.named_parameters():
        canonical = _LAYER.sub(
            lambda m: m.group(1) + global_layer[m.group(2)] + m.group(3), local_spec_name(name)
        )
        is_expert = id(param) in expert_params
        if is_expert:
            canonical = _EXPERT.sub(
                lambda m: m.group(1) + str(ps.ep_rank * num_local_experts + int(m.group(2))) + m.group(3),
                canonical,
            )
        sharded = getattr(param, "tensor_model_parallel", False)
        yield (
            name,
            param,
            ShardLayout(
                canonical_name=canonical,
                partition_dim=getattr(param, "partition_dim", None) if sharded else None,
                is_expert=is_expert,
                glu=bool(config.gated_linear_unit)
                and name.endswith(("linear_fc1.weight", "linear_fc1_lora.lora_B")),
            ),
        )


def tp_group_of(layout: ShardLayout, ps: ParallelState) -> tuple[dist.ProcessGroup, int, int]:
    """(group, size, rank) of the tensor-parallel group that splits this tensor: TP, or ETP for experts."""
    if layout.is_expert:
        return ps.etp_group, ps.etp, ps.etp_rank
    return ps.tp_group, ps.tp, ps.tp_rank


def is_first_replica(layout: ShardLayout, ps: ParallelState) -> bool:
    """True on the ranks of the first data-parallel (and context-parallel) copy of this tensor;
    the other copies hold the same values. Expert tensors are compared on every EDP copy, whatever
    their CP rank: the expert-parallel group spans TP x CP x DP ranks, so with context parallelism
    an expert can live on CP rank 1 only."""
    return layout.is_expert or (ps.dp_rank == 0 and ps.cp_rank == 0)


def gather(shard: torch.Tensor, layout: ShardLayout, ps: ParallelState) -> torch.Tensor:
    """The canonical tensor from this TP/ETP group's shards (a collective over that group)."""
    group, size, _ = tp_group_of(layout, ps)
    if layout.partition_dim is None or size == 1:
        return shard.detach().clone()
    dim = layout.partition_dim
    pieces = shard.detach().chunk(2, dim=dim) if layout.glu else (shard.detach(),)
    gathered = []
    for piece in pieces:
        parts = [torch.empty_like(piece) for _ in range(size)]
        dist.all_gather(parts, piece.contiguous(), group=group)
        gathered.append(torch.cat(parts, dim=dim))
    return torch.cat(gathered, dim=dim)


def full_state(model: torch.nn.Module, ps: ParallelState, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every canonical tensor of the whole model (or its gradients), on every rank.

    For tests and tiny models only: it materialises the entire model on each rank. Gradients
    are read from ``main_grad`` (megatron DDP) when present; with the distributed optimizer they
    are only valid before the reduce-scatter, so compare gradients with it off.
    """
    local: dict[str, torch.Tensor] = {}
    for _, param, layout in shard_layouts(model, ps):
        tensor: torch.Tensor | None = getattr(param, "main_grad", None) if grads else param
        if tensor is None:  # grads only: a parameter without a gradient buffer
            tensor = param.grad if param.grad is not None else torch.zeros_like(param)
        full = gather(tensor, layout, ps)
        # Only one member of each TP/ETP group (and of the data-parallel replicas) needs to report.
        if tp_group_of(layout, ps)[2] == 0 and is_first_replica(layout, ps):
            local[layout.canonical_name] = full.cpu()
    merged: dict[str, torch.Tensor] = {}
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(ps.world_size)]
    dist.all_gather_object(parts, local)
    for part in parts:
        merged.update(part)
    return merged


# ---- the adapter's rules over this rank's tensors: shared by the loader and the exporter ----------
def rules_by_name(hf: Mapping[str, Any]) -> dict[str, WeightRule]:
    return {rule.mcore: rule for rule in get_adapter(hf).weight_rules(hf)}


def buffer_layouts(
    model: torch.nn.Module, rules: Mapping[str, WeightRule]
) -> Iterator[tuple[str, torch.Tensor, ShardLayout]]:
    """(local name, buffer, layout) for every buffer the adapter maps (e.g. the router's
    ``expert_bias``): replicated over TP, never expert-sharded, one per global layer."""
    gpt = unwrap(model)
    for i, layer in enumerate(gpt.decoder.layers):
        for sub, buf in layer.named_buffers():
            canonical = f"decoder.layers.{layer.layer_number - 1}.{sub}"
            rule = rules.get(canonical)
            if rule is not None and rule.buffer and buf is not None:
                yield f"decoder.layers.{i}.{sub}", buf, ShardLayout(canonical, None, False, False)


def local_tensors(
    model: torch.nn.Module, ps: ParallelState, rules: Mapping[str, WeightRule]
) -> Iterator[tuple[str, torch.Tensor, ShardLayout]]:
    """This rank's parameters and mapped buffers, each with its canonical layout: the tensors of the
    Hugging Face model (LoRA adapters are not among them: see ``merged_shards``)."""
    yield from ((n, p, sl) for n, p, sl in shard_layouts(model, ps) if not is_lora_param(p))
    yield from buffer_layouts(model, rules)


def adapter_tensors(
    model: torch.nn.Module, ps: ParallelState
) -> Iterator[tuple[str, torch.Tensor, ShardLayout]]:
    """This rank's LoRA adapter tensors (``X_lora.lora_A`` / ``lora_B``), each with its canonical layout."""
    yield from ((n, p, sl) for n, p, sl in shard_layouts(model, ps) if is_lora_param(p))


@dataclass(frozen=True)
class MergedShard:
    """A LoRA-adapted weight's shard as Hugging Face models hold it, ``W + scale * B A``, computed
    each time it is read (``__call__``), so it follows every optimizer step of the adapter."""

    weight: torch.Tensor
    adapter: LoRAAdapter

    def __call__(self) -> torch.Tensor:
        return self.adapter.merged(self.weight)


def merged_shards(model: torch.nn.Module) -> dict[int, MergedShard]:
    """By ``id`` of each adapted base weight of ``model``: its merged shard (none without LoRA)."""
    return {id(a.base.weight): MergedShard(a.base.weight.detach(), a) for a in lora_adapters(model)}


def canonical_shape(shard: torch.Tensor, layout: ShardLayout, ps: ParallelState) -> tuple[int, ...]:
    shape = list(shard.shape)
    if layout.partition_dim is not None:
        shape[layout.partition_dim] *= tp_group_of(layout, ps)[1]
    return tuple(shape)
