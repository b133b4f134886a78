"""The committed lock (requirements.lock) and the checker `make setup` runs against it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import check_lock  # noqa: E402


def test_lock_pins_every_line_exactly() -> None:
    pins = check_lock.read_lock(REPO / "requirements.lock")
    # The packages whose versions docs/getting-started/cpu.md names as tested.
    for name in ("torch", "megatron-core", "transformers", "sglang", "math-verify"):
        assert name in pins, name
    assert pins["megatron-core"] == "0.16.1"


def test_checker_names_each_difference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock = tmp_path / "lock.txt"
    lock.write_text("# comment\npytest==0.0.1\nno-such-package-xyz==1.0\n")
    assert check_lock.main([str(lock)]) == 1
    err = capsys.readouterr().err
    assert (
        "pytest: locked 0.0.1, installed" in err
        and "no-such-package-xyz: locked 1.0, installed nothing" in err
    )
    assert check_lock.main([str(lock), "--skip", "pytest", "--skip", "no_such_package_xyz"]) == 0
    lock.write_text("pytest>=8\n")
    with pytest.raises(SystemExit, match=r"lock.txt:1: expected 'name==version'"):
        check_lock.read_lock(lock)
