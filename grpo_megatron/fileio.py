"""Atomic file writes shared by checkpoints and run logs, and a safetensors integrity check
(standard library only: the CLI checks model files before importing torch).

A reader (a resuming job, ``tail -f``, a crashed process's successor) sees either the old file or the
new one, never a half-written one: the text goes to a uniquely named temporary sibling, is fsynced,
and is renamed over the target.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

TMP_INFIX = ".tmp-"
"""Marks a temporary sibling (``<name>.tmp-<nonce>``); checkpoint resume never picks such a path."""


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and a rename (fsynced)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and a rename (fsynced)."""
    tmp = path.with_name(f"{path.name}{TMP_INFIX}{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def safetensors_problem(path: Path) -> str | None:
    """Why safetensors file ``path`` cannot load (damaged header, data shorter than the header
    says: a truncated copy or download), naming it; None when it is whole. Reads only the header."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError(f"a header of {header_len} bytes in a file of {size}")
            header = json.loads(f.read(header_len))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return f"{path} is not a readable safetensors file ({exc}); copy or download it again"
    if 8 + header_len + end > size:
        return f"{path} is truncated: {size} bytes, its header describes {8 + header_len + end}; copy or download it again"
    return None


def read_weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of safetensors index ``index`` (tensor name -> shard file). ValueError,
    naming the file, the key and the fix, unless every shard is a bare file name beside the index:
    a '/', '..' or absolute path would make the loader open files outside the model directory."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{index} is not a readable safetensors index ({exc!r}); copy or download it again"
        ) from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map is not an object of tensor name -> file name")
    for key, file in weight_map.items():
        bare = isinstance(file, str) and file not in ("", ".", "..") and "/" not in file and "\\" not in file
        if not bare or not isinstance(key, str):
            raise ValueError(
                f"{index}: weight_map[{key!r}] = {file!r} is not a bare file name in the model directory; "
                "an index may name only shard files beside it (e.g. 'model-00001-of-00002.safetensors'): "
                "fix the index, or save the model again with save_pretrained"
            )
    return weight_map
