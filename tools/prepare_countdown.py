#!/usr/bin/env python3
"""Convert the downloaded countdown data (TinyZero's Countdown-Tasks-3to4: columns ``target``, ``nums``)
into our prompt JSONL: {"prompt", "answer", "metadata": {"numbers", "target"}}.

    python tools/prepare_countdown.py --input countdown.parquet \
        --out data/countdown_train.jsonl --eval-out data/countdown_test.jsonl --num-eval 1024

Reads local files only. The prompt is TinyZero's base-model template (the R1 format with
<think>/<answer> tags, ending in "<think>"); the reward is the built-in ``countdown``, which reads
``metadata.numbers`` and ``metadata.target``. A seeded shuffle picks the held-out rows (TinyZero
holds out 1,024). Outputs are written atomically.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rows import iter_rows, write_jsonl  # noqa: E402

TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer.\nUser: Using the numbers {numbers}, create an equation that equals {target}. You can use "
    "basic arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in "
    "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
    "<answer> (1 + 2) / 3 </answer>.\nAssistant: Let me solve this step by step.\n<think>"
)


def convert_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    numbers = row.get("nums", row.get("numbers"))
    target = row.get("target")
    if not isinstance(numbers, list) or not numbers or target is None:
        raise SystemExit(
            f"error: {where}: needs a list 'nums' (or 'numbers') and a 'target'; got {sorted(row)}"
        )
    numbers = [int(n) for n in numbers]
    target = int(target)
    return {
        "prompt": TEMPLATE.format(numbers=numbers, target=target),
        "answer": str(target),
        "metadata": {"numbers": numbers, "target": target},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", type=Path, required=True, help="downloaded file or directory")
    parser.add_argument("--out", type=Path, required=True, help="training JSONL")
    parser.add_argument("--eval-out", type=Path, default=None, help="held-out JSONL (optional)")
    parser.add_argument(
        "--num-eval", type=int, default=1024, help="held-out rows (default 1024, as TinyZero)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = [convert_row(row, where) for where, row in iter_rows(args.input)]
    if args.eval_out is not None:
        random.Random(args.seed).shuffle(rows)
        if args.num_eval >= len(rows):
            print(
                f"error: --num-eval={args.num_eval} leaves no training rows of {len(rows)}", file=sys.stderr
            )
            return 1
        n_eval = write_jsonl(args.eval_out, rows[: args.num_eval])
        rows = rows[args.num_eval :]
        print(f"wrote {n_eval} held-out problems to {args.eval_out}")
    n = write_jsonl(args.out, rows)
    print(f"wrote {n} problems to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
