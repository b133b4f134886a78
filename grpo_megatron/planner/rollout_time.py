"""How long a rollout takes beside the timeouts it runs under (``grpo-megatron plan``; pure arithmetic).

Why it matters: in the synchronous colocated loop every rank but an engine's leader waits for the
rollout inside the results' collective (``rollout/results.py``: a broadcast per engine over the data
group), under ``parallel.timeout_minutes``; the leaders wait for their engine under the watchdog's
``parallel.long_phase_timeout_s``. A rollout longer than the smaller of the two ends the job, however
healthy it is (issue 51 item 7: DeepSeek-V3's 32-GPU engines held 3 full-length sequences each, so
past a mean response of ~12k tokens its 256 completions per engine outlasted 60 minutes).

The model, one engine of a colocated SGLang fleet (decode dominates; prefill, sampling and the
scheduler's overheads are left out):

    C      = prompts_per_iteration x n_samples_per_prompt / engines   completions per engine
    L      = max_prompt_tokens + R                                    tokens of a sequence (R: response)
    S      = min(C, KV // L)                                          sequences the pool decodes at once
    waves  = ceil(C / S),  steps = waves x R
    t_step = (dense + experts x f + KV read) / HBM bandwidth + layers x 2 x latency
    f      = 1 - (1 - k / E) ** S                                    a GPU's experts' share S tokens reach
    KV read = S x (P + R / 2) x KV bytes per token per GPU            (a wave's mean context)
    time   = steps x t_step

Decode is bound by memory bandwidth (Pope et al. 2022, "Efficiently Scaling Transformer Inference",
section 3: at small batches each step reads every weight it uses and the KV cache once); an MoE step
reads only the experts its tokens are routed to (uniform routing assumed); each layer adds two
collectives (attention's and the MLP's all-reduce or the experts' all-to-all) of ``latency`` each, a
few tens of microseconds with NCCL (more across nodes). KV is what the memory plan gives the pool
(``MemoryPlan.kv_tokens``). Calibration: DeepSeek-V3's 32-GPU engine at 3 sequences comes to
~8 ms per step, and its rollout reaches 60 minutes at a mean response of ~12k tokens, as issue 51
found; not yet measured on a GPU cluster.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_megatron.planner.model_states import ModelDims, canonical_tensors

if TYPE_CHECKING:
    from grpo_megatron.config import JobConfig
    from grpo_megatron.planner.memory import MemoryPlan

HBM_BYTES_PER_S = {"H100 80GB": 3.35e12, "H200 141GB": 4.8e12}
"""Memory bandwidth by the catalogue's GPU name (NVIDIA's data sheets, SXM); others take the H100's."""
LATENCY_S = {"node": 20e-6, "nodes": 50e-6}
"""One small collective's latency inside a node (NVLink) and across nodes (InfiniBand)."""


@dataclass(frozen=True)
class RolloutTime:
    """One engine's rollout at a planned mean response of ``response_tokens``."""

    completions: int
    concurrent: int
    waves: int
    step_s: float
    seconds: float
    response_tokens: int
    timeout_s: float
    """The smaller of parallel.timeout_minutes and parallel.long_phase_timeout_s (0: off)."""
    timeout_name: str
    longest_fitting: int
    """The largest mean response (tokens, up to rollout.max_new_tokens) whose rollout fits the timeout;
    0 when none does."""

    @property
    def fits(self) -> bool:
        return self.seconds <= self.timeout_s


def _engine_bytes(hf: Mapping[str, Any], width: int, dtype_bytes: int) -> tuple[float, float]:
    """(dense, experts) weight bytes on one engine GPU (every tensor split over ``width``; replicated
    ones are few next to the experts: ``memory.engine_weight_params`` has them exactly)."""
    d = ModelDims.from_hf(hf)
    dense = experts = 0.0
    for t in canonical_tensors(hf, padded_vocab=d.vocab, te=True):
        share = t.numel * dtype_bytes / (1 if t.partition_dim is None else width)
        if ".experts." in t.name:
            experts += share
        else:
            dense += share
    return dense, experts


@dataclass(frozen=True)
class EngineStep:
    """What one decode step of an engine GPU reads and waits for."""

    dense_bytes: float
    expert_bytes: float
    topk: int
    experts: int
    layers: int
    latency_s: float
    """One collective's latency (``LATENCY_S``; 0 on one GPU)."""
    hbm: float
    """Memory bandwidth, bytes per second."""

    def seconds(self, sequences: int, context: float, kv_bytes_per_token: float) -> float:
        """One decode step with ``sequences`` sequences of mean ``context`` tokens (the module's t_step)."""
        touched = 1.0 - (1.0 - self.topk / self.experts) ** sequences if self.experts else 1.0
        read = self.dense_bytes + self.expert_bytes * touched + sequences * context * kv_bytes_per_token
        return read / self.hbm + self.layers * 2 * self.latency_s


