"""Lines stay readable: one width, ruff's (``line-length`` in pyproject.toml), and two ratchets.

``ruff format --check`` (``make lint``) holds every line at that width except what ruff cannot split
(a long string, a URL) and what a ``fmt: skip`` comment keeps as written. ``tests/line_width_baseline.json``
holds, per file, how many lines over the width it has today and how many ``fmt: skip`` comments; a
file may not have more of either (a new file: none), and when a file has fewer its entry must come
down with it, so both only shrink. After shortening lines or dropping markers:
``python -m tests.test_line_width --update`` (it lowers entries, never raises one).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
LIMIT = int(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["line-length"])
SCOPE = ("grpo_megatron", "tests", "bench", "tools", "examples")
BASELINE = Path(__file__).resolve().parent / "line_width_baseline.json"
SKIP = re.compile(r"#\s*fmt:\s*skip")
"""A ``fmt: skip`` comment: ruff leaves its statement as written."""


def counts() -> dict[str, dict[str, int]]:
    """Per kind ("over_width": lines over ``LIMIT`` characters, "fmt_skip": markers), every Python file of
    ``SCOPE`` that has any: its path -> how many."""
    found: dict[str, dict[str, int]] = {"over_width": {}, "fmt_skip": {}}
    for scope in SCOPE:
        for path in sorted((ROOT / scope).rglob("*.py")):
            lines = path.read_text().splitlines()
            name = path.relative_to(ROOT).as_posix()
            for kind, n in (
                ("over_width", sum(len(line) > LIMIT for line in lines)),
                ("fmt_skip", sum(bool(SKIP.search(line)) for line in lines)),
            ):
                if n:
                    found[kind][name] = n
    return found


def test_ruff_formats_to_the_width_this_ratchet_counts() -> None:
    assert LIMIT == 110, "one width: ruff's line-length is the ratchet's (update the baseline with it)"


def test_no_file_has_more_long_lines_or_fmt_skips_than_its_baseline_and_the_baseline_only_shrinks() -> None:
    baseline: dict[str, dict[str, int]] = json.loads(BASELINE.read_text())
    found = counts()
    what = {"over_width": f"lines over {LIMIT} characters", "fmt_skip": "fmt: skip comments"}
    grown = [
        f"{path}: {n} {what[kind]} (baseline {baseline[kind].get(path, 0)})"
        for kind in what
        for path, n in found[kind].items()
        if n > baseline[kind].get(path, 0)
    ]
    assert not grown, (
        "wrap these lines, or let ruff format them (the baseline never grows):\n  " + "\n  ".join(grown)
    )
    shrunk = [
        f"{path}: {what[kind]} {baseline[kind][path]} -> {found[kind].get(path, 0)}"
        for kind in what
        for path in baseline[kind]
        if found[kind].get(path, 0) < baseline[kind][path]
    ]
    assert not shrunk, (
        "fewer than tests/line_width_baseline.json says: lower it with "
        "`python -m tests.test_line_width --update`:\n  " + "\n  ".join(shrunk)
    )


def update() -> None:
    """Lower every baseline entry to today's count (entries never rise; files with none drop out)."""
    baseline: dict[str, dict[str, int]] = json.loads(BASELINE.read_text()) if BASELINE.is_file() else {}
    found = counts()
    grown = sorted(
        f"{path} ({kind})"
        for kind in found
        for path, n in found[kind].items()
        if baseline and n > baseline.get(kind, {}).get(path, 0)
    )
    if grown:
        sys.exit(
            f"not raising the baseline; wrap the new lines or drop the new markers first in: {', '.join(grown)}"
        )
    BASELINE.write_text(json.dumps({k: dict(sorted(v.items())) for k, v in found.items()}, indent=1) + "\n")
    print(
        f"{BASELINE}: "
        + "; ".join(f"{kind} {sum(v.values())} in {len(v)} files" for kind, v in found.items())
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python -m tests.test_line_width --update")
    update()
