"""A rank that stops making progress ends the job within ``parallel.progress_timeout_s``, named.

A dead rank ends a torchrun job at once; a *stuck* one (a hung file system, a deadlocked engine, a
reward call that never returns, a wait on an NCCL kernel that never completes) leaves every other
rank waiting until the process-group timeout, with no word of who is stuck. Here each rank's
watchdog thread publishes, every few seconds, to the launcher's key-value store (the TCPStore at
MASTER_ADDR:MASTER_PORT that the rendezvous used) the age of its heartbeat, the phase it is in and
whether its main thread is blocked inside a torch.distributed collective (read from its stack).

The heartbeat: the main thread's progress points (``beat``: every timed phase of an iteration,
every SFT step, start-up's stages), and any change of the main thread's Python stack seen by the
watchdog thread (a long healthy phase keeps moving through its frames; a blocked thread, in a sleep,
a socket read or a CUDA/NCCL wait, sits on one line). A phase known to block in one call for long
(an engine's start-up, its weight loading) runs under ``long_phase`` with its own bound.

Rank 0's thread judges: a rank is stuck when its heartbeat is older than its phase's bound while it
sits outside any c10d collective (ranks waiting inside one wait for somebody else), or when its
watchdog thread stopped publishing for that long (the process is frozen or holds the GIL). It then
writes a verdict naming each such rank, its host, its phase and the heartbeat's age (the ranks with
the fewest progress points first: the others usually wait for them, e.g. in an NCCL kernel outside
c10d); every rank's thread reads it, prints it, and exits the process, so the launcher ends the job.

What it cannot see: every rank blocked inside c10d collectives at once (mismatched collectives, a
network fault): that is the process-group timeout's job (``parallel.timeout_minutes``). A single
call that legitimately blocks longer than the bound outside ``long_phase`` (rank 0 scoring rewards
while the others wait is fine: its stack moves) ends the job: raise the bound or wrap the call.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


def stack_key(thread_id: int) -> tuple[tuple[str, int], ...]:
    """Where thread ``thread_id`` is: (file, bytecode offset) of every frame; it changes while the
    thread works through calls (a trainer phase, a file read, a reward loop) and stays put while the
    thread is blocked in one call. (A tight pure-Python loop can be caught at the same instruction
    every time and look blocked: the bound must exceed such a loop, as any single blocking call.)"""
    frame = sys._current_frames().get(thread_id)
    key = []
    while frame is not None:
        key.append((frame.f_code.co_filename, frame.f_lasti))
        frame = frame.f_back
    return tuple(key)


@dataclass
class _Seen:
    """What rank 0 last saw of one rank: its watchdog's tick count and when that changed."""

    tick: int = -1
    since: float = 0.0


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
    _limit_s: float = 0.0
    """The current phase's bound (``long_phase``); 0: ``timeout_s``."""
    _last: float = field(default_factory=time.monotonic)
    """When the main thread last beat or was seen moving (the heartbeat)."""
    _stack: tuple[tuple[str, int], ...] = ()
    """The main thread's ``stack_key`` at the last tick."""
    _ticks: int = 0
    _main_id: int = field(default_factory=lambda: threading.main_thread().ident or 0)
    _stop: threading.Event = field(default_factory=threading.Event)
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _thread: threading.Thread | None = None

    def beat(self, phase: str) -> None:
        """The main thread passed a progress point (cheap: no I/O; the thread publishes it)."""
        self._count += 1
        self._phase = phase
        self._last = time.monotonic()

    @contextmanager
    def long_phase(self, phase: str, limit_s: float) -> Iterator[None]:
        """A phase that may block in one call for up to ``limit_s`` (an engine's start-up, weight
        loading): its heartbeat may be that old (at least ``timeout_s``) before the rank counts as
        stuck; the bound of the enclosing phase comes back after it."""
        outer_limit = self._limit_s
        self._limit_s = max(limit_s, self.timeout_s)
        self.beat(phase)
        try:
            yield
        finally:
            self._limit_s = outer_limit
            self.beat(f"{phase} (done)")

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
                    print(
                        f"[watchdog] rank {self.rank}: stopped watching ({exc})", file=sys.stderr, flush=True
                    )
                return

    def _tick(self, now: float) -> None:
        stack = stack_key(self._main_id)
        if stack != self._stack:  # the main thread moved: alive
            self._stack, self._last = stack, now
        self._ticks += 1
        state = {
            "count": self._count,
            "phase": self._phase,
            "age": now - self._last,
            "tick": self._ticks,
            "limit": self._limit_s or self.timeout_s,
            "waiting": in_collective(self._main_id),
            "host": self.host,
        }
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
        stuck, over = [], False
        for r, s in enumerate(states):
            seen = self._seen.setdefault(r, _Seen(s["tick"], now))
            if s["tick"] != seen.tick:
                seen.tick, seen.since = s["tick"], now
            silent = now - seen.since
            if silent > s["limit"] + 2 * self.interval_s:
                over = True
                stuck.append(
                    (
                        s["count"],
                        r,
                        f"its watchdog published nothing for {silent:.0f} s (frozen, or the GIL held)",
                    )
                )
            elif s["age"] > s["limit"] / 2 and not s["waiting"]:
                # Half the bound already names a rank (once any passed the bound): one that blocks a
                # little later than the rank waiting for it outside c10d (NCCL) is named too.
                over = over or s["age"] > s["limit"]
                stuck.append((s["count"], r, f"no progress for {s['age']:.0f} s (bound {s['limit']:g} s)"))
        if not over:
            return None
        waiting = [str(r) for r, s in enumerate(states) if s["waiting"]]
        named = "; ".join(
            f"rank {r} on {states[r]['host']} in phase '{states[r]['phase']}': {why}"
            for _, r, why in sorted(stuck)
        )
        return (
            f"stuck: {named}"
            + (f"; rank(s) {', '.join(waiting)} waited in a collective" if waiting else "")
            + f"; stopping every rank (parallel.progress_timeout_s={self.timeout_s:g})"
        )


def start_watchdog(timeout_s: float, rank: int, world_size: int) -> ProgressWatchdog | None:
    """Connect to the launcher's store and start this rank's watchdog; None when ``timeout_s`` is 0
    or there is one rank (nobody to wait for it)."""
    import torch.distributed as dist

    if timeout_s <= 0 or world_size < 2:
        return None
    store = dist.PrefixStore(
        "grpo_progress/",
        dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=False,
            timeout=timedelta(seconds=60),
            wait_for_workers=False,
        ),
    )
    interval = min(5.0, max(0.2, timeout_s / 10))
    return ProgressWatchdog(store, rank, world_size, timeout_s, interval).start()
