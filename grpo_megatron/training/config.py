"""Train section of the job config: iterations, batch sizes and the optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class TrainConfig:
    """One iteration = rollout of `prompts_per_iteration` prompts, then `updates_per_iteration` optimizer steps."""

    seed: int = 1234
    """Seed for weights initialisation, data order and sampling."""
    iterations: int = 100
    """Number of GRPO iterations (rollout + update) to run."""
    prompts_per_iteration: int = 32
    """Prompts sampled per iteration; each yields rollout.n_samples_per_prompt responses."""
    updates_per_iteration: int = 1
    """Optimizer steps per iteration: the rollout batch is split into this many mini-batches
    (1 = fully on-policy)."""
    micro_batch_size: int = 1
    """Sequences per forward/backward pass (ignored when max_tokens_per_micro_batch is set)."""
    max_tokens_per_micro_batch: int | None = None
    """Pack sequences into micro-batches of at most this many tokens; None = micro_batch_size sequences."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_iterations: int = 0
    """Iterations of linear warm-up from 0 to lr."""
    lr_decay: Literal["constant", "cosine", "linear"] = "constant"
    """Schedule from lr to min_lr after warm-up, over the remaining iterations."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW denominator epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    def validate(self) -> None:
        errors = []
        for name in ("iterations", "prompts_per_iteration", "updates_per_iteration", "micro_batch_size"):
            value = getattr(self, name)
            if value < 1:
                errors.append(f"train.{name}={value} must be >= 1")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            errors.append(
                f"train.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 1, "
                "or null to batch by train.micro_batch_size"
            )
        if self.lr <= 0:
            errors.append(f"train.lr={self.lr} must be > 0 (1e-6 is usual for RL on pretrained models)")
        elif not 0 <= self.min_lr <= self.lr:
            errors.append(f"train.min_lr={self.min_lr} must be in [0, train.lr={self.lr}]")
        if not 0 <= self.lr_warmup_iterations <= self.iterations:
            errors.append(
                f"train.lr_warmup_iterations={self.lr_warmup_iterations} must be in "
                f"[0, train.iterations={self.iterations}]"
            )
        if self.weight_decay < 0:
            errors.append(f"train.weight_decay={self.weight_decay} must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                errors.append(f"train.{name}={value} must be in [0, 1)")
        if self.adam_eps <= 0:
            errors.append(f"train.adam_eps={self.adam_eps} must be > 0 (1e-8 is usual)")
        if self.grad_clip < 0:
            errors.append(f"train.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        if errors:
            raise ValueError("\n".join(errors))
