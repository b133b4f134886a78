"""Per-GPU memory of a GRPO job, from the HF config.json and the job config alone (pure arithmetic).

Nothing here imports torch: ``grpo-megatron plan`` answers in a second for any model size.

One module per component: ``planner/model_states.py`` (the model's tensors and each rank's
parameter counts), ``planner/activations.py`` (activation bytes per token); this module turns them
into bytes per GPU with the rollout engine's share, suggests what to change and prints the plan.

Sources of the formulas (docs/planner.md derives each line):
- Model states: megatron-core's distributed-optimizer accounting (docs "Distributed Optimizer":
  bf16 parameters with fp32 main gradients cost 18 bytes/parameter, or 6 + 12/d with the optimizer
  sharded over d data-parallel ranks), i.e. ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory
  Optimizations Toward Training Trillion Parameter Models", sections 3.1 and 5.1). Expert parameters are
  sharded over the expert-data-parallel group, dense ones over data x context parallel.
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (section 4: 34*s*b*h + 5*a*s^2*b bytes per layer, divided by t with sequence
  parallelism), re-derived per stored tensor for GQA/MLA attention, SwiGLU MLPs and routed experts
  (no dropout in RL, flash attention with TransformerEngine, the 1F1B schedule keeping ``pp``
  micro-batches in flight on the first stage).
- Colocated rollout: SGLang's ``mem_fraction_static`` (= ``rollout.gpu_memory_utilization``) is the
  share of the GPU its weights and KV-cache pool take; the KV cache is what remains after weights.

Conventions: sizes in bytes internally, GiB (2**30) when printed; ``h`` hidden size, ``t`` tensor
parallel size, ``T`` tokens of one micro-batch on one rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_megatron.models.builder import padded_vocab_size
from grpo_megatron.planner.activations import (
    dispatch_buffer_bytes,
    layer_activation_bytes,
    output_activation_bytes,
)
from grpo_megatron.planner.model_states import (
    Layout,
    ModelDims,
    ParamCounts,
    canonical_tensors,
    lora_tensors,
    rank_param_counts,
    stage_layers,
    total_params,
)
from grpo_megatron.rollout.placement import PHASES, Occupancy, RolloutPlacement, decide_placement

if TYPE_CHECKING:
    from grpo_megatron.config import JobConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class GPU:
    """A GPU model of the catalogue."""

    name: str
    """Printed name."""
    memory_gib: float
    """Total device memory in GiB, as nvidia-smi reports it (MiB / 1024)."""


GPUS: dict[str, GPU] = {
    "h100": GPU("H100 80GB", 81559 / 1024),  # nvidia-smi: 81559 MiB (H100 SXM5 80GB)
    "h200": GPU("H200 141GB", 143771 / 1024),  # nvidia-smi: 143771 MiB
}


def human_count(n: float) -> str:
    """1234567 -> "1.23M", 7.6e9 -> "7.62B"."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def custom_gpu(memory_gib: float) -> GPU:
    """A GPU given only by its memory (``--gpu custom --gpu-memory-gb X``)."""
    if memory_gib <= 0:
        raise ValueError(f"--gpu-memory-gb={memory_gib} must be > 0")
    return GPU(f"custom {memory_gib:g} GiB", memory_gib)


# ----------------------------------------------------------------------------------------------------
# The plan


def engine_weight_bytes(dtype: str) -> int:
    """Bytes per element of the weight sync, and per weight of a colocated engine that holds the trained
    model's ``model.dtype`` (``rollout.weight_dtype=model``: it starts in it and the sync sends it,
    whatever the checkpoint holds; an FP8 checkpoint's engine starts unquantized,
    rollout/sglang/model_config.py ``engine_config``). An FP8 engine's weights: ``EngineWeights.nbytes``."""
    return DTYPE_BYTES[dtype]


FP8_SCALE_BYTES_PER_PARAM = 4 / (128 * 128)
"""An FP8 engine's float32 ``weight_scale_inv``: one per 128 x 128 block of a quantized weight
(bridge/fp8.py; a partial block at an edge counts as a fraction here, a few blocks per tensor)."""


