"""Data section of the job config: where prompts and reference answers come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataConfig:
    """Prompt source: a JSONL file, or a procedural generator (exactly one of them for training)."""

    train_path: str | None = None
    """JSONL file of training prompts; a relative path in a YAML file resolves against that file's directory."""
    eval_path: str | None = None
    """JSONL file of held-out prompts scored during training; None = no evaluation."""
    prompt_key: str = "prompt"
    """JSONL field holding the prompt text."""
    answer_key: str = "answer"
    """JSONL field holding the reference answer the reward compares against."""
    template: str | None = None
    """Python format string wrapping each prompt, with a {prompt} placeholder, e.g. "Q: {prompt}\\nA:";
    None = the prompt as is."""
    generator: str | None = None
    """Name of a procedural task generator (e.g. "arithmetic") used instead of train_path."""
    generator_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the generator (difficulty, number of held-out prompts, ...)."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this many tokens (after the template) are dropped."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by train.seed)."""

    def validate(self) -> None:
        errors = []
        if self.train_path is not None and self.generator is not None:
            errors.append(
                f"data.train_path={self.train_path!r} and data.generator={self.generator!r} are both set: "
                "keep one prompt source and set the other to null"
            )
        if self.template is not None and "{prompt}" not in self.template:
            errors.append(
                f"data.template={self.template!r} has no {{prompt}} placeholder: add one, or set it to null"
            )
        if self.max_prompt_tokens < 1:
            errors.append(f"data.max_prompt_tokens={self.max_prompt_tokens} must be >= 1")
        if errors:
            raise ValueError("\n".join(errors))
