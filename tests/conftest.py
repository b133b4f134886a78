"""Suite-wide reporting: the closing note on SGLang's real engine (``tests/sglang_env.py``), so that
the end of ``make test`` says on which CPU and kernel the real-engine tests ran, how many, or why
they skipped, and the suite's wall time; and the order of the test modules, longest first, so that
``make test``'s two xdist workers (``--dist loadfile``: each module whole on one worker, its module
fixtures started once) end together instead of one running the longest module alone at the end."""

from __future__ import annotations

import time

import pytest

from tests.helpers import tier
from tests.sglang_env import closing_note

_STARTED = pytest.StashKey[float]()

LONGEST_FIRST = (
    "test_sglang_train",
    "test_train",
    "test_true_on_policy",
    "test_preemption",
    "test_sglang_real",
    "test_async",
    "test_recipe_miniatures",
    "test_faults",
    "test_partial_rollout",
    "test_checkpoint",
    "test_multiturn",
    "test_lora",
    "test_sglang_contract",
    "test_sync",
    "test_gpu_check",
    "test_reward_sandbox",
    "test_convert",
    "test_packing",
    "test_routing",
    "test_rollout",
)
"""The modules of the longest wall time in a clean ``make test`` (its --durations), longest first; every
other module runs after them in its usual (alphabetical) order. Only the order of whole modules changes:
the tests of a module keep theirs."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.partition("::")[0], len(first_seen))

    def key(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.partition("::")[0]
        return (rank.get(path.rpartition("/")[2].removesuffix(".py"), len(rank)), first_seen[path])

    items.sort(key=key)  # stable: the tests of one module keep their order


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
