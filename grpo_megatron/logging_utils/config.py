"""Logging section of the job config: run directory and metric sinks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class LoggingConfig:
    """Where a run writes its resolved config, logs and metrics."""

    run_dir: str = "runs/default"
    """Run directory (relative to the current directory): resolved config, logs, metrics, checkpoints."""
    wandb_mode: Literal["online", "offline", "disabled"] = "disabled"
    """Weights & Biases mode; offline writes to run_dir/wandb for a later `wandb sync`."""
    wandb_project: str = "grpo-megatron"
    """Weights & Biases project name."""
    wandb_run_name: str | None = None
    """Weights & Biases run name; None = the name of run_dir."""
    tensorboard: bool = False
    """Also write TensorBoard event files under run_dir/tensorboard."""
    log_interval: int = 1
    """Print and record metrics every this many iterations."""

    def validate(self) -> None:
        errors = []
        if not self.run_dir:
            errors.append("logging.run_dir is empty: set a directory, e.g. runs/my_run")
        if self.log_interval < 1:
            errors.append(f"logging.log_interval={self.log_interval} must be >= 1")
        if errors:
            raise ValueError("\n".join(errors))
