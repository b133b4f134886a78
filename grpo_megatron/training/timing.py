"""What times the phases of an iteration (``time/<name>`` metrics): ``with timer(name):``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

Timer = Callable[[str], AbstractContextManager[None]]
"""What times the phases of an iteration: ``with timer(name):`` (``PhaseTimer``; benches bring their own)."""


@dataclass
class PhaseTimer:
    """Wall time per named phase, accumulated over an iteration (``time/<name>`` metrics)."""

    seconds: dict[str, float] = field(default_factory=dict)
    beat: Callable[[str], None] | None = None
    """Called with the phase's name as it starts and ends (Job.beat: the progress watchdog)."""

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.beat is not None:
            self.beat(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"time/{name}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
            if self.beat is not None:
                self.beat(f"{name} (done)")
