"""Shared by the data preparation tools: read local rows, write JSONL atomically. Nothing is fetched."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".json", ".parquet")


def input_files(path: Path) -> list[Path]:
    """``path`` itself, or every .jsonl / .json / .parquet file below a directory (sorted)."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if files:
            return files
        raise SystemExit(f"error: {path} holds no {', '.join(SUFFIXES)} files")
    raise SystemExit(f"error: {path} does not exist: pass the file or directory you downloaded")


def iter_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for every row: JSONL lines, a JSON object (one row) or list, Parquet rows."""
    for file in input_files(path):
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq  # only needed for Parquet input

            for i, row in enumerate(pq.read_table(file).to_pylist()):
                yield f"{file} row {i}", row
        elif file.suffix == ".jsonl":
            with open(file, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        yield f"{file}:{n}", json.loads(line)
        else:
            data = json.loads(file.read_text(encoding="utf-8"))
            for i, row in enumerate(data if isinstance(data, list) else [data]):
                yield f"{file}[{i}]" if isinstance(data, list) else str(file), row


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write ``rows`` to ``path`` atomically (a temporary file renamed over it); returns the count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    count = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                count += 1
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count
