"""Suite-wide reporting: the closing note on SGLang's real engine (``tests/sglang_env.py``), so that
the end of ``make test`` says on which CPU and kernel the real-engine tests ran, how many, or why
they skipped, and the suite's wall time."""

from __future__ import annotations

import time

import pytest

from tests.helpers import tier
from tests.sglang_env import closing_note

_STARTED = pytest.StashKey[float]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures: whether it may launch a job, the real engine or ranks of its own
    (``tests/helpers/tier.py``)."""
    tier.MARKED[0] = item.get_closest_marker("launches") is not None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STARTED] = time.monotonic()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    note = closing_note(
        terminalreporter.stats, time.monotonic() - config.stash.get(_STARTED, time.monotonic())
    )
    if note is not None:
        terminalreporter.write_line(note)
