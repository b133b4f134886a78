"""``python -m tests.workers.preempt_workers POINT RANK <grpo-megatron arguments>``: the real trainer
(``grpo_megatron.cli.main``, under torchrun), whose rank RANK sends itself SIGTERM when it reaches POINT
(tests/test_preemption.py). POINT is ``PHASE:K``: the K-th start in this launch of the timed phase
PHASE (``rollout``, ``train``, ``sync``), or of a checkpoint save (``save``); ``save2:K`` sends
SIGTERM and then SIGUSR1 there (a second signal). Only the trigger is added: signal handling, the safe point and the save are the
trainer's own."""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from contextlib import AbstractContextManager
from typing import Any


def _arm(point: str, rank: int) -> None:
    from grpo_megatron.checkpoint.manager import CheckpointManager
    from grpo_megatron.training.timing import PhaseTimer

    phase, _, nth = point.partition(":")
    seen: Counter[str] = Counter()

    def reached(name: str) -> None:
        seen[name] += 1
        if int(os.environ["RANK"]) == rank and seen[name] == int(nth) and phase.rstrip("2") == name:
            print(f"[test] rank {rank}: SIGTERM at the start of {name} #{nth}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            if phase.endswith("2"):
                os.kill(os.getpid(), signal.SIGUSR1)

    timed = PhaseTimer.__call__
    save = CheckpointManager.save

    def timed_phase(self: PhaseTimer, name: str) -> AbstractContextManager[Any]:
        reached(name)
        return timed(self, name)

    def saving(self: CheckpointManager, *args: Any, **kwargs: Any) -> Any:
        reached("save")
        return save(self, *args, **kwargs)

    PhaseTimer.__call__ = timed_phase  # type: ignore[method-assign]
    CheckpointManager.save = saving  # type: ignore[method-assign]


if __name__ == "__main__":
    from grpo_megatron.cli import main

    _arm(sys.argv[1], int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
