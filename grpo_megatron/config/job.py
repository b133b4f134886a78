"""``JobConfig``: the job's sections, one typed dataclass each, next to its component
(``grpo_megatron/<component>/config.py``), assembled here; and ``ConfigError``, the one error every
config problem is reported in."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpo_megatron.algorithm.config import AlgorithmConfig
from grpo_megatron.checkpoint.config import CheckpointConfig
from grpo_megatron.data.config import DataConfig
from grpo_megatron.distributed.config import ParallelConfig
from grpo_megatron.logging_utils.config import LoggingConfig
from grpo_megatron.models.config import (
    ModelConfig,
)
from grpo_megatron.rewards.config import RewardConfig
from grpo_megatron.rollout.config import RolloutConfig
from grpo_megatron.training.config import DistillConfig, SFTConfig, TrainConfig


class ConfigError(ValueError):
    """One or more problems with a job config; `errors` holds one message per problem."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        noun = "problem" if len(self.errors) == 1 else "problems"
        super().__init__(
            f"invalid config ({len(self.errors)} {noun}):\n" + "\n".join(f"  - {e}" for e in self.errors)
        )


@dataclass
class JobConfig:
    """A whole job: what to train, how it is sharded, how it samples, learns, saves and logs."""

    model: ModelConfig
    """The policy (and reference) model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout of the trainer."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The GRPO objective."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt source."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Iterations, batch sizes, optimizer."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised cold start (`grpo-megatron sft`)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a frozen teacher (off by default)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run directory and metrics."""

    @property
    def producer_loop(self) -> bool:
        """Whether the GRPO loop runs as a producer of scored groups and a consumer that trains
        (training/groups.py: GroupProducer): its engines generate while the trainer trains (an embedded engine in
        a process of its own, or SGLang, whose schedulers are processes of their own) and run ahead
        (train.max_staleness > 0), or in order (rollout.embedded_process with max_staleness 0). Not with
        rollout.partial.enabled: its pool is advanced in the rollout phase (training/partial.py)."""
        ahead = self.rollout.embedded_process or self.train.max_staleness > 0
        return ahead and not self.rollout.partial.enabled

    @property
    def generation_overlaps_training(self) -> int:
        """How many versions ahead the engines generate while the trainer trains (the placement's
        phase table: above 0 nothing swaps): train.max_staleness in the producer loop; 0 with
        rollout.partial.enabled, whose engines generate in the rollout phase only (max_staleness there
        bounds a token's lag, not how far ahead batches are submitted), 1 with rollout.partial.overlap
        (one segment round in flight while the trainer trains)."""
        if self.rollout.partial.enabled:
            return int(self.rollout.partial.overlap)
        return self.train.max_staleness

    @property
    def algorithm_in_effect(self) -> AlgorithmConfig:
        """The algorithm section as the run applies it: ``algorithm.off_policy.correction=auto`` resolved
        by the rollout it corrects (config/loop_rules.py:off_policy_in_effect; icepop with FP8 rollout)."""
        from grpo_megatron.config.loop_rules import off_policy_in_effect

        off_policy = dataclasses.replace(self.algorithm.off_policy, correction=off_policy_in_effect(self))
        return dataclasses.replace(self.algorithm, off_policy=off_policy)

    def resolve(self, world_size: int) -> JobConfig:
        """A copy whose parallel section has its derived degrees filled in (see ParallelConfig.resolve)
        and whose algorithm section is the one in effect (``algorithm_in_effect``)."""
        return dataclasses.replace(
            self, parallel=self.parallel.resolve(world_size), algorithm=self.algorithm_in_effect
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        """Write the config as YAML (a run directory keeps its resolved config this way)."""
        Path(path).write_text(self.to_yaml())


# Paths that ship with a config (its model and data) resolve against the YAML file's directory when
# written there, so an example works from any working directory; outputs (run_dir, checkpoint.dir)
# stay relative to where the job is launched, as users of torchrun/srun scripts expect.
FILE_RELATIVE_PATHS: tuple[tuple[str, str], ...] = (
    ("model", "hf_path"),
    ("data", "train_path"),
    ("data", "eval_path"),
    ("data", "tokenizer_path"),
    ("distill", "teacher_path"),
)
