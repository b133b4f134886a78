"""Rows of JSONL and Parquet files, each with its location (``file:line`` or ``file row i``).

A row that cannot even be parsed (invalid UTF-8, bad JSON, not an object) comes back as a
``RowProblem`` at its location instead of raising, so the caller decides between stopping with the
location and skipping it (data.skip_malformed).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_megatron.data.records import DataError

__all__ = ["RowProblem", "SUFFIXES", "data_files", "iter_rows"]

SUFFIXES = (".jsonl", ".parquet")
_PARQUET_BATCH_ROWS = 4096


@dataclass(frozen=True)
class RowProblem:
    """Why a row could not be parsed."""

    reason: str


def data_files(path: str | Path, field_name: str) -> list[Path]:
    """The data files of `path`: the file itself, or a directory's .jsonl / .parquet files in name
    order. Errors name `field_name` (e.g. data.train_path)."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise DataError(f"{field_name}={str(path)!r} is a directory without .jsonl or .parquet files")
        return files
    if not p.is_file():
        raise DataError(
            f"{field_name}={str(path)!r} does not exist: give a .jsonl or .parquet file or a directory"
        )
    if p.suffix not in SUFFIXES:
        raise DataError(
            f"{field_name}={str(path)!r} has suffix {p.suffix!r}: prompt files are JSON lines (.jsonl) "
            "or Parquet (.parquet)"
        )
    return [p]


def iter_rows(path: Path) -> Iterator[tuple[str, dict[str, Any] | RowProblem]]:
    """(location, row) for every row of one .jsonl or .parquet file; blank JSONL lines are skipped."""
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
    else:
        yield from _jsonl_rows(path)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any] | RowProblem]]:
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                # utf-8-sig on the first line: files saved by some editors start with a byte-order mark
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                yield where, RowProblem(f"not UTF-8 ({err.reason} at byte {err.start})")
                continue
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                yield where, RowProblem(f"bad JSON ({err.msg} at column {err.colno})")
                continue
            if not isinstance(row, dict):
                yield where, RowProblem(f"a JSON {type(row).__name__}, not an object with named fields")
                continue
            yield where, row


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any] | RowProblem]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # a declared dependency: only a broken install gets here
        raise DataError(f"reading {path} needs pyarrow: pip install pyarrow") from err
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses for bad files
        raise DataError(f"{path} is not a readable Parquet file: {err}") from err
    index = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        for row in batch.to_pylist():
            yield f"{path} row {index}", row
            index += 1
