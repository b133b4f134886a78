#!/usr/bin/env python3
"""Convert a downloaded MATH-style dataset into our prompt JSONL: {"prompt", "answer", metadata...}.

    python tools/prepare_math.py --input MATH/train --levels 3 4 5 --out data/math_l3to5.jsonl
    python tools/prepare_math.py --input dapo-math-17k.parquet --out data/dapo_math_17k.jsonl

Reads local files only (a file, or a directory of .json / .jsonl / .parquet files):
- MATH (Hendrycks et al.): per-problem JSON files or an export with ``problem``, ``level``
  ("Level 3"), ``type``, ``solution``; the answer is the last \\boxed{...} of the solution;
- rows with an explicit answer column (``answer``, or ``reward_model.ground_truth`` as in
  DAPO-Math-17k), and prompts given as chat messages (the last user message is the prompt).
Rows without a problem or an answer are skipped and counted. Output rows keep ``level``,
``subject`` and ``source`` as metadata. The output is written atomically.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rows import iter_rows, write_jsonl  # noqa: E402


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in ``text``, braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def prompt_of(row: dict[str, Any], key: str) -> str | None:
    value = row.get(key)
    if isinstance(value, list):  # chat messages: the last user turn
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        value = users[-1] if users else None
    return value.strip() if isinstance(value, str) and value.strip() else None


def answer_of(row: dict[str, Any], key: str) -> str | None:
    value = row.get(key)
    if value is None and isinstance(row.get("reward_model"), dict):
        value = row["reward_model"].get("ground_truth")
    if value is None and isinstance(row.get("solution"), str):
        value = last_boxed(row["solution"])
    if isinstance(value, int | float):
        value = str(value)
    return value.strip() if isinstance(value, str) and value.strip() else None


def level_of(row: dict[str, Any]) -> int | None:
    level = row.get("level")
    if isinstance(level, int):
        return level
    if isinstance(level, str) and level.split()[-1].isdigit():
        return int(level.split()[-1])
    return None


def convert(
    rows: Any, *, problem_key: str, answer_key: str, levels: set[int] | None
) -> tuple[list[dict], dict]:
    out: list[dict[str, Any]] = []
    skipped = {"no problem": 0, "no answer": 0, "level": 0}
    for where, row in rows:
        prompt = prompt_of(row, problem_key)
        if prompt is None:
            skipped["no problem"] += 1
            continue
        level = level_of(row)
        if levels is not None and level not in levels:
            skipped["level"] += 1
            continue
        answer = answer_of(row, answer_key)
        if answer is None:
            skipped["no answer"] += 1
            continue
        item: dict[str, Any] = {"prompt": prompt, "answer": answer, "source": where.rsplit(":", 1)[0]}
        if level is not None:
            item["level"] = level
        subject = row.get("type") or row.get("subject")
        if subject:
            item["subject"] = subject
        out.append(item)
    return out, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", type=Path, required=True, help="downloaded file or directory")
    parser.add_argument("--out", type=Path, required=True, help="output JSONL")
    parser.add_argument("--levels", type=int, nargs="*", default=None, help="keep only these MATH levels")
    parser.add_argument(
        "--problem-key", default="problem", help="problem column (default: problem, else prompt)"
    )
    parser.add_argument("--answer-key", default="answer", help="answer column (default: answer)")
    args = parser.parse_args(argv)
    rows = list(iter_rows(args.input))
    key = args.problem_key
    if rows and key == "problem" and "problem" not in rows[0][1] and "prompt" in rows[0][1]:
        key = "prompt"
    out, skipped = convert(
        rows, problem_key=key, answer_key=args.answer_key, levels=set(args.levels) if args.levels else None
    )
    if not out:
        print(f"error: no usable rows in {args.input} (skipped: {skipped})", file=sys.stderr)
        return 1
    n = write_jsonl(args.out, out)
    print(f"wrote {n} problems to {args.out} (read {len(rows)}, skipped {skipped})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
