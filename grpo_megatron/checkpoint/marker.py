"""A checkpoint directory's completion marker and naming, shared by the writer (``checkpoint/dist.py``),
the integrity check (``checkpoint/integrity.py``) and the manager: a directory is a complete checkpoint
only with its final name (no ``.tmp-`` infix) and ``grpo_checkpoint.json`` in it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_megatron.fileio import TMP_INFIX

MARKER = "grpo_checkpoint.json"
"""Completion marker: its presence makes a checkpoint directory complete."""
LATEST = "latest"
"""Text file in a checkpoint directory naming the newest complete checkpoint (written last)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or cannot be loaded here; names the path and the fix."""


def is_temporary(path: Path) -> bool:
    return TMP_INFIX in path.name


def is_complete(path: Path) -> bool:
    """A checkpoint directory whose save finished: final name and completion marker present."""
    return path.is_dir() and not is_temporary(path) and (path / MARKER).is_file()


def read_marker(path: Path) -> dict[str, Any]:
    """The completion marker of checkpoint ``path``; CheckpointError when it is not complete."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist: check the path")
    if is_temporary(path):
        raise CheckpointError(
            f"{path} is the temporary directory of a save that did not finish: resume from a "
            "complete checkpoint (its name has no '.tmp-')"
        )
    if not (path / MARKER).is_file():
        raise CheckpointError(
            f"{path} has no {MARKER}: it is not a complete grpo-megatron checkpoint (an interrupted "
            "save, or another tool's directory). Point at an iter_XXXXXXX directory, or at a "
            f"checkpoint directory holding a '{LATEST}' file"
        )
    return json.loads((path / MARKER).read_text())
