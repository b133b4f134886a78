"""How long a stop on a signal takes, and the Slurm settings it needs (``grpo-megatron plan``; arithmetic).

A signal (Slurm's SIGTERM, or ``checkpoint.signal`` from ``#SBATCH --signal=B:USR1@lead``) stops the
synchronous loop at its next safe point (training/grpo.py, issue 51): during the rollout, the reward
or the logprob passes the engines' generation is cut short, the batch dropped and the iteration
before saved at once; during the update the next mini-batch boundary ends it, the iteration runs its
sync (and probe; an evaluation is cut short and dropped) and is saved. The longest wait is therefore a
signal right after a mini-batch began:

    stop = mini-batch + sync + save

    mini-batch = train flops / (GPUs x peak x MFU) / train.updates_per_iteration,  train flops = 6 x
             active params x tokens (8 with full recompute),
             tokens = prompts_per_iteration x n_samples_per_prompt x (max_prompt_tokens + R)
    save   = a node's checkpoint bytes (each GPU's parameters and optimizer state: the memory plan's
             lines) / the node's write bandwidth

R is the planned mean response (``--response-tokens``), the sync time ``planner/sync.py``'s. The
recommended settings cover ``stop`` with half again as margin: ``--signal=B:USR1@lead`` (``lead``:
seconds before the time limit), ``checkpoint.signal_grace_s`` = ``lead`` - 30 (the ranks give up, exit
143, before the limit's SIGTERM, which would be a second signal); and a SIGTERM with no warning (a
preemption) needs Slurm's ``GraceTime`` (partition or QOS; default 0), a time limit's ``KillWait``
(default 30 s), to be at least ``stop``. With the asynchronous or continuous arrangements
(``train.max_staleness`` > 0, partial rollouts) the safe point is the iteration's end: the rollout
adds to it (not estimated here). Nothing here has been compared with a GPU cluster's run.
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

PEAK_BF16_FLOPS = {"H100 80GB": 989e12, "H200 141GB": 989e12}
"""Dense bf16 tensor-core peak per GPU (NVIDIA's data sheets, SXM, no sparsity); others take the H100's."""
MFU = 0.25
"""The share of the peak a training step reaches (assumed; MoE models at scale report 20-40%)."""
WRITE_GBPS_PER_NODE = 2.0
"""A node's checkpoint write bandwidth to the shared file system, GB/s (assumed; ``--ckpt-gbps``)."""
EXIT_S = 30
"""Seconds left between the ranks' give-up (the grace) and the time limit: exit, exit file, requeue."""


@dataclass(frozen=True)
class StopTime:
    update_s: float
    """One mini-batch of the update (the update's part a stop waits for)."""
    sync_s: float
    save_s: float
    lead_s: int
    """Recommended ``--signal=B:USR1@lead``."""
    grace_s: int
    """Recommended ``checkpoint.signal_grace_s``."""

    @property
    def stop_s(self) -> float:
        return self.update_s + self.sync_s + self.save_s


def active_params(hf: Mapping[str, Any]) -> float:
    """Parameters one token passes through: every non-expert one, and top-k of E of the experts'."""
    d = ModelDims.from_hf(hf)
    dense = experts = 0
    for t in canonical_tensors(hf, padded_vocab=d.vocab, te=True):
        if ".experts." in t.name:
            experts += t.numel
        else:
            dense += t.numel
    return dense + (experts * d.topk / d.num_experts if d.num_experts else experts)


def stop_time(
    cfg: JobConfig,
    hf: Mapping[str, Any],
    plan: MemoryPlan,
    *,
    response_tokens: int,
    sync_s: float,
    write_gbps: float = WRITE_GBPS_PER_NODE,
) -> StopTime:
    """The module's ``stop`` for ``cfg`` on ``plan``'s cluster, and the settings that cover it."""
    tokens = (
        cfg.train.prompts_per_iteration
        * cfg.rollout.n_samples_per_prompt
        * (cfg.data.max_prompt_tokens + response_tokens)
    )
    per_token = 8 if cfg.model.recompute == "full" else 6
    flops = per_token * active_params(hf) * tokens
    peak = PEAK_BF16_FLOPS.get(plan.gpu.name, PEAK_BF16_FLOPS["H100 80GB"])
    update_s = flops / (plan.world_size * peak * MFU) / max(cfg.train.updates_per_iteration, 1)
    gpus_per_node = min(plan.placement.gpus_per_node, plan.world_size)
    saved = sum(line.gib for line in plan.phases["save"] if line.name in ("parameters", "optimizer state"))
    save_s = saved * 2**30 * gpus_per_node / (write_gbps * 1e9)
    stop = update_s + sync_s + save_s
    lead = 60 * math.ceil(1.5 * stop / 60 + EXIT_S / 60)
    return StopTime(update_s, sync_s, save_s, lead, lead - EXIT_S)


def render(t: StopTime, cfg: JobConfig) -> str:
    return "\n".join(
        [
            f"stop on a signal (planner/preemption.py): at most ~{t.stop_s:.0f} s from a signal to the "
            f"checkpoint (a mini-batch of the update ~{t.update_s:.0f} s at {MFU:.0%} MFU, "
            f"sync ~{t.sync_s:.0f} s, save "
            f"~{t.save_s:.0f} s; a rollout, reward or evaluation is cut short)",
            f"  Slurm: sbatch --signal=B:USR1@{t.lead_s} (train.sbatch has @120), "
            f"checkpoint.signal_grace_s={t.grace_s} (now {cfg.checkpoint.signal_grace_s:g}); a SIGTERM "
            f"without warning needs GraceTime (preemption) or KillWait (time limit) >= "
            f"{math.ceil(t.stop_s)} s",
        ]
    )
