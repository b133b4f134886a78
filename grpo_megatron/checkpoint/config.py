"""Checkpoint section of the job config: when to save and where to resume from."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

SAVE_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT")
"""Names `checkpoint.signal` may take (SIGTERM is always handled)."""


@dataclass
class CheckpointConfig:
    """Saving and resuming of model, optimizer, scheduler, data and RNG state."""

    dir: str | None = None
    """Checkpoint directory (relative to the current directory); None = <logging.run_dir>/checkpoints."""
    save_interval: int = 0
    """Save every this many iterations; 0 = never save periodically."""
    resume: str = "auto"
    """auto = resume from the latest checkpoint in `dir` if there is one; none = start fresh;
    anything else = path of the checkpoint to resume from (an iter_XXXXXXX directory, or a
    checkpoint directory whose `latest` names one)."""
    keep_last: int | None = None
    """Keep only the newest this many checkpoints; None = keep all."""
    optimizer_format: Literal["fully_reshardable", "dp_reshardable"] = "fully_reshardable"
    """On-disk layout of the distributed optimizer's state (parallel.use_distributed_optimizer):
    fully_reshardable gathers each data-parallel group's state into per-parameter tensors, which
    load at any TP/PP/EP/DP layout; dp_reshardable writes each rank's shard as it is (no gather,
    faster for large models) and loads only at the same TP/PP/EP layout (DP may change)."""
    load_optimizer: bool = True
    """Restore the optimizer state on resume; false = model weights, LR schedule, RNG and trainer
    state only, with a fresh optimizer (for a layout change the optimizer state cannot follow)."""

    export_hf_dir: str | None = None
    """At the end of `grpo-megatron train`, also write the policy as a Hugging Face checkpoint
    (safetensors, config.json, tokenizer files) to this directory through the weight bridge's export
    stream; None = no export. A relative path is relative to logging.run_dir."""

    signal: str | None = "SIGUSR1"
    """A second signal that, like SIGTERM, makes the run save and stop (preemption): every rank stops
    at the next safe point (a rollout cut short and its batch dropped, an update at its next
    mini-batch: training/grpo.py), a checkpoint is written and every rank exits 75
    (distributed/preemption.py). SIGUSR1 matches launch/slurm/train.sbatch's early warning
    (``#SBATCH --signal=B:USR1@120``); one of SIGUSR1, SIGUSR2, SIGHUP, SIGINT, or null for SIGTERM only."""
    signal_grace_s: float = 90.0
    """Seconds from the first signal within which the run must have saved and stopped; past them
    (or at a second signal) every rank exits at once (exit code 143; with the checkpoint already
    written, 75). It must exceed the longest stop (a mini-batch of the update, the sync and a save:
    ``grpo-megatron plan`` prints it), and stay below the scheduler's warning (the ``--signal`` lead,
    120 s in train.sbatch) so that the save is not cut short by the kill that follows."""

    def validate(self) -> None:
        errors = []
        if self.signal is not None and self.signal not in SAVE_SIGNALS:
            errors.append(
                f"checkpoint.signal={self.signal!r} must be one of {', '.join(SAVE_SIGNALS)}, or null"
            )
        if not (math.isfinite(self.signal_grace_s) and self.signal_grace_s > 0):
            errors.append(f"checkpoint.signal_grace_s={self.signal_grace_s} must be a number of seconds > 0")
        if self.save_interval < 0:
            errors.append(f"checkpoint.save_interval={self.save_interval} must be >= 0 (0 = never)")
        if self.keep_last is not None and self.keep_last < 1:
            errors.append(f"checkpoint.keep_last={self.keep_last} must be >= 1, or null to keep all")
        if not self.resume:
            errors.append("checkpoint.resume is empty: use auto, none or a checkpoint path")
        if self.optimizer_format not in ("fully_reshardable", "dp_reshardable"):
            errors.append(
                f"checkpoint.optimizer_format={self.optimizer_format!r} must be fully_reshardable or "
                "dp_reshardable"
            )
        if errors:
            raise ValueError("\n".join(errors))
