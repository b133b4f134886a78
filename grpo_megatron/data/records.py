"""What the data layer hands the trainer: prompt records, SFT pairs, and counts of what it left out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PromptRecord", "SFTRecord", "DataStats", "DataError"]


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file, the line (or row) and the fix."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt ready for rollout."""

    prompt: str
    """The prompt text after the template (plain or chat): exactly what prompt_ids encode."""
    answer: str
    """Reference answer (the reward's label); "" when the data has no answers."""
    metadata: dict[str, Any]
    """Task data for the reward (e.g. countdown's numbers and target): the row's other fields."""
    prompt_ids: tuple[int, ...]
    """Token ids of `prompt`, special tokens included as the tokenizer adds them (e.g. bos)."""


@dataclass(frozen=True)
class SFTRecord:
    """One supervised pair: the loss is taken on the response tokens only."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    """The gold response's tokens, ending with the tokenizer's eos id."""


@dataclass
class DataStats:
    """Counts of one split's source rows and of what was left out."""

    source: str
    """Where the split came from (file paths or "generator <name>")."""
    rows: int = 0
    """Rows (or generated problems) read."""
    malformed_skipped: int = 0
    """Rows skipped because data.skip_malformed is set (bad JSON, missing field, wrong type)."""
    too_long_dropped: int = 0
    """Prompts dropped for having more than data.max_prompt_tokens tokens."""
    examples: list[str] = field(default_factory=list)
    """The first few skipped rows' locations and reasons, for the log."""

    @property
    def kept(self) -> int:
        return self.rows - self.malformed_skipped - self.too_long_dropped

    def summary(self) -> str:
        """One line for the log."""
        text = (
            f"{self.source}: {self.kept} of {self.rows} rows kept, {self.malformed_skipped} malformed "
            f"skipped, {self.too_long_dropped} over data.max_prompt_tokens dropped"
        )
        if self.examples:
            text += "; first skipped: " + " | ".join(self.examples)
        return text
