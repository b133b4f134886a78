"""Checkpoint section of the job config: when to save and where to resume from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    """Saving and resuming of model, optimizer, scheduler, data and RNG state."""

    dir: str | None = None
    """Checkpoint directory (relative to the current directory); None = <logging.run_dir>/checkpoints."""
    save_interval: int = 0
    """Save every this many iterations; 0 = never save periodically."""
    resume: str = "auto"
    """auto = resume from the latest checkpoint in `dir` if there is one; none = start fresh;
    anything else = path of the checkpoint to resume from."""
    keep_last: int | None = None
    """Keep only the newest this many checkpoints; None = keep all."""

    def validate(self) -> None:
        errors = []
        if self.save_interval < 0:
            errors.append(f"checkpoint.save_interval={self.save_interval} must be >= 0 (0 = never)")
        if self.keep_last is not None and self.keep_last < 1:
            errors.append(f"checkpoint.keep_last={self.keep_last} must be >= 1, or null to keep all")
        if not self.resume:
            errors.append("checkpoint.resume is empty: use auto, none or a checkpoint path")
        if errors:
            raise ValueError("\n".join(errors))
