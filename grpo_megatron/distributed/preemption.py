"""Save on signal: SIGTERM (and ``checkpoint.signal``, SIGUSR1 by default) stops the run at a safe point
with a checkpoint, within ``checkpoint.signal_grace_s``.

A signal reaches one rank or all of them (Slurm: every process of the job step), at any point of an
iteration. The handler only notes it (``Preemption.received``); the loop asks ``requested_anywhere(group)``
at its safe points: an all-reduce (MAX) of the signal number over the group passed in, so every rank
sees the same answer at the same point even when only one of them got the signal. The safe points
(training/grpo.py, issue 51): after the rollout and reward and after the logprob passes (the synchronous
loop: the batch is dropped and the last completed iteration saved, unless it has a checkpoint), before
each mini-batch of the update but the first (the update stops there), after an evaluation (dropped),
and at the iteration's end, after its bookkeeping and any periodic save. Then every rank writes the
checkpoint (if there is none of that iteration yet) and exits ``EXIT_PREEMPTED``. Work whose result a
signal makes the loop drop is cut short as the signal arrives: inside ``interrupting(hook)`` the watcher
thread calls the hook (the rollout engines' ``interrupt``).

Bounded time: the signal handler is Python code, which runs only when the main thread returns to
the interpreter, so a rank blocked in a collective would never run it. The C-level handler writes
each signal's number to a pipe (``signal.set_wakeup_fd``) at once, though, and a watcher thread
reads it (the Python-level handler writes it there too: an event loop running in the main thread,
such as SGLang's during a request, has the wakeup fd meanwhile): at the first signal it starts the grace clock, at a second one (another signal, or the
same one again after ``DUPLICATE_WINDOW_S``: a launcher that forwards what Slurm also delivered
directly makes two copies of one), or when the clock runs out, it ends the process with ``os._exit`` -- exit code ``EXIT_INTERRUPTED``, or
``EXIT_PREEMPTED`` when the checkpoint was written already. ``latest`` is replaced by an atomic
rename, so no exit leaves it half-written; an unfinished ``iter_*.tmp-*`` is pruned at the next
start-up.

With torchrun in between, a rank's exit code does not reach the shell (torchrun exits 1 for any
failed worker): when ``$GRPO_EXIT_FILE`` is set, rank 0 also writes the code there, after the
checkpoint and before any rank exits (launch/slurm/node.sh and train.sbatch read it).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.distributed.collectives import collective_device
from grpo_megatron.fileio import write_text_atomic

__all__ = [
    "EXIT_PREEMPTED",
    "EXIT_INTERRUPTED",
    "EXIT_FILE_ENV",
    "Preempted",
    "Preemption",
    "report_preempted",
]

EXIT_PREEMPTED = 75
"""Every rank's exit code after a signal once the checkpoint is written: rerun (requeue) to resume.
(EX_TEMPFAIL of sysexits.h: a temporary failure, the user is invited to retry.)"""
EXIT_INTERRUPTED = 143
"""The exit code at a second signal or when the grace ran out before the checkpoint was written
(128 + SIGTERM, what a kill by SIGTERM reports); the rerun resumes from the previous checkpoint."""
EXIT_FILE_ENV = "GRPO_EXIT_FILE"
DUPLICATE_WINDOW_S = 1.0
"""The first signal again within this many seconds is one signal by two routes, not a second one."""
NOTICE = 0x80
"""Added to a signal's number on the watcher's pipe when the Python-level handler wrote it
(``Preemption._on_signal``); signal numbers stay below it."""


class Preempted(Exception):
    """Raised by the training loop on every rank once the preemption checkpoint is written (``saved``
    False: nothing was trained yet, so there is none and a rerun starts afresh)."""

    def __init__(self, iteration: int, signal_name: str, *, saved: bool = True) -> None:
        super().__init__(f"{signal_name}: stopped after iteration {iteration} with a checkpoint")
        self.iteration = iteration
        self.signal_name = signal_name
        self.saved = saved


class Preemption:
    """The signal handler's flag object of one process (install once, from the main thread)."""

    def __init__(self, signals: Sequence[int], grace_s: float, log: Callable[[str], None] = print) -> None:
        self.signals = tuple(dict.fromkeys(signals))
        self.grace_s = grace_s
        self.received: str | None = None
        """The name of the first signal, once one arrived."""
        self.checkpoint_written = False
        """Set by the loop once the preemption checkpoint is complete (the grace then exits 75)."""
        self._log = log
        self._deadline: float | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}
        self._previous_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._interrupt: Callable[[], None] | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def interrupting(self, interrupt: Callable[[], None]) -> Iterator[None]:
        """Inside the body a signal calls ``interrupt()`` at once (from the watcher thread; at entry
        when one came already): the loop's way to cut work it will drop anyway short, the engines'
        generation of a batch a signal abandons (``RolloutFleet.interrupt``). Outside, nothing."""
        with self._lock:
            self._interrupt = interrupt
            due = self.received is not None
        try:
            if due:
                interrupt()
            yield
        finally:
            with self._lock:
                self._interrupt = None

    def _interrupt_now(self) -> None:
        with self._lock:
            interrupt = self._interrupt
        if interrupt is not None:
            try:
                interrupt()
            except Exception as exc:  # the save must still happen: the stop is only later
                self._log(f"[preempt] cutting the running work short failed ({type(exc).__name__}: {exc})")

    def install(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd requires it; a full pipe drops bytes, not blocks
        self._pipe = (read_fd, write_fd)
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="grpo-preemption", daemon=True)
        self._thread.start()

    def uninstall(self) -> None:
        """Restore the previous handlers and stop the watcher (also after a signal: the caller is
        about to exit on its own)."""
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self._pipe[1])  # the watcher reads EOF and returns
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        os.close(self._pipe[0])
        self._pipe = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler (it may run late, or never, in a blocked rank): the watcher thread
        acts on the byte the C-level handler wrote to the wakeup pipe. But an event loop running in
        this thread has a wakeup fd of its own meanwhile (uvloop's, while SGLang's ``Engine`` serves a
        request: the whole rollout phase), and the byte went there; so this handler tells the watcher
        too, with ``NOTICE`` added (a first signal for it, never a second: the C-level byte is)."""
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self._pipe[1], bytes([signum | NOTICE]))

    def _watch(self) -> None:
        assert self._pipe is not None
        read_fd = self._pipe[0]
        poller = select.poll()  # not select.select: the fd may number past FD_SETSIZE (1024)
        poller.register(read_fd, select.POLLIN)
        while True:
            timeout = (
                None if self._deadline is None else max(0, int((self._deadline - time.monotonic()) * 1000))
            )
            if not poller.poll(timeout):
                self._exit(f"the grace of checkpoint.signal_grace_s={self.grace_s:g} s ran out")
            data = os.read(read_fd, 64)
            if not data:
                return
            for byte in data:
                signum, notice = byte & ~NOTICE, bool(byte & NOTICE)
                if signum not in self.signals or (notice and self.received is not None):
                    continue  # another handler's signal (SIGINT is Python's own), or news of one seen
                name = signal.Signals(signum).name
                now = time.monotonic()
                if self.received == name and now - self._first_at < DUPLICATE_WINDOW_S:
                    continue  # the same signal by a second route (Slurm to every process, and node.sh)
                if self.received is not None:
                    self._exit(f"a second signal ({name})")
                self.received, self._first_at = name, now
                self._deadline = now + self.grace_s
                self._log(
                    f"[preempt] {name}: saving a checkpoint at the next safe point and stopping (at most "
                    f"checkpoint.signal_grace_s={self.grace_s:g} s; a second signal stops at once)"
                )
                self._interrupt_now()

    def _exit(self, why: str) -> None:
        code = EXIT_PREEMPTED if self.checkpoint_written else EXIT_INTERRUPTED
        self._log(f"[preempt] {why}: exiting now with {code}")
        os._exit(code)

    def requested_anywhere(self, group: dist.ProcessGroup | None) -> str | None:
        """Collective over ``group`` (None: the default group): the signal any of its ranks got (the
        highest-numbered one when several did), None when none did. The safe point's question."""
        number = signal.Signals[self.received].value if self.received else 0
        flag = torch.tensor([number], dtype=torch.int64, device=collective_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return signal.Signals(int(flag.item())).name if flag.item() else None


def report_preempted(stop: Preempted, checkpoint: Path, rank: int, group: dist.ProcessGroup | None) -> int:
    """Collective: rank 0 says what happened and writes ``$GRPO_EXIT_FILE``; returns EXIT_PREEMPTED."""
    if rank == 0:
        kept = f"checkpoint {checkpoint} written" if stop.saved else "no checkpoint (nothing trained yet)"
        print(
            f"[preempt] {stop.signal_name}: {kept} after iteration {stop.iteration}; "
            f"exiting with {EXIT_PREEMPTED} (rerun the same command to resume)",
            flush=True,
        )
        exit_file = os.environ.get(EXIT_FILE_ENV)
        if exit_file:
            write_text_atomic(Path(exit_file), f"{EXIT_PREEMPTED}\n")
    dist.barrier(group=group)  # the file exists before any rank (and so torchrun) exits
    return EXIT_PREEMPTED
