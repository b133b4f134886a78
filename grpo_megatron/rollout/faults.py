"""Test-only fault injection for engine loss (issue 41): ``GRPO_ENGINE_FAULT`` read by one parser and
acted on at two hooks. Without the variable (every real run) nothing is armed and no hook does anything.

The variable holds comma-separated faults, each ``ACTION:N``, or ``ACTION:N@R`` for trainer rank R's
engine only:

- ``kill:N``, ``stop:N``, ``hang:N`` (hook 1, ``EngineFaults.at_generation``): as the engine's N-th
  generation is submitted, SIGKILL or SIGSTOP it, or make it hang alive (``HANG_SIGNAL``: a process
  armed by ``arm_hang`` sleeps in its handler for good, state S: neither dead nor stopped, as a
  scheduler stuck in a collective would be);
- ``killsync:V`` (hook 2, ``EngineFaults.at_bucket``): SIGKILL the engine as the second bucket of
  weight version V arrives (a death between two buckets), once, in whichever life.

Each engine acts on the hooks' answers itself: an engine process signals itself at its N-th generate
request, in its first life only, kill and stop only (``rollout/engine_process.py``); an SGLang engine
signals its last TP rank's scheduler, counting its generations over its lives, so that faults can
follow each other, each once (``rollout/sglang/engine.py``). The variable is read at every hook, so a
test may change it between two calls.

Standard library only: SGLang's processes load this file by its path at start
(``rollout/sglang/boot/sitecustomize.py`` calls ``arm_hang``), importing nothing else of the project.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

FAULT_ENV = "GRPO_ENGINE_FAULT"
HANG_SIGNAL = signal.SIGUSR2
"""What makes a process armed by ``arm_hang`` hang."""
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "hang": HANG_SIGNAL}
"""The signal each generation fault sends."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One item of ``GRPO_ENGINE_FAULT``: ``action`` at ``number`` (a generation or a weight version),
    for trainer rank ``rank``'s engine (None: every engine)."""

    action: str
    number: int
    rank: int | None = None


def parse(text: str | None = None) -> list[Fault]:
    """``GRPO_ENGINE_FAULT`` (``text``, else the environment's) parsed: the one parser of it."""
    faults = []
    for item in filter(None, (os.environ.get(FAULT_ENV, "") if text is None else text).split(",")):
        action, _, rest = item.partition(":")
        number, _, rank = rest.partition("@")
        faults.append(Fault(action, int(number), int(rank) if rank else None))
    return faults


class EngineFaults:
    """The faults planned for the engine of trainer rank ``rank``, and what they count: its generations
    (hook 1) and the buckets of the version arriving (hook 2). ``actions``: the generation faults this
    engine can act on (an engine process: kill and stop). ``armed`` False: none (an engine process
    after its first life)."""

    def __init__(
        self, rank: int | None, actions: Sequence[str] = tuple(SIGNALS), *, armed: bool = True
    ) -> None:
        self.rank = rank
        self.actions = tuple(actions)
        self.armed = armed
        self.generated = 0
        """Generations submitted so far (over every life, where the engine keeps this object)."""
        self._buckets = (-1, 0)
        """(version, buckets of it received so far)."""
        self._synced_kills: set[int] = set()

    def _mine(self) -> list[Fault]:
        return [f for f in parse() if f.rank in (None, self.rank)] if self.armed else []

    def at_generation(self) -> int | None:
        """Hook 1: one more generation is being submitted; the signal due now, else None."""
        self.generated += 1
        for fault in self._mine():
            if fault.action in self.actions and fault.number == self.generated:
                return SIGNALS[fault.action]
        return None

    def at_bucket(self, version: int) -> int | None:
        """Hook 2: a non-empty bucket of ``version`` arrives; SIGKILL when it is the second of a
        ``killsync`` version not killed at yet, else None."""
        seen = self._buckets[1] + 1 if self._buckets[0] == version else 1
        self._buckets = (version, seen)
        wanted = any(f.action == "killsync" and f.number == version for f in self._mine())
        if wanted and seen == 2 and version not in self._synced_kills:
            self._synced_kills.add(version)
            return signal.SIGKILL
        return None


def arm_hang() -> bool:
    """In a process an SGLang engine spawned (at its start): when ``GRPO_ENGINE_FAULT`` plans a ``hang``,
    this process hangs alive on ``HANG_SIGNAL``, which the trainer's side sends its scheduler at the
    planned generation (hook 1). Whether it armed."""
    if not any(f.action == "hang" for f in parse()):
        return False
    signal.signal(HANG_SIGNAL, _hang)
    return True


def _hang(signum: int, frame: Any) -> None:
    while True:
        time.sleep(3600)