def engine_step(
    hf: Mapping[str, Any], *, width: int, gpus_per_node: int, dtype_bytes: int, hbm: float
) -> EngineStep:
    """``EngineStep`` of an engine of ``width`` GPUs."""
    d = ModelDims.from_hf(hf)
    dense, experts = _engine_bytes(hf, width, dtype_bytes)
    latency = LATENCY_S["nodes" if width > gpus_per_node else "node"] if width > 1 else 0.0
    return EngineStep(dense, experts, d.topk, d.num_experts, d.num_layers, latency, hbm)


def rollout_time(
    cfg: JobConfig, hf: Mapping[str, Any], plan: MemoryPlan, response_tokens: int
) -> RolloutTime | None:
    """The rollout of one engine of ``plan``'s colocated SGLang fleet at a mean response of
    ``response_tokens``; None where the plan has no KV pool (an embedded or disaggregated engine)."""
    from grpo_megatron.planner.memory import DTYPE_BYTES, kv_bytes_per_token

    placement, kv_tokens = plan.placement, plan.kv_tokens
    if kv_tokens is None or not placement.engines:
        return None
    width, prompt = placement.gpus_per_engine, cfg.data.max_prompt_tokens
    completions = math.ceil(
        cfg.train.prompts_per_iteration * cfg.rollout.n_samples_per_prompt / len(placement.engines)
    )
    kv_per_token = kv_bytes_per_token(ModelDims.from_hf(hf), width, cfg.rollout.sglang.server_args)
    step = engine_step(
        hf,
        width=width,
        gpus_per_node=placement.gpus_per_node,
        dtype_bytes=DTYPE_BYTES[cfg.model.dtype],
        hbm=HBM_BYTES_PER_S.get(plan.gpu.name, HBM_BYTES_PER_S["H100 80GB"]),
    )
    limits = [
        (cfg.parallel.timeout_minutes * 60.0, f"parallel.timeout_minutes={cfg.parallel.timeout_minutes}")
    ]
    if cfg.parallel.long_phase_timeout_s > 0:
        long_phase = cfg.parallel.long_phase_timeout_s
        limits.append((long_phase, f"parallel.long_phase_timeout_s={long_phase:g}"))
    timeout_s, timeout_name = min(limits)

    def at(r: int) -> tuple[int, int, float, float]:
        concurrent = max(1, min(completions, kv_tokens // max(prompt + r, 1)))
        waves = math.ceil(completions / concurrent)
        seconds = step.seconds(concurrent, prompt + r / 2, kv_per_token)
        return concurrent, waves, seconds, waves * r * seconds

    concurrent, waves, step_s, seconds = at(response_tokens)
    lengths = sorted({*range(256, cfg.rollout.max_new_tokens, 256), cfg.rollout.max_new_tokens})
    fitting = [r for r in lengths if at(r)[3] <= timeout_s]
    return RolloutTime(
        completions,
        concurrent,
        waves,
        step_s,
        seconds,
        response_tokens,
        timeout_s,
        timeout_name,
        max(fitting, default=0),
    )


def render(t: RolloutTime, cfg: JobConfig, planned_by: str) -> str:
    verdict = "within" if t.fits else "BEYOND"
    lines = [
        f"rollout time (one engine, colocated SGLang; model in planner/rollout_time.py): "
        f"{t.completions} completions per engine, mean response {t.response_tokens:,} tokens "
        f"({planned_by}): {t.concurrent} sequences at once (the KV pool), {t.waves} waves, "
        f"~{t.step_s * 1e3:.1f} ms per decode step -> ~{t.seconds / 60:.0f} min, "
        f"{verdict} {t.timeout_name} ({t.timeout_s / 60:.0f} min)",
        f"  fits the timeout up to a mean response of {t.longest_fitting:,} tokens "
        f"(rollout.max_new_tokens={cfg.rollout.max_new_tokens:,})"
        if t.longest_fitting
        else "  fits the timeout at no mean response length",
    ]
    if not t.fits:
        lines.append(
            "  what to change: more KV per engine (rollout.gpu_memory_utilization, "
            "rollout.sglang.server_args.kv_cache_dtype=fp8_e4m3), fewer completions per engine (more, "
            "smaller engines: rollout.sglang.tp), or a longer parallel.timeout_minutes / long_phase_timeout_s"
        )
    return "\n".join(lines)
