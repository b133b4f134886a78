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
    rank_param_counts,
    stage_layers,
    total_params,
)

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


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of the estimate that the job config does not hold."""

    gpus_per_node: int = 8
    """GPUs per node (the world size is nodes x gpus_per_node)."""
    gpu: GPU = GPUS["h100"]
    """The GPU the job runs on."""
    rollout_gpus_per_engine: int | None = None
    """GPUs one SGLang engine spans; None = from rollout.placement (per_node: a node,
    per_dp_rank: one model replica, tp*pp*cp GPUs)."""
    rollout_weight_bytes: int = 2
    """Bytes per weight in the rollout engine (2 = bf16; 1 for fp8 engines)."""
    offload_trainer: bool = False
    """Trainer parameters, gradients and optimizer state leave the GPU while the engine generates
    (otherwise they stay resident beside the engine)."""
    grad_bytes: int = 4
    """Bytes per main gradient: 4, because training/policy.py reduces gradients in fp32."""
    moe_imbalance: float = 1.25
    """Routed tokens on the busiest expert rank relative to a perfect balance (dropless MoE)."""
    reserve_gib: float = 4.0
    """CUDA context, NCCL buffers and allocator fragmentation, per GPU."""


@dataclass(frozen=True)
class Line:
    """One row of the memory table."""

    name: str
    gib: float
    note: str = ""


@dataclass
class MemoryPlan:
    """Per-GPU memory of the busiest rank in each phase, and whether it fits."""

    world_size: int
    layout: Layout
    gpu: GPU
    total_params: int
    params_rank: ParamCounts
    peak_stage: int
    tokens_per_micro_batch: int
    train: list[Line]
    rollout: list[Line]
    kv_tokens: int | None
    seq_len: int
    notes: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)

    @property
    def train_gib(self) -> float:
        return sum(x.gib for x in self.train)

    @property
    def rollout_gib(self) -> float:
        return sum(x.gib for x in self.rollout)

    @property
    def fits(self) -> bool:
        kv_ok = self.kv_tokens is None or self.kv_tokens >= self.seq_len
        return self.train_gib <= self.gpu.memory_gib and self.rollout_gib <= self.gpu.memory_gib and kv_ok


def tokens_per_micro_batch(cfg: JobConfig) -> int:
    """Tokens of one training micro-batch (before context parallelism splits it)."""
    if cfg.train.max_tokens_per_micro_batch is not None:
        return cfg.train.max_tokens_per_micro_batch
    return cfg.train.micro_batch_size * (cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)


def kv_bytes_per_token(d: ModelDims, engine_gpus: int) -> float:
    """KV-cache bytes per token on one GPU of an engine (bf16 cache, TP over the engine's GPUs):
    GQA keeps 2 x layers x kv heads x head_dim (kv heads split, or replicated when fewer than the
    GPUs); MLA keeps one compressed latent plus the rope key per layer, on every GPU."""
    if d.mla:
        return d.num_layers * (d.kv_lora + d.qk_rope) * 2
    heads_per_gpu = max(1, -(-d.kv_groups // engine_gpus))
    return 2 * d.num_layers * heads_per_gpu * d.head_dim * 2


def _rollout_phase(
    cfg: JobConfig,
    opts: PlanOptions,
    layout: Layout,
    d: ModelDims,
    all_params: int,
    seq_len: int,
    train_lines: list[Line],
) -> tuple[list[Line], int | None, list[str]]:
    """The rollout phase's lines (an SGLang engine's weights and KV cache beside what the trainer keeps
    resident), its KV-cache tokens (None: not planned) and the plan's notes."""
    gib = GIB
    notes: list[str] = []
    rollout_lines: list[Line] = []
    kv_tokens: int | None = None
    if cfg.rollout.engine == "sglang":
        engine_gpus = opts.rollout_gpus_per_engine or (
            opts.gpus_per_node if cfg.rollout.placement == "per_node" else layout.tp * layout.pp * layout.cp
        )
        pool = cfg.rollout.gpu_memory_utilization * opts.gpu.memory_gib * gib
        weights = all_params * opts.rollout_weight_bytes / engine_gpus
        kv = pool - weights
        kv_tokens = max(0, int(kv // kv_bytes_per_token(d, engine_gpus)))
        resident = 0.0
        if not opts.offload_trainer:
            resident = sum(x.gib for x in train_lines if x.name in ("parameters", "gradients", "optimizer state", "reference model"))
        rollout_lines = [
            Line("engine weights", weights / gib, f"{human_count(all_params)} / {engine_gpus} GPUs per engine"),
            Line("engine KV cache", max(kv, 0) / gib, f"{kv_tokens:,} tokens ({kv_tokens // max(seq_len, 1):,} full sequences)"),
            Line("trainer, resident", resident, "offloaded" if opts.offload_trainer else "params + grads + optimizer (+ ref)"),
            Line("runtime reserve", opts.reserve_gib, "CUDA context, NCCL, fragmentation"),
        ]
        if kv <= 0:
            notes.append(
                f"the engine's weights ({weights / gib:.1f} GiB per GPU) exceed its pool "
                f"(rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} x {opts.gpu.memory_gib:.0f} GiB)"
            )
        notes.append("training phase assumes the engine released its memory (SGLang memory saver)")
    else:
        notes.append("rollout.engine=embedded: generation reuses the policy's weights; its KV cache is not planned")
    return rollout_lines, kv_tokens, notes


def plan_memory(cfg: JobConfig, hf: Mapping[str, Any], world_size: int, opts: PlanOptions) -> MemoryPlan:
    """Per-GPU memory of ``cfg`` on ``world_size`` GPUs (the config must validate at that size)."""
    layout = Layout.from_config(cfg.parallel, world_size)
    d = ModelDims.from_hf(hf)
    te = cfg.model.transformer_impl != "local"  # GPUs use TransformerEngine unless told otherwise
    flash = te
    vp = padded_vocab_size(d.vocab, cfg.model.make_vocab_size_divisible_by, layout.tp)
    tensors = canonical_tensors(hf, padded_vocab=vp, pp=layout.pp, te=te)
    pbytes = DTYPE_BYTES[cfg.model.dtype]
    act_bytes = pbytes
    tokens_mb = tokens_per_micro_batch(cfg)
    seq_len = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    tokens = tokens_mb / layout.cp  # on one rank
    # 1F1B: the first stage holds the activations of pp micro-batches, the last one of one.
    opt_bytes = 8 if pbytes == 4 else 12  # Adam moments (+ fp32 master copy of 16-bit params)
    dense_shards = layout.dp * layout.cp if cfg.parallel.use_distributed_optimizer else 1
    expert_shards = layout.edp if cfg.parallel.use_distributed_optimizer else 1
    gib = GIB

    best: tuple[float, int, list[Line], ParamCounts] | None = None
    for stage in range(layout.pp):
        counts = rank_param_counts(tensors, layout, d, stage)
        layers = stage_layers(d.num_layers, layout.pp, stage)
        in_flight = layout.pp - stage
        per_layer = [
            layer_activation_bytes(d, i, layout, act_bytes, seq_len=seq_len, flash=flash, moe_imbalance=opts.moe_imbalance)
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
            act_note = f"{len(layers)} layers x {in_flight} micro-batch(es) in flight, {cfg.model.recompute} recompute"
        if stage == layout.pp - 1:
            act += output_activation_bytes(vp, layout, act_bytes) * tokens
        dispatch = dispatch_buffer_bytes(d, layout, act_bytes, tokens, opts.moe_imbalance)
        lines = [
            Line("parameters", counts.total * pbytes / gib, f"{human_count(counts.total)} on this rank ({cfg.model.dtype})"),
            Line("gradients", counts.total * opts.grad_bytes / gib, f"fp{8 * opts.grad_bytes} main grads"),
            Line(
                "optimizer state",
                (counts.dense * opt_bytes / dense_shards + counts.expert * opt_bytes / expert_shards) / gib,
                f"{opt_bytes} B/param, dense / {dense_shards}, experts / {expert_shards}",
            ),
            Line("activations", act / gib, act_note),
        ]
        if d.num_experts:
            lines.append(Line("MoE dispatch buffers", dispatch / gib, "all-to-all send + receive of one layer"))
        if cfg.algorithm.kl.enabled:
            lines.append(Line("reference model", counts.total * pbytes / gib, "frozen copy, same sharding"))
        lines.append(Line("runtime reserve", opts.reserve_gib, "CUDA context, NCCL, fragmentation"))
        total = sum(x.gib for x in lines)
        if best is None or total > best[0]:
            best = (total, stage, lines, counts)
    assert best is not None
    _, peak_stage, train_lines, counts = best

    all_params = total_params(hf)
    rollout_lines, kv_tokens, notes = _rollout_phase(cfg, opts, layout, d, all_params, seq_len, train_lines)
    return MemoryPlan(
        world_size=world_size,
        layout=layout,
        gpu=opts.gpu,
        total_params=all_params,
        params_rank=counts,
        peak_stage=peak_stage,
        tokens_per_micro_batch=tokens_mb,
        train=train_lines,
        rollout=rollout_lines,
        kv_tokens=kv_tokens,
        seq_len=seq_len,
        notes=notes,
    )


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


def suggest(cfg: JobConfig, hf: Mapping[str, Any], world_size: int, opts: PlanOptions, plan: MemoryPlan) -> list[str]:
    """Single changes that shrink the peak, each with its new peak (and whether it then fits)."""
    from grpo_megatron.config import ConfigError, validate

    out: list[str] = []
    gpu = opts.gpu.memory_gib

    def try_variant(label: str, variant: JobConfig, variant_opts: PlanOptions = opts, world: int = world_size) -> None:
        try:
            validate(variant, world)
        except ConfigError:
            return
        p = plan_memory(variant, hf, world, variant_opts)
        verdict = "fits" if p.fits else "still over"
        out.append(f"{label}: train {p.train_gib:.1f} GiB, rollout {p.rollout_gib:.1f} GiB of {gpu:.0f} ({verdict})")

    train_over = plan.train_gib > gpu
    rollout_over = plan.rollout_gib > gpu or (plan.kv_tokens is not None and plan.kv_tokens < plan.seq_len)
    par = cfg.parallel
    if train_over:
        if cfg.model.recompute != "full":
            try_variant("model.recompute=full", _variant(cfg, "model", recompute="full"))
        mb = tokens_per_micro_batch(cfg)
        if mb >= 2 * plan.seq_len or cfg.train.max_tokens_per_micro_batch is None and cfg.train.micro_batch_size > 1:
            try_variant(
                f"train.max_tokens_per_micro_batch={max(mb // 2, plan.seq_len)}",
                _variant(cfg, "train", max_tokens_per_micro_batch=max(mb // 2, plan.seq_len)),
            )
        if plan.params_rank.expert:
            ep = _next_multiple(par.ep, world_size, lambda x: True)
            if ep:
                try_variant(f"parallel.ep={ep}", _variant(cfg, "parallel", ep=ep))
        for name in ("tp", "pp"):
            value = _next_multiple(getattr(par, name), world_size, lambda x: True)
            if value:
                try_variant(f"parallel.{name}={value}", _variant(cfg, "parallel", **{name: value}))
        if not par.use_distributed_optimizer:
            try_variant("parallel.use_distributed_optimizer=true", _variant(cfg, "parallel", use_distributed_optimizer=True))
    if rollout_over and cfg.rollout.engine == "sglang":
        if not opts.offload_trainer:
            try_variant("--offload-trainer (trainer state off the GPU during rollout)", cfg,
                        dataclasses.replace(opts, offload_trainer=True))
        engine = opts.rollout_gpus_per_engine or 0
        more = max(engine * 2, opts.gpus_per_node * 2)
        if more <= world_size:
            try_variant(f"--rollout-gpus-per-engine {more}", cfg, dataclasses.replace(opts, rollout_gpus_per_engine=more))
        resident = sum(x.gib for x in plan.rollout if x.name in ("trainer, resident", "runtime reserve"))
        room = (gpu - resident) / gpu
        if 0 < room < cfg.rollout.gpu_memory_utilization:
            frac = round(room - 0.005, 2)
            try_variant(f"rollout.gpu_memory_utilization={frac}", _variant(cfg, "rollout", gpu_memory_utilization=frac))
    if train_over or rollout_over:
        nodes = world_size // opts.gpus_per_node
        try_variant(f"--nodes {2 * nodes}", cfg, opts, 2 * world_size)
    return out


# ----------------------------------------------------------------------------------------------------
# Printing


def render(plan: MemoryPlan, cfg: JobConfig) -> Any:
    """A rich renderable: the layout, one table per phase, the verdict and the suggestions."""
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
    parts: list[Any] = [head]
    for title, lines, total in (
        (f"training (busiest rank: pipeline stage {plan.peak_stage})", plan.train, plan.train_gib),
        ("rollout (colocated engine)", plan.rollout, plan.rollout_gib),
    ):
        if not lines:
            continue
        table = Table(title=title, title_justify="left")
        table.add_column("per GPU")
        table.add_column("GiB", justify="right")
        table.add_column("how")
        for line in lines:
            table.add_row(line.name, f"{line.gib:.2f}", line.note)
        over = total > plan.gpu.memory_gib
        table.add_row("total", f"[{'red' if over else 'green'}]{total:.2f}[/]", f"of {plan.gpu.memory_gib:.1f} GiB")
        parts.append(table)
    for note in plan.notes:
        parts.append(Text(f"note: {note}"))
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    parts.append(Text(f"{verdict} on {plan.gpu.name}", style="bold green" if plan.fits else "bold red"))
    if plan.suggestions:
        parts.append(Text("what to change (one change at a time):"))
        parts += [Text(f"  - {s}") for s in plan.suggestions]
    return Group(*parts)
