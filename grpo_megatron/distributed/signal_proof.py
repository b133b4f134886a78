"""The start of a helper process that outlives a preemption signal but not its rank (stdlib only: a
spawned helper imports just this module to run it).

Slurm signals every process of a job step; the trainer handles the signal and saves, which needs its
helpers alive. ``ignore_until_orphaned`` is a helper's initializer (``checkpoint/dist.py``: megatron-core's
checkpoint-writer manager): the signals are ignored, and a thread ends the helper once its parent is
gone, since a rank that exits with ``os._exit`` runs no finalizer that would shut it down."""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["ignore_until_orphaned"]


def ignore_until_orphaned(signals: tuple[int, ...], parent: int) -> None:
    """``signals`` ignored in this process; it exits once ``parent`` (its rank's pid) is no longer its
    parent."""
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="grpo-orphan-watch", daemon=True).start()
