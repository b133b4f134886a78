"""Test-only check of metrics.jsonl records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo_megatron.logging_utils.metrics import REQUIRED_KEYS


def missing_required_keys(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """REQUIRED_KEYS absent from at least one record, or null in all of them (never measured)."""
    missing = []
    for key in REQUIRED_KEYS:
        if not records or any(key not in r for r in records) or all(r[key] is None for r in records):
            missing.append(key)
    return missing
