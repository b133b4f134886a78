"""The planner's model: every canonical tensor of the model, and the share each rank holds.

Canonical = unsharded, global layer and expert indices; names of megatron's local layer spec, as
``bridge/layout.py`` writes them (the dry run checks this table against a meta-device model). From
the HF config.json alone: pure arithmetic, no torch. ``planner/memory.py`` turns the parameter
counts into bytes (weights, gradients, optimizer states).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_megatron.distributed.config import ParallelConfig
from grpo_megatron.models.config import LoRAConfig, lora_place
from grpo_megatron.models.registry import get_adapter


@dataclass(frozen=True)
class TensorSpec:
    """One canonical megatron parameter and how the layout shards it."""

    name: str
    shape: tuple[int, ...]
    partition_dim: int | None  # split over TP (ETP for experts) along this dim; None = replicated
    is_expert: bool = False
    layer: int | None = None  # global layer index; None: embedding, final norm, output layer

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ModelDims:
    """Architecture numbers the planner needs, read through the model's adapter."""

    model_type: str
    num_layers: int
    hidden: int
    heads: int
    kv_groups: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int
    topk: int
    moe_ffn: int
    shared_ffn: int
    moe_layers: tuple[bool, ...]
    mla: bool
    q_lora: int | None = None
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelDims:
        adapter = get_adapter(hf)
        kw = adapter.transformer_config_kwargs(hf)
        layers = int(kw["num_layers"])
        experts = int(kw.get("num_moe_experts") or 0)
        freq = kw.get("moe_layer_freq", 1)
        moe_layers = tuple(bool(x) for x in freq) if isinstance(freq, list) else (experts > 0,) * layers
        return cls(
            model_type=adapter.model_type,
            num_layers=layers,
            hidden=int(kw["hidden_size"]),
            heads=int(kw["num_attention_heads"]),
            kv_groups=int(kw.get("num_query_groups") or kw["num_attention_heads"]),
            head_dim=int(kw.get("kv_channels") or kw["hidden_size"] // kw["num_attention_heads"]),
            ffn=int(kw["ffn_hidden_size"]),
            vocab=adapter.vocab_size(hf),
            tied=bool(adapter.gpt_model_kwargs(hf)["share_embeddings_and_output_weights"]),
            qkv_bias=bool(kw.get("add_qkv_bias")),
            qk_norm=bool(kw.get("qk_layernorm")),
            num_experts=experts,
            topk=int(kw.get("moe_router_topk") or 0),
            moe_ffn=int(kw.get("moe_ffn_hidden_size") or kw["ffn_hidden_size"]),
            shared_ffn=int(kw.get("moe_shared_expert_intermediate_size") or 0),
            moe_layers=moe_layers,
            mla=adapter.config_class == "MLATransformerConfig",
            q_lora=kw.get("q_lora_rank"),
            kv_lora=int(kw.get("kv_lora_rank") or 0),
            qk_nope=int(kw.get("qk_head_dim") or 0),
            qk_rope=int(kw.get("qk_pos_emb_head_dim") or 0),
            v_head=int(kw.get("v_head_dim") or 0),
        )


def canonical_tensors(
    hf: Mapping[str, Any], *, padded_vocab: int, pp: int = 1, te: bool = False
) -> list[TensorSpec]:
    """Every parameter of the whole model, unsharded, with its TP/ETP partition dim.

    ``te``: TransformerEngine layer spec, where MLA's down-projections are duplicated over TP
    (megatron's local spec splits them column-wise). ``pp`` matters only for a tied output layer:
    the last stage holds its own copy when it is not also the first.
    """
    d = ModelDims.from_hf(hf)
    h = d.hidden
    out = [TensorSpec("embedding.word_embeddings.weight", (padded_vocab, h), 0)]
    for i in range(d.num_layers):
        p = f"decoder.layers.{i}."
        a = p + "self_attention."
        out.append(TensorSpec(p + "input_layernorm.weight", (h,), None, layer=i))
        if d.mla:
            q_width = d.heads * (d.qk_nope + d.qk_rope)
            down_dim = None if te else 0
            if d.q_lora:
                out += [
                    TensorSpec(a + "linear_q_down_proj.weight", (d.q_lora, h), down_dim, layer=i),
                    TensorSpec(a + "linear_q_up_proj.weight", (q_width, d.q_lora), 0, layer=i),
                    TensorSpec(a + "q_layernorm.weight", (d.q_lora,), None, layer=i),
                ]
            else:
                out.append(TensorSpec(a + "linear_q_proj.weight", (q_width, h), 0, layer=i))
            out += [
                TensorSpec(a + "linear_kv_down_proj.weight", (d.kv_lora + d.qk_rope, h), down_dim, layer=i),
                TensorSpec(
                    a + "linear_kv_up_proj.weight", (d.heads * (d.qk_nope + d.v_head), d.kv_lora), 0, layer=i
                ),
                TensorSpec(a + "kv_layernorm.weight", (d.kv_lora,), None, layer=i),
                TensorSpec(a + "linear_proj.weight", (h, d.heads * d.v_head), 1, layer=i),
            ]
        else:
            qkv_rows = (d.heads + 2 * d.kv_groups) * d.head_dim
            out.append(TensorSpec(a + "linear_qkv.weight", (qkv_rows, h), 0, layer=i))
            if d.qkv_bias:
                out.append(TensorSpec(a + "linear_qkv.bias", (qkv_rows,), 0, layer=i))
            if d.qk_norm:
                out += [
                    TensorSpec(a + "q_layernorm.weight", (d.head_dim,), None, layer=i),
                    TensorSpec(a + "k_layernorm.weight", (d.head_dim,), None, layer=i),
                ]
            out.append(TensorSpec(a + "linear_proj.weight", (h, d.heads * d.head_dim), 1, layer=i))
        out.append(TensorSpec(p + "pre_mlp_layernorm.weight", (h,), None, layer=i))
        m = p + "mlp."
        if d.moe_layers[i]:
            out.append(TensorSpec(m + "router.weight", (d.num_experts, h), None, layer=i))
            for e in range(d.num_experts):
                x = f"{m}experts.local_experts.{e}."
                out += [
                    TensorSpec(x + "linear_fc1.weight", (2 * d.moe_ffn, h), 0, is_expert=True, layer=i),
                    TensorSpec(x + "linear_fc2.weight", (h, d.moe_ffn), 1, is_expert=True, layer=i),
                ]
            if d.shared_ffn:
                out += [
                    TensorSpec(m + "shared_experts.linear_fc1.weight", (2 * d.shared_ffn, h), 0, layer=i),
                    TensorSpec(m + "shared_experts.linear_fc2.weight", (h, d.shared_ffn), 1, layer=i),
                ]
        else:
            out += [
                TensorSpec(m + "linear_fc1.weight", (2 * d.ffn, h), 0, layer=i),
                TensorSpec(m + "linear_fc2.weight", (h, d.ffn), 1, layer=i),
            ]
    out.append(TensorSpec("decoder.final_layernorm.weight", (h,), None))
    if not d.tied or pp > 1:
        out.append(TensorSpec("output_layer.weight", (padded_vocab, h), 0))
    return out


@dataclass(frozen=True)
class Layout:
    """A resolved parallel layout (every degree known)."""

    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    sequence_parallel: bool

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> Layout:
        r = parallel.resolve(world_size)
        assert r.dp is not None and r.etp is not None
        return cls(world_size, r.tp, r.pp, r.cp, r.dp, r.ep, r.etp, r.expert_dp, bool(r.sequence_parallel))


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global layers of pipeline stage ``pp_rank`` (megatron's even split)."""
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def stage_owns(spec: TensorSpec, num_layers: int, pp: int, pp_rank: int) -> bool:
    """Whether stage ``pp_rank`` holds (a shard of) ``spec``."""
    if spec.layer is not None:
        return spec.layer in stage_layers(num_layers, pp, pp_rank)
    if spec.name.startswith("embedding."):
        return pp_rank == 0
    return pp_rank == pp - 1  # final norm, output layer


def expert_index(name: str) -> int | None:
    """Global expert index of a canonical expert tensor name, else None."""
    marker = ".local_experts."
    if marker not in name:
        return None
    return int(name.split(marker, 1)[1].split(".", 1)[0])


def shard_shape(spec: TensorSpec, layout: Layout) -> tuple[int, ...]:
    """The shape one rank holds: the partition dim divided by TP (ETP for experts)."""
    if spec.partition_dim is None:
        return spec.shape
    size = layout.etp if spec.is_expert else layout.tp
    shape = list(spec.shape)
    if shape[spec.partition_dim] % size:
        raise ValueError(
            f"{spec.name}: dim {spec.partition_dim} of {spec.shape} does not split over {size} ranks"
        )
    shape[spec.partition_dim] //= size
    return tuple(shape)


def rank_tensors(
    tensors: Sequence[TensorSpec], layout: Layout, dims: ModelDims, pp_rank: int, ep_rank: int
) -> list[tuple[TensorSpec, tuple[int, ...]]]:
    """(canonical spec, shard shape) of every parameter the rank at (pp_rank, ep_rank) holds;
    EP rank r owns global experts [r * E / ep, (r + 1) * E / ep)."""
    num_layers = dims.num_layers
    local = dims.num_experts // layout.ep
    owned = range(ep_rank * local, (ep_rank + 1) * local)
    return [
        (s, shard_shape(s, layout))
        for s in tensors
        if stage_owns(s, num_layers, layout.pp, pp_rank)
        and (not s.is_expert or expert_index(s.name) in owned)
    ]


@dataclass(frozen=True)
class ParamCounts:
    """Parameters one rank holds (elements, not bytes)."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def rank_param_counts(
    tensors: Sequence[TensorSpec], layout: Layout, dims: ModelDims, pp_rank: int
) -> ParamCounts:
    """Parameters of a rank of stage ``pp_rank`` (every EP rank holds as many experts)."""
    dense = expert = 0
    for spec, shape in rank_tensors(tensors, layout, dims, pp_rank, 0):
        n = 1
        for x in shape:
            n *= x
        if spec.is_expert:
            expert += n
        else:
            dense += n
    return ParamCounts(dense, expert)


def total_params(hf: Mapping[str, Any], *, padded_vocab: int | None = None) -> int:
    """Parameters of the whole model (vocabulary unpadded unless ``padded_vocab`` is given)."""
    d = ModelDims.from_hf(hf)
    return sum(s.numel for s in canonical_tensors(hf, padded_vocab=padded_vocab or d.vocab))


def lora_tensors(tensors: Sequence[TensorSpec], lora: LoRAConfig) -> list[TensorSpec]:
    """The LoRA adapters of ``lora`` on ``tensors`` (models/lora.py): per targeted weight [out, in],
    A [r, in] split as the weight's input columns (row-parallel) and B [out, r] as its output rows
    (column-parallel); whole where the weight is."""
    out = []
    for spec in tensors:
        place = lora_place(spec.name)
        if place is None or not lora.targeted(*place):
            continue
        rows, cols = spec.shape
        stem = spec.name.removesuffix(".weight") + "_lora."
        a_dim, b_dim = (1 if spec.partition_dim == 1 else None), (0 if spec.partition_dim == 0 else None)
        out += [
            TensorSpec(stem + "lora_A", (lora.rank, cols), a_dim, is_expert=spec.is_expert, layer=spec.layer),
            TensorSpec(stem + "lora_B", (rows, lora.rank), b_dim, is_expert=spec.is_expert, layer=spec.layer),
        ]
    return out
