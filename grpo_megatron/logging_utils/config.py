"""Logging section of the job config: run directory, metric sinks, console output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class LoggingConfig:
    """Where a run writes its resolved config, logs and metrics, and what it prints."""

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
    """Print, and send to wandb/TensorBoard, every this many iterations (and every iteration with an
    evaluation, and the last one); run_dir/metrics.jsonl always gets one line per iteration."""
    progress_bar: bool = True
    """Show a rich progress bar with the live reward when stdout is a terminal; when it is not (CI logs)
    or this is false, print one concise line per logged iteration instead."""
    samples_interval: int = 10
    """Show a table of sample rollouts (and append them to run_dir/samples.jsonl) every this many
    iterations; 0 = never."""
    samples_max_chars: int = 300
    """Characters of each prompt/response shown in the console's sample table (longer text is cut in the
    middle); run_dir/samples.jsonl and the wandb table keep the full text."""

    def validate(self) -> None:
        errors = []
        if not self.run_dir:
            errors.append("logging.run_dir is empty: set a directory, e.g. runs/my_run")
        if self.wandb_mode not in WANDB_MODES:
            errors.append(
                f"logging.wandb_mode={self.wandb_mode!r} must be one of {', '.join(WANDB_MODES)} "
                "(offline writes to <run_dir>/wandb for a later `wandb sync`)"
            )
        if self.wandb_mode != "disabled" and not self.wandb_project:
            errors.append(
                f"logging.wandb_project is empty with logging.wandb_mode={self.wandb_mode}: "
                "name a project, or set logging.wandb_mode=disabled"
            )
        if self.log_interval < 1:
            errors.append(f"logging.log_interval={self.log_interval} must be >= 1")
        if self.samples_interval < 0:
            errors.append(f"logging.samples_interval={self.samples_interval} must be >= 0 (0 = never)")
        if self.samples_max_chars < 20:
            errors.append(
                f"logging.samples_max_chars={self.samples_max_chars} must be >= 20 "
                "(the console table needs room for a readable excerpt)"
            )
        if errors:
            raise ValueError("\n".join(errors))
