"""Atomic file writes shared by checkpoints and run logs (standard library only).

A reader (a resuming job, ``tail -f``, a crashed process's successor) sees either the old file or the
new one, never a half-written one: the text goes to a uniquely named temporary sibling, is fsynced,
and is renamed over the target.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TMP_INFIX = ".tmp-"
"""Marks a temporary sibling (``<name>.tmp-<nonce>``); checkpoint resume never picks such a path."""


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and a rename (fsynced)."""
    tmp = path.with_name(f"{path.name}{TMP_INFIX}{secrets.token_hex(4)}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
