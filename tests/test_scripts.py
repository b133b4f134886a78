"""Every script of bench/ and tools/ still imports and parses its arguments (``--help``), so a
renamed function or module in the package fails here, not the next time someone runs the bench.
Each runs in this process as ``__main__`` (torch and the package are imported once); mypy checks
their calls (pyproject.toml's ``[tool.mypy] files``)."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for d in ("bench", "tools") for p in (REPO / d).glob("*.py") if not p.name.startswith("_"))


def test_every_script_is_listed() -> None:
    assert {p.parent.name for p in SCRIPTS} == {"bench", "tools"} and len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_help(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    # as `python bench/x.py` runs it: its own folder first (its sibling modules import from there)
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code in (0, None), out.getvalue()[-2000:]
    assert "usage:" in out.getvalue(), f"{script.name} printed no usage:\n{out.getvalue()[-2000:]}"
