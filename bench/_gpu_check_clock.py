"""The budget of bench/gpu_check.py, enforced while a stage runs (issue 51 item 1): every process a stage
starts goes through ``popen``; at the deadline a timer kills each one's process group (they start in
sessions of their own), so the stage's waits return at once and the stage ends as "stopped". Checked
only between stages, a stage that started in time could outlast the device call's limit, and its table
would never be written."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Any


class StageClock:
    """The check's deadline and the processes its stages run."""

    def __init__(self) -> None:
        self.deadline = float("inf")
        self.expired = False
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def start(self, budget_s: float) -> None:
        """The budget runs from now; at its end every process started through ``popen`` is killed."""
        self.deadline = time.monotonic() + budget_s
        self._timer = threading.Timer(budget_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def popen(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen(cmd, start_new_session=True, **kwargs)``, killed at the deadline; past it,
        a process that would start is killed at once."""
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        with self._lock:
            self._procs = [p for p in self._procs if p.poll() is None] + [proc]
            late = self.expired
        if late:
            self._kill(proc)
        return proc

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            procs = list(self._procs)
        for proc in procs:
            self._kill(proc)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


CLOCK = StageClock()
"""The one clock of a gpu_check run (bench/gpu_check.py starts it; both stage modules use it)."""