def fp8_in_engine(canonical_name: str) -> bool:
    """Whether an FP8 engine (``rollout.weight_dtype=fp8``) holds this canonical tensor in FP8: the
    linear layers of the decoder layers (attention, MLA's projections, dense MLPs, shared and routed
    experts; bridge/fp8.py ``quantized_name`` for their HF names), not the embedding, output layer,
    norms or routers."""
    return (
        ".linear_" in canonical_name
        and canonical_name.endswith(".weight")
        and "layernorm" not in canonical_name
    )


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of the estimate that the job config does not hold (the cluster and the assumptions)."""

    gpus_per_node: int = 8
    """GPUs per node (the world size is nodes x gpus_per_node)."""
    gpu: GPU = GPUS["h100"]
    """The GPU the job runs on."""
    grad_bytes: int = 4
    """Bytes per main gradient: 4, because training/policy.py reduces gradients in fp32."""
    moe_imbalance: float = 1.25
    """Routed tokens on the busiest expert rank relative to a perfect balance (dropless MoE)."""
    reserve_gib: float = 4.0
    """The trainer's and a colocated engine's CUDA contexts, NCCL buffers and allocator
    fragmentation, per GPU (SGLang's non-static memory has lines of its own)."""
    margin: float = 0.05
    """A plan fits when its peak stays this share of the GPU below the GPU's memory: what the
    estimate leaves out (docs/planner.md, "Not modelled") needs room. Within it is not fitting."""


@dataclass(frozen=True)
class Line:
    """One row of the memory table."""

    name: str
    gib: float
    note: str = ""


@dataclass
class MemoryPlan:
    """Per-GPU memory of the busiest rank (an engine GPU) in each phase, and whether it fits."""

    world_size: int
    layout: Layout
    gpu: GPU
    total_params: int
    params_rank: ParamCounts
    peak_stage: int
    tokens_per_micro_batch: int
    placement: RolloutPlacement
    """rollout/placement.py's decision: the runtime's, from the same config."""
    phases: dict[str, list[Line]]
    """Phase name (rollout/placement.py PHASES; "probe" only when the mismatch probe runs) -> lines."""
    kv_tokens: int | None
    seq_len: int
    notes: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    trainable_rank: ParamCounts | None = None
    """Parameters of the busiest rank that train (model.lora: the adapters'); None: all of them."""

    def phase_gib(self, phase: str) -> float:
        return sum(x.gib for x in self.phases.get(phase, []))

    @property
    def train(self) -> list[Line]:
        return self.phases["train"]

    @property
    def train_gib(self) -> float:
        return self.phase_gib("train")

    @property
    def rollout_gib(self) -> float:
        return self.phase_gib("rollout")

    @property
    def peak_gib(self) -> float:
        return max(self.phase_gib(p) for p in self.phases)

    margin: float = 0.05
    """``PlanOptions.margin``: the share of the GPU a fitting plan leaves free."""

    @property
    def limit_gib(self) -> float:
        """The most a phase may take and the plan still fit: the GPU less the margin."""
        return self.gpu.memory_gib * (1 - self.margin)

    @property
    def peak_frac(self) -> float:
        return self.peak_gib / self.gpu.memory_gib

    @property
    def fits(self) -> bool:
        kv_ok = self.kv_tokens is None or self.kv_tokens >= self.seq_len
        return self.peak_gib <= self.limit_gib and kv_ok


def tokens_per_micro_batch(cfg: JobConfig) -> int:
    """Tokens of one training micro-batch (before context parallelism splits it)."""
    if cfg.train.max_tokens_per_micro_batch is not None:
        return cfg.train.max_tokens_per_micro_batch
    return cfg.train.micro_batch_size * (cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)


def kv_bytes_per_token(d: ModelDims, engine_gpus: int, server_args: Mapping[str, Any] | None = None) -> float:
    """KV-cache bytes per token on one GPU of an engine (TP over the engine's GPUs; a bf16 cache, or
    one byte per element with ``kv_cache_dtype`` fp8_* in ``server_args``): GQA keeps 2 x layers x kv
    heads x head_dim (kv heads split, or replicated when fewer than the GPUs); MLA keeps one compressed
    latent plus the rope key per layer, on every GPU."""
    element = 1 if str((server_args or {}).get("kv_cache_dtype", "auto")).startswith("fp8") else 2
    if d.mla:
        return d.num_layers * (d.kv_lora + d.qk_rope) * element
    heads_per_gpu = max(1, -(-d.kv_groups // engine_gpus))
    return 2 * d.num_layers * heads_per_gpu * d.head_dim * element


@dataclass
class _Trainer:
    """The busiest pipeline stage's trainer lines: its state by part, and what only training adds."""

    stage: int
    counts: ParamCounts
    state: dict[str, Line]
    """"params", "grads", "optimizer" (rollout/placement.py TRAINER_PARTS), "reference" and "teacher"."""
    training: list[Line]
    """Activations and MoE dispatch buffers."""
    trainable: ParamCounts | None = None
    """Parameters with gradients and optimizer state (LoRA: the adapters'); None: ``counts``."""

    @property
    def total(self) -> float:
        return sum(x.gib for x in self.state.values()) + sum(x.gib for x in self.training)


def _stage_lines(
    cfg: JobConfig, hf: Mapping[str, Any], layout: Layout, opts: PlanOptions, stage: int
) -> _Trainer:
    d = ModelDims.from_hf(hf)
    te = cfg.model.transformer_impl != "local"  # GPUs use TransformerEngine unless told otherwise
    vp = padded_vocab_size(d.vocab, cfg.model.make_vocab_size_divisible_by, layout.tp)
    tensors = canonical_tensors(hf, padded_vocab=vp, pp=layout.pp, te=te)
    pbytes = act_bytes = DTYPE_BYTES[cfg.model.dtype]
    seq_len = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    tokens = tokens_per_micro_batch(cfg) / layout.cp  # on one rank
    opt_bytes = 8 if pbytes == 4 else 12  # Adam moments (+ fp32 master copy of 16-bit params)
    dense_shards = layout.dp * layout.cp if cfg.parallel.use_distributed_optimizer else 1
    expert_shards = layout.edp if cfg.parallel.use_distributed_optimizer else 1
    counts = rank_param_counts(tensors, layout, d, stage)
    trainable = counts  # what has gradients and optimizer state: everything, or (LoRA) the adapters
    if cfg.model.lora.enabled:
        trainable = rank_param_counts(lora_tensors(tensors, cfg.model.lora), layout, d, stage)
        counts = ParamCounts(counts.dense + trainable.dense, counts.expert + trainable.expert)
    layers = stage_layers(d.num_layers, layout.pp, stage)
    in_flight = layout.pp - stage  # 1F1B: the first stage holds pp micro-batches, the last one
    per_layer = [
        layer_activation_bytes(
            d, i, layout, act_bytes, seq_len=seq_len, flash=te, moe_imbalance=opts.moe_imbalance
        )
        * tokens
        for i in layers
    ]
    sp = layout.tp if layout.sequence_parallel else 1
    if cfg.model.recompute == "full":
        # Only each layer's input is kept; one layer is recomputed (whole) at a time.
        act = (len(layers) * d.hidden * act_bytes / sp * tokens) * in_flight + max(per_layer, default=0)
        act_note = "full recompute: layer inputs x micro-batches in flight + one layer"
    else:
        act = sum(per_layer) * in_flight
        act_note = (
            f"{len(layers)} layers x {in_flight} micro-batch(es) in flight, {cfg.model.recompute} recompute"
        )
    if stage == layout.pp - 1:
        act += output_activation_bytes(vp, layout, act_bytes) * tokens
    lora_note = f" of the LoRA adapters ({human_count(trainable.total)})" if cfg.model.lora.enabled else ""
    state = {
        "params": Line(
            "parameters",
            counts.total * pbytes / GIB,
            f"{human_count(counts.total)} on this rank ({cfg.model.dtype})",
        ),
        "grads": Line(
            "gradients",
            trainable.total * opts.grad_bytes / GIB,
            f"fp{8 * opts.grad_bytes} main grads" + lora_note,
        ),
        "optimizer": Line(
            "optimizer state",
            (trainable.dense * opt_bytes / dense_shards + trainable.expert * opt_bytes / expert_shards) / GIB,
            f"{opt_bytes} B/param, dense / {dense_shards}, experts / {expert_shards}" + lora_note,
        ),
    }
    if cfg.algorithm.kl.enabled and not cfg.model.lora.enabled:  # LoRA: the reference is the base, no copy
        where = (
            "on the CPU but in the reference pass"
            if cfg.train.reference_on_cpu
            else "resident, never offloaded"
        )
        state["reference"] = Line(
            "reference model", counts.total * pbytes / GIB, f"frozen copy, same sharding; {where}"
        )
    if cfg.distill.enabled:
        state["teacher"] = _teacher_line(cfg, layout, stage, te)
    training = [Line("activations", act / GIB, act_note)]
    if d.num_experts:
        dispatch = dispatch_buffer_bytes(d, layout, act_bytes, tokens, opts.moe_imbalance)
        training.append(
            Line("MoE dispatch buffers", dispatch / GIB, "all-to-all send + receive of one layer")
        )
    return _Trainer(stage, counts, state, training, trainable)


def _teacher_line(cfg: JobConfig, layout: Layout, stage: int, te: bool) -> Line:
    """The distillation teacher's shard on a rank of pipeline stage ``stage`` (training/teacher.py:
    built at the student's layout from distill.teacher_path, in distill.dtype or model.dtype)."""
    hf = cfg.distill.teacher_model(cfg.model).load_hf_config()
    d = ModelDims.from_hf(hf)
    vp = padded_vocab_size(d.vocab, cfg.model.make_vocab_size_divisible_by, layout.tp)
    counts = rank_param_counts(canonical_tensors(hf, padded_vocab=vp, pp=layout.pp, te=te), layout, d, stage)
    dtype = cfg.distill.dtype or cfg.model.dtype
    where = "on the CPU but in the teacher pass" if cfg.distill.on_cpu else "resident, never offloaded"
    return Line(
        "distillation teacher",
        counts.total * DTYPE_BYTES[dtype] / GIB,
        f"{human_count(counts.total)} of {human_count(total_params(hf))} on this rank ({dtype}), "
        f"frozen; {where}",
    )


@dataclass(frozen=True)
class EngineWeights:
    """Parameters on one GPU of a colocated SGLang engine of ``width`` GPUs."""

    per_gpu: float
    replicated: float
    """Of which held whole on every GPU, or in more copies than an even split: norms, MoE routers
    (SGLang's ``ReplicatedLinear`` gate), MLA's down-projections (its ``fused_qkv_a_proj_with_mqa``
    is a ``ReplicatedLinear``), and KV heads when they are fewer than the GPUs (its
    ``QKVParallelLinear`` gives each GPU one whole)."""
    fp8_per_gpu: float = 0.0
    """Of ``per_gpu``, those an FP8 engine holds in FP8 (``fp8_in_engine``)."""
    fp8_replicated: float = 0.0
    """Of ``replicated``, those an FP8 engine holds in FP8."""

    def nbytes(self, dtype: str, fp8: bool) -> tuple[float, float]:
        """(bytes per GPU, of which replicated) of an engine holding ``dtype`` weights, or with
        ``fp8`` (``rollout.weight_dtype=fp8``) its linear layers as FP8 (1 byte) + float32 scales."""
        element = DTYPE_BYTES[dtype]
        if not fp8:
            return self.per_gpu * element, self.replicated * element
        per_fp8 = 1 + FP8_SCALE_BYTES_PER_PARAM
        return (
            (self.per_gpu - self.fp8_per_gpu) * element + self.fp8_per_gpu * per_fp8,
            (self.replicated - self.fp8_replicated) * element + self.fp8_replicated * per_fp8,
        )


def engine_weight_params(hf: Mapping[str, Any], width: int) -> EngineWeights:
    """Every canonical tensor split over the engine's ``width`` GPUs as SGLang loads it: column and
    row parallel layers (and the experts, over EP x MoE-TP = width) by ``width``, the replicated
    ones whole (the planner's TransformerEngine table duplicates MLA's down-projections, as SGLang does)."""
    d = ModelDims.from_hf(hf)
    per_gpu = replicated = fp8_per_gpu = fp8_replicated = 0.0
    for t in canonical_tensors(hf, padded_vocab=d.vocab, te=True):
        if t.partition_dim is None:
            share, extra = float(t.numel), t.numel * (1 - 1 / width)
        elif ".linear_qkv." in t.name and d.kv_groups < width:
            per_head = t.numel // (d.heads + 2 * d.kv_groups)  # one head's rows of Q, K or V
            kv = 2 * per_head  # each GPU holds one K and one V head whole
            share, extra = d.heads * per_head / width + kv, kv - 2 * d.kv_groups * per_head / width
        else:
            share, extra = t.numel / width, 0.0
        per_gpu, replicated = per_gpu + share, replicated + extra
        if fp8_in_engine(t.name):
            fp8_per_gpu, fp8_replicated = fp8_per_gpu + share, fp8_replicated + extra
    return EngineWeights(per_gpu, replicated, fp8_per_gpu, fp8_replicated)


def sglang_defaults(server_args: Mapping[str, Any], gpu_mib: float, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, decode CUDA-graph max batch) an SGLang 0.5.23 engine runs with:
    ``server_args`` (rollout.sglang.server_args, which the runtime passes on), else SGLang's defaults
    by GPU memory (``srt/arg_groups/memory_hook.py``: 8192 tokens and 256 (TP < 4) or 512 on an
    H100 or H200), the graph batch capped by ``max_running_requests``."""
    table = (
        (20, 2048, 8, 8),
        (35, 4096, 48, 160),
        (60, 4096, 32, 160),
        (160, 8192, 256, 512),
        (10**9, 16384, 512, 512),
    )
    chunk, small, large = next((c, a, b) for below, c, a, b in table if gpu_mib < below * 1024)
    chunk = int(server_args.get("chunked_prefill_size") or chunk)
    bs = server_args.get("cuda_graph_max_bs_decode") or (small if tp < 4 else large)
    if server_args.get("max_running_requests") and not server_args.get("cuda_graph_max_bs_decode"):
        bs = min(bs, int(server_args["max_running_requests"]))
    return chunk, int(bs)


def sglang_graph_mib(server_args: Mapping[str, Any], chunk: int, decode_bs: int, mla: bool) -> float:
    """SGLang 0.5.23's own reserve for its CUDA graphs (``memory_hook.reserve_for_graph_mb``): 2 MiB per
    decode batch size up to the largest captured; the prefill graphs (breakable, the CUDA default):
    8 MiB per captured token count up to the chunk, 1.5 GiB with an MLA backend."""
    off = bool(server_args.get("disable_cuda_graph"))
    mib = 0.0
    if not (off or server_args.get("disable_decode_cuda_graph")):
        mib += decode_bs * 2
    if not (off or server_args.get("disable_prefill_cuda_graph")):
        top = int(server_args.get("cuda_graph_max_bs_prefill") or (min(8192, chunk) if mla else chunk))
        sizes = [
            *range(4, 33, 4),
            *range(48, 257, 16),
            *range(288, 513, 32),
            *range(576, 1025, 64),
            *range(1280, 4097, 256),
            *range(4608, top + 1, 512),
        ]
        mib += 1536 if mla else 8 * sum(1 for x in sizes if x <= top)
    return mib


def _sglang_runtime_lines(
    cfg: JobConfig, hf: Mapping[str, Any], placement: RolloutPlacement, opts: PlanOptions
) -> dict[str, Line]:
    """SGLang's memory outside its static pool (weights + KV cache, ``mem_fraction_static``), which a
    colocated engine needs beside the trainer: its CUDA graphs (held with the ``cuda_graph`` tag) and
    what a forward allocates (a prefill chunk's activations, the decode batch's logits, SGLang's own
    constant buffers)."""
    d = ModelDims.from_hf(hf)
    width, args = placement.gpus_per_engine, cfg.rollout.sglang.server_args
    chunk, decode_bs = sglang_defaults(args, opts.gpu.memory_gib * 1024, width)
    graphs = sglang_graph_mib(args, chunk, decode_bs, d.mla) * 2**20
    ep = placement.engine_ep
    engine = Layout(width, width, 1, 1, 1, ep, 1, 1, False)
    # The trainer's per-tensor count of one layer (an upper bound: a forward frees as it goes), with
    # every GPU holding the chunk's tokens (attention split by heads) and its experts only the
    # 1/ep of the routed copies that reach them (SGLang's EP without DeepEP: no all-to-all buffers).
    routed = d.topk * opts.moe_imbalance * (d.hidden + 3 * d.moe_ffn) * 2 * (1 - 1 / ep)
    layer = max(
        layer_activation_bytes(d, i, engine, 2, seq_len=chunk, flash=True, moe_imbalance=opts.moe_imbalance)
        - (routed if d.moe_layers[i] else 0.0)
        for i in range(d.num_layers)
    )
    deepep = args.get("moe_a2a_backend") == "deepep"
    forward = layer * chunk + (
        dispatch_buffer_bytes(d, engine, 2, chunk / ep, opts.moe_imbalance) if deepep else 0.0
    )
    logits = decode_bs * padded_vocab_size(d.vocab, 1, width) / width * 4  # fp32 logits of a decode batch
    constant = (512 + width / 8 * 1024) * 2**20  # SGLang's reserve: metadata, and its large-TP adjustment
    return {
        "graphs": Line(
            "SGLang CUDA graphs",
            graphs / GIB,
            f"decode batch <= {decode_bs}, prefill <= {chunk} tokens (SGLang's reserve)",
        ),
        "runtime": Line(
            "SGLang activations",
            (forward + logits + constant) / GIB,
            f"one layer of a {chunk}-token prefill chunk, decode logits, SGLang's constant buffers",
        ),
    }


def _engine_lines(
    cfg: JobConfig, hf: Mapping[str, Any], placement: RolloutPlacement, opts: PlanOptions
) -> tuple[dict[str, Line], int | None, list[str]]:
    """Lines of a colocated SGLang engine GPU by memory tag, its KV tokens, and notes."""
    if placement.engine == "embedded":
        copy = total_params(hf) * DTYPE_BYTES[cfg.model.dtype] / GIB
        note = "rollout.engine=embedded: its KV cache lives inside a generate call and is not planned"
        return (
            {
                "weights": Line(
                    "engine weights", copy, f"the embedded engine's copy of the model ({cfg.model.dtype})"
                )
            },
            None,
            [note],
        )
    if not placement.colocated_sglang:
        return {}, None, ["disaggregated SGLang servers: no engine on the trainer's GPUs"]
    d = ModelDims.from_hf(hf)
    width, seq_len = placement.gpus_per_engine, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    all_params = total_params(hf)
    pool = cfg.rollout.gpu_memory_utilization * opts.gpu.memory_gib * GIB
    on_gpu = engine_weight_params(hf, width)
    fp8 = cfg.rollout.weight_dtype == "fp8"
    weights, replicated = on_gpu.nbytes(cfg.model.dtype, fp8)
    kv = pool - weights
    kv_tokens = max(0, int(kv // kv_bytes_per_token(d, width, cfg.rollout.sglang.server_args)))
    lines = {
        "weights": Line(
            "engine weights",
            weights / GIB,
            f"{human_count(all_params)} / {width} GPUs per engine"
            + (f", FP8 linear layers ({human_count(on_gpu.fp8_per_gpu)}) + scales" if fp8 else "")
            + f", {replicated / GIB:.2f} GiB of it replicated",
        ),
        "kv_cache": Line(
            "engine KV cache",
            max(kv, 0) / GIB,
            f"{kv_tokens:,} tokens ({kv_tokens // max(seq_len, 1):,} full sequences)",
        ),
        **_sglang_runtime_lines(cfg, hf, placement, opts),
    }
    notes = []
    if kv <= 0:
        notes.append(
            f"the engine's weights ({weights / GIB:.1f} GiB per GPU) exceed its pool "
            f"(rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} x {opts.gpu.memory_gib:.0f} GiB)"
        )
    return lines, kv_tokens, notes


def _phase(
    phase: str, held: Occupancy, trainer: _Trainer, engine: dict[str, Line], cfg: JobConfig, opts: PlanOptions
) -> list[Line]:
    """The lines of one phase: what ``held`` (rollout/placement.py) keeps on the device, plus what the
    phase itself adds (activations in train, transfer buffers in sync and probe)."""
    lines = [trainer.state[p] for p in ("params", "grads", "optimizer") if p in held.trainer]
    reference = trainer.state.get("reference")
    if reference is not None and (phase == "train" or not cfg.train.reference_on_cpu):
        lines.append(reference)
    teacher = trainer.state.get("teacher")
    if teacher is not None and (phase == "train" or not cfg.distill.on_cpu):
        lines.append(teacher)
    if phase == "train":
        lines += trainer.training
    lines += [engine[t] for t in ("weights", "kv_cache") if t in held.engine and t in engine]
    if "graphs" in engine and "cuda_graph" in held.engine:
        lines.append(engine["graphs"])
    if "runtime" in engine and phase in ("start-up", "rollout", "probe"):  # the engine runs forwards
        lines.append(engine["runtime"])
    if phase in ("sync", "probe") and engine:  # a weight sync lands on this GPU
        bucket = cfg.rollout.sync_bucket_mb / 1024
        buffers = bucket * (2 + cfg.rollout.sync_rounds_in_flight / 4)
        lines.append(
            Line(
                "weight-sync buffers",
                buffers,
                f"2 buckets + {cfg.rollout.sync_rounds_in_flight} rounds of a quarter",
            )
        )
    lines.append(Line("runtime reserve", opts.reserve_gib, "CUDA contexts, NCCL, fragmentation"))
    return lines


def plan_memory(cfg: JobConfig, hf: Mapping[str, Any], world_size: int, opts: PlanOptions) -> MemoryPlan:
    """Per-GPU memory of ``cfg`` on ``world_size`` GPUs in every phase (the config must validate at
    that size), with the rollout placement the runtime computes from the same config."""
    layout = Layout.from_config(cfg.parallel, world_size)
    placement = decide_placement(
        cfg.rollout,
        offload_trainer=cfg.train.offload_trainer,
        max_staleness=cfg.generation_overlaps_training,
        world_size=world_size,
        gpus_per_node=opts.gpus_per_node,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        hf=hf,
    )
    trainer = max((_stage_lines(cfg, hf, layout, opts, s) for s in range(layout.pp)), key=lambda t: t.total)
    engine, kv_tokens, notes = _engine_lines(cfg, hf, placement, opts)
    held = placement.phases()
    names = [
        p for p in PHASES if p != "probe" or (cfg.rollout.probe_batch > 0 and placement.colocated_sglang)
    ]
    return MemoryPlan(
        world_size=world_size,
        layout=layout,
        gpu=opts.gpu,
        total_params=total_params(hf),
        params_rank=trainer.counts,
        peak_stage=trainer.stage,
        tokens_per_micro_batch=tokens_per_micro_batch(cfg),
        placement=placement,
        phases={p: _phase(p, held[p], trainer, engine, cfg, opts) for p in names},
        kv_tokens=kv_tokens,
        seq_len=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
        notes=notes + _lora_notes(cfg, trainer),
        trainable_rank=trainer.trainable,
        margin=opts.margin,
    )


def _lora_notes(cfg: JobConfig, trainer: _Trainer) -> list[str]:
    """What model.lora changes in the plan, in words."""
    lora, t = cfg.model.lora, trainer.trainable
    if not lora.enabled or t is None:
        return []
    share = t.total / max(trainer.counts.total, 1)
    return [
        f"model.lora rank {lora.rank} on {', '.join(lora.targets)}: {human_count(t.total)} trainable parameters on "
        f"this rank ({share:.2%}); gradients and optimizer state for them only; "
        + (
            "the reference is the policy with its adapters off (no copy)"
            if cfg.algorithm.kl.enabled
            else "no KL, no reference"
        )
    ]


# ----------------------------------------------------------------------------------------------------
# What to change when it does not fit


def _variant(cfg: JobConfig, section: str, **changes: Any) -> JobConfig:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def _next_multiple(current: int, limit: int, ok: Any) -> int | None:
    x = current * 2
    while x <= limit:
        if ok(x):
            return x
        x *= 2
    return None


def suggest(
    cfg: JobConfig, hf: Mapping[str, Any], world_size: int, opts: PlanOptions, plan: MemoryPlan
) -> list[str]:
    """Single changes that shrink the peak, each with its new peak (and whether it then fits)."""
    from grpo_megatron.config import ConfigError, validate

    out: list[str] = []
    gpu = opts.gpu.memory_gib

    def try_variant(label: str, variant: JobConfig, world: int = world_size) -> None:
        try:
            validate(variant, world)
            p = plan_memory(variant, hf, world, opts)
        except (ConfigError, ValueError):
            return
        worst = max(p.phases, key=p.phase_gib)
        verdict = "fits" if p.fits else "still over"
        out.append(f"{label}: peak {p.peak_gib:.1f} GiB ({worst}) of {gpu:.0f} ({verdict})")

    train_over = plan.train_gib > gpu
    engine_over = any(plan.phase_gib(p) > gpu for p in plan.phases if p != "train") or (
        plan.kv_tokens is not None and plan.kv_tokens < plan.seq_len
    )
    if train_over:
        for label, variant in _trainer_variants(cfg, plan, world_size):
            try_variant(label, variant)
    if engine_over and plan.placement.colocated_sglang:
        for label, variant in _engine_variants(cfg, plan, world_size):
            try_variant(label, variant)
    if train_over or engine_over:
        nodes = world_size // opts.gpus_per_node
        try_variant(f"--nodes {2 * nodes}", cfg, 2 * world_size)
    return out


def _trainer_variants(cfg: JobConfig, plan: MemoryPlan, world_size: int) -> list[tuple[str, JobConfig]]:
    out = []
    par = cfg.parallel
    if cfg.model.recompute != "full":
        out.append(("model.recompute=full", _variant(cfg, "model", recompute="full")))
    mb = tokens_per_micro_batch(cfg)
    if (
        mb >= 2 * plan.seq_len
        or cfg.train.max_tokens_per_micro_batch is None
        and cfg.train.micro_batch_size > 1
    ):
        half = max(mb // 2, plan.seq_len)
        out.append(
            (
                f"train.max_tokens_per_micro_batch={half}",
                _variant(cfg, "train", max_tokens_per_micro_batch=half),
            )
        )
    if plan.params_rank.expert:
        ep = _next_multiple(par.ep, world_size, lambda x: True)
        if ep:
            out.append((f"parallel.ep={ep}", _variant(cfg, "parallel", ep=ep)))
    for name in ("tp", "pp"):
        value = _next_multiple(getattr(par, name), world_size, lambda x: True)
        if value:
            out.append((f"parallel.{name}={value}", _variant(cfg, "parallel", **{name: value})))
    if not par.use_distributed_optimizer:
        out.append(
            (
                "parallel.use_distributed_optimizer=true",
                _variant(cfg, "parallel", use_distributed_optimizer=True),
            )
        )
    if cfg.distill.enabled and not cfg.distill.on_cpu:
        out.append(("distill.on_cpu=true", _variant(cfg, "distill", on_cpu=True)))
    return out


def _engine_variants(cfg: JobConfig, plan: MemoryPlan, world_size: int) -> list[tuple[str, JobConfig]]:
    out = []
    if not cfg.train.offload_trainer:
        out.append(
            (
                "train.offload_trainer=true (trainer state off the GPU while engines generate)",
                _variant(cfg, "train", offload_trainer=True),
            )
        )
    more = 2 * plan.placement.gpus_per_engine
    if more <= world_size:
        sglang = dataclasses.replace(cfg.rollout.sglang, tp=more)
        out.append((f"rollout.sglang.tp={more}", _variant(cfg, "rollout", sglang=sglang)))
    engine = ("engine weights", "engine KV cache")
    resident = max(
        sum(x.gib for x in plan.phases[p] if x.name not in engine) for p in ("start-up", "rollout")
    )
    room = (plan.limit_gib - resident) / plan.gpu.memory_gib  # the pool's share that keeps the margin
    if 0 < room < cfg.rollout.gpu_memory_utilization:
        frac = round(room - 0.005, 2)
        out.append(
            (f"rollout.gpu_memory_utilization={frac}", _variant(cfg, "rollout", gpu_memory_utilization=frac))
        )
    return out


# ----------------------------------------------------------------------------------------------------
# Printing


def _ranks(members: tuple[int, ...]) -> str:
    return f"{members[0]}-{members[-1]}" if len(members) > 1 else str(members[0])


def placement_lines(p: RolloutPlacement, receives_gb: float | None = None) -> list[str]:
    """The placement as ``plan`` prints it: engines, their ranks and nodes, EP, what each GPU gets."""
    if p.mode == "disaggregated":
        return [f"rollout: {p.why['engines']}", f"offload: {p.why['offload']}"]
    kind = "SGLang" if p.engine == "sglang" else "embedded"
    head = f"rollout: {len(p.engines)} {kind} engine(s) x {p.gpus_per_engine} GPU(s)"
    out = [head + (f" ({p.why['width']})" if "width" in p.why else f" ({p.why.get('engines', '')})")]
    if p.engine == "sglang":
        out.append(f"  engine EP {p.engine_ep} ({p.why['ep']})")
    shown = list(range(min(len(p.engines), 3))) + ([len(p.engines) - 1] if len(p.engines) > 3 else [])
    for i in shown:
        nodes = p.nodes(i)
        where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"
        ranks = f"ranks {_ranks(p.engines[i])}" if len(p.engines[i]) > 1 else f"rank {p.engines[i][0]}"
        out.append(f"  engine {i}: {ranks} on {where}, led by rank {p.engines[i][0]}")
        if i == 2 and len(p.engines) > 4:
            out.append(f"  ... ({len(p.engines) - 4} more)")
    if receives_gb is not None:
        out.append(
            f"  each engine GPU receives {receives_gb:.2f} GB per weight sync (dense weights + experts / EP)"
        )
    out.append(f"  offload: {p.why['offload']}" + (f"; {p.why['memory']}" if "memory" in p.why else ""))
    return out


def render(plan: MemoryPlan, cfg: JobConfig, receives_gb: float | None = None) -> Any:
    """A rich renderable: the layout, the placement, every phase's memory, the verdict and the
    suggestions."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    lo = plan.layout
    head = Text(
        f"{cfg.model.hf_path}: {human_count(plan.total_params)} parameters | world {plan.world_size} = "
        f"tp {lo.tp} x pp {lo.pp} x cp {lo.cp} x dp {lo.dp}"
        + (f"; experts: ep {lo.ep} x etp {lo.etp} x edp {lo.edp}" if plan.params_rank.expert else "")
        + f" | {plan.gpu.name} ({plan.gpu.memory_gib:.1f} GiB) | micro-batch {plan.tokens_per_micro_batch:,} tokens"
    )
    parts: list[Any] = [head] + [Text(line) for line in placement_lines(plan.placement, receives_gb)]
    table = Table(
        title=f"memory per GPU by phase, GiB (busiest rank: pipeline stage {plan.peak_stage})",
        title_justify="left",
    )
    table.add_column("per GPU")
    names = list(plan.phases)
    for name in names:
        table.add_column(name, justify="right")
    table.add_column("how")
    rows: dict[str, tuple[dict[str, float], str]] = {}
    for name in ("train", *names):  # the trainer's lines first, in the train phase's order
        for line in plan.phases.get(name, []):
            rows.setdefault(line.name, ({}, line.note))[0][name] = line.gib
    rows["runtime reserve"] = rows.pop("runtime reserve")
    for row, (cells, note) in rows.items():
        table.add_row(row, *(f"{cells[n]:.2f}" if n in cells else "" for n in names), note)
    totals = [plan.phase_gib(n) for n in names]
    colored = [f"[{'red' if t > plan.limit_gib else 'green'}]{t:.2f}[/]" for t in totals]
    table.add_row(
        "total", *colored, f"of {plan.gpu.memory_gib:.1f} GiB ({plan.limit_gib:.1f} with the margin)"
    )
    parts.append(table)
    for note in plan.notes:
        parts.append(Text(f"note: {note}"))
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    worst = max(plan.phases, key=plan.phase_gib)
    parts.append(
        Text(
            f"{verdict} on {plan.gpu.name}: peak {plan.peak_gib:.1f} GiB ({worst}) = {plan.peak_frac:.1%} of the GPU; "
            f"a plan fits up to {1 - plan.margin:.0%} ({plan.limit_gib:.1f} GiB): the rest is for what it does not model",
            style="bold green" if plan.fits else "bold red",
        )
    )
    if plan.suggestions:
        parts.append(Text("what to change (one change at a time):"))
        parts += [Text(f"  - {s}") for s in plan.suggestions]
    return Group(*parts)
