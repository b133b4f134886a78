"""A rank that stops making progress ends the job within ``parallel.progress_timeout_s``, named.

A dead rank ends a torchrun job at once; a *stuck* one (a hung file system, a deadlocked engine, a
reward call that never returns) leaves every other rank waiting in its next collective until the
process-group timeout, with no word of who is stuck. Here each rank's watchdog thread publishes,
every few seconds, to the launcher's key-value store (the TCPStore at MASTER_ADDR:MASTER_PORT that
the rendezvous used): how many progress points its main thread passed (``beat``: every timed phase
of an iteration, every SFT step) and whether that thread is blocked inside a torch.distributed
collective right now (read from its stack). Rank 0's thread judges: a rank is stuck when, for
longer than ``progress_timeout_s``, it passed no progress point and sat outside any collective while
another rank waited in one. It then writes a verdict naming that rank, its host and its last phase;
every rank's thread reads it, prints it, and exits the process, so the launcher ends the job.

What it cannot see: every rank blocked in collectives at once (mismatched collectives, a network
fault): that is the process-group timeout's job (``parallel.timeout_minutes``). Work one rank does
while the others wait (rank 0 scoring rewards, an uneven rollout) must finish within the bound.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

EXIT_STUCK = 3
_VERDICT = "verdict"
_ACKS = "verdict_acks"
_C10D_FILE = "distributed_c10d.py"


def in_collective(thread_id: int) -> bool:
    """Whether thread ``thread_id`` is inside a torch.distributed collective (its stack has a frame
    of distributed_c10d.py: all_reduce, broadcast, barrier, ... block there)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_C10D_FILE):
            return True
        frame = frame.f_back
    return False


@dataclass
class _Seen:
    """What rank 0 last saw of one rank: its progress count and since when it looked stuck."""

    count: int = -1
    suspect_since: float | None = None


@dataclass
class ProgressWatchdog:
    """Per-rank heartbeat thread; rank 0's also judges. ``beat(phase)`` from the main thread."""

    store: Any
    rank: int
    world_size: int
    timeout_s: float
    interval_s: float
    host: str = field(default_factory=socket.gethostname)
    _count: int = 0
    _phase: str = "start-up"
    _main_id: int = field(default_factory=lambda: threading.main_thread().ident or 0)
    _stop: threading.Event = field(default_factory=threading.Event)
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _thread: threading.Thread | None = None

    def beat(self, phase: str) -> None:
        """The main thread passed a progress point (cheap: no I/O; the thread publishes it)."""
        self._count += 1
        self._phase = phase

    def start(self) -> ProgressWatchdog:
        self._thread = threading.Thread(target=self._run, name="grpo-progress-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._tick(time.monotonic())
            except Exception as exc:  # the store went away (launcher ending): stop watching quietly
                if not self._stop.is_set():
                    print(f"[watchdog] rank {self.rank}: stopped watching ({exc})", file=sys.stderr, flush=True)
                return

    def _tick(self, now: float) -> None:
        state = {"count": self._count, "phase": self._phase, "waiting": in_collective(self._main_id), "host": self.host}
        self.store.set(f"rank{self.rank}", json.dumps(state))
        if self.rank == 0 and not self.store.check([_VERDICT]):
            verdict = self._judge(now)
            if verdict:
                self.store.set(_VERDICT, verdict)
        if self.store.check([_VERDICT]):
            message = self.store.get(_VERDICT).decode()
            print(f"[watchdog] rank {self.rank}: {message}", file=sys.stderr, flush=True)
            # Wait (briefly) until every rank has said it too: the first to exit makes the launcher
            # kill the rest, which should not happen before they have named the stuck rank.
            self.store.add(_ACKS, 1)
            deadline = time.monotonic() + 5 * self.interval_s
            while self.store.add(_ACKS, 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(self.interval_s / 10)
            os._exit(EXIT_STUCK)

    def _judge(self, now: float) -> str | None:
        keys = [f"rank{r}" for r in range(self.world_size)]
        if not self.store.check(keys):
            return None  # a rank has not published yet (still starting)
        states = [json.loads(self.store.get(k)) for k in keys]
        anyone_waiting = any(s["waiting"] for s in states)
        for r, s in enumerate(states):
            seen = self._seen.setdefault(r, _Seen())
            if s["count"] != seen.count or s["waiting"] or not anyone_waiting:
                seen.count, seen.suspect_since = s["count"], None
                continue
            if seen.suspect_since is None:
                seen.suspect_since = now
            elif now - seen.suspect_since > self.timeout_s:
                waiting = [str(o) for o, t in enumerate(states) if t["waiting"]]
                return (
                    f"rank {r} on {s['host']} made no progress for {now - seen.suspect_since:.0f} s (last phase "
                    f"'{s['phase']}') while rank(s) {', '.join(waiting)} waited for it in a collective; stopping "
                    f"every rank (parallel.progress_timeout_s={self.timeout_s:g})"
                )
        return None


def start_watchdog(timeout_s: float, rank: int, world_size: int) -> ProgressWatchdog | None:
    """Connect to the launcher's store and start this rank's watchdog; None when ``timeout_s`` is 0
    or there is one rank (nobody to wait for it)."""
    import torch.distributed as dist

    if timeout_s <= 0 or world_size < 2:
        return None
    store = dist.PrefixStore(
        "grpo_progress/",
        dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
            timeout=timedelta(seconds=60), wait_for_workers=False,
        ),
    )
    interval = min(5.0, max(0.2, timeout_s / 10))
    return ProgressWatchdog(store, rank, world_size, timeout_s, interval).start()
