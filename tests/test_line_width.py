"""Lines stay readable: a ratchet on lines over 120 characters in the project's Python files.

Ruff formats to 120 but leaves lines it cannot split, and ``# fmt: skip`` keeps others; the 90-line
cap on functions was partly met by wider lines. ``tests/line_width_baseline.json`` holds, per file,
how many lines over 120 characters it has today; a file may not have more (a new file: none), and
when a file has fewer its entry must come down with it, so the baseline only shrinks. After
shortening lines: ``python -m tests.test_line_width --update`` (it lowers entries, never raises one).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 120
SCOPE = ("grpo_megatron", "tests", "bench", "tools", "examples")
BASELINE = Path(__file__).resolve().parent / "line_width_baseline.json"


def over_width() -> dict[str, list[int]]:
    """Every Python file of ``SCOPE`` with lines over ``LIMIT`` characters: its path -> their numbers."""
    found: dict[str, list[int]] = {}
    for scope in SCOPE:
        for path in sorted((ROOT / scope).rglob("*.py")):
            lines = [i for i, line in enumerate(path.read_text().splitlines(), 1) if len(line) > LIMIT]
            if lines:
                found[path.relative_to(ROOT).as_posix()] = lines
    return found


def test_no_file_has_more_lines_over_120_characters_than_its_baseline_and_the_baseline_only_shrinks() -> None:
    baseline: dict[str, int] = json.loads(BASELINE.read_text())
    found = over_width()
    grown = [
        f"{path}: {len(lines)} lines over {LIMIT} characters (baseline {baseline.get(path, 0)}), e.g. line {lines[0]}"
        for path, lines in found.items()
        if len(lines) > baseline.get(path, 0)
    ]
    assert not grown, "wrap these lines (the baseline never grows):\n  " + "\n  ".join(grown)
    shrunk = [
        f"{path}: {baseline[path]} -> {len(found.get(path, []))}"
        for path in baseline
        if len(found.get(path, [])) < baseline[path]
    ]
    assert not shrunk, (
        "fewer over-width lines than tests/line_width_baseline.json says: lower it with "
        "`python -m tests.test_line_width --update`:\n  " + "\n  ".join(shrunk)
    )


def update() -> None:
    """Lower every baseline entry to today's count (entries never rise; files with none drop out)."""
    baseline: dict[str, int] = json.loads(BASELINE.read_text()) if BASELINE.is_file() else {}
    found = {path: len(lines) for path, lines in over_width().items()}
    grown = sorted(path for path, n in found.items() if n > baseline.get(path, 0)) if baseline else []
    if grown:
        sys.exit(f"not raising the baseline; wrap the new lines first in: {', '.join(grown)}")
    BASELINE.write_text(json.dumps(dict(sorted(found.items())), indent=1) + "\n")
    print(f"{BASELINE}: {sum(found.values())} lines over {LIMIT} characters in {len(found)} files")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python -m tests.test_line_width --update")
    update()
