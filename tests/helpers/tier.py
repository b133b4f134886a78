"""The test tiers: a test that starts processes of its own that take seconds (a training job, an engine,
ranks under torchrun, the CLI or SGLang in a Python process of its own) carries ``@pytest.mark.launches``
(``make test-fast`` leaves those out). The helpers that launch a job, SGLang's real engine or ranks
(``dist.run_distributed``, ``runs.launch``, ``sglang_env.require_sglang_engine``) ask ``require_mark``;
``tests/conftest.py`` says, before each test's fixtures, whether it carries the mark."""

from __future__ import annotations

import pytest

MARKED: list[bool] = [True]
"""Whether the test being set up or run carries the mark (True outside a test: scripts, workers)."""


def require_mark(what: str) -> None:
    """Fail the test being run unless it is marked ``launches``: it is about to launch ``what``."""
    if not MARKED[0]:
        pytest.fail(
            f"this test launches {what}: mark it @pytest.mark.launches (make test-fast leaves those out)"
        )
