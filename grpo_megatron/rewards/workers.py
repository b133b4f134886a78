"""Sandboxed worker processes for user code, one lifecycle for the reward pool (rewards/pool.py) and the
tool pool (rewards/tools.py).

What both pools' workers go through (``WorkerPool``):

1. **spawn**: a ``forkserver`` (default) or ``spawn`` process, never a bare ``fork`` (unsafe once torch
   has started threads), with a duplex pipe; its ``SandboxPlan`` gives it a scratch directory of its
   own under the pool's (``slot``);
2. **start**: the worker ignores the trainer's signals (Ctrl-C and preemption are the trainer's to
   handle), enters its sandbox (sandbox.py: own session, scrubbed environment, limits, no network,
   read-only file system but its scratch directory, a uid of its own when root), imports the user
   code saying which item it imports, then says ``ready`` with the protections that are active
   (``serve_in_sandbox``); the pool waits for that within ``reward.startup_timeout_s``
   (``wait_ready``) and logs the protections once;
3. **messages**: everything a worker says is one size-bounded frame of JSON of a fixed schema read with a
   deadline (wire.py); a message of a kind the pool does not take, or out of turn, is a
   ``wire.ProtocolError``;
4. **replace and reap**: a worker that timed out, died or lied is killed (SIGKILL, with everything it
   started) and a fresh one takes its slot (``replace``); killed processes are reaped without blocking;
5. **close**: every worker killed and reaped, the scratch directories removed (also at garbage
   collection, if ``close`` was never called).

What each pool does with its workers (chunks of samples with a per-sample clock; one tool call at a
time) is the pool's.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import multiprocessing.connection as mp_conn
import os
import shutil
import signal
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from grpo_megatron.rewards import wire
from grpo_megatron.rewards.config import RewardConfig
from grpo_megatron.rewards.sandbox import SandboxPlan, SandboxReport, enter_sandbox, kill_worker

T = TypeVar("T")


@dataclass(eq=False)
class Worker:
    """One sandboxed worker process, as its pool sees it."""

    process: Any  # multiprocessing.process.BaseProcess
    conn: mp_conn.Connection
    slot: int
    started_at: float
    progress: Any = None
    """Shared ``[task id, start time]`` the worker writes before each task (reward workers: the pool's
    per-sample clock); None: the pool clocks each task from its hand-over."""
    ready: bool = False
    importing: int | None = None
    """The item it is importing at start-up (its index; increases)."""
    tasks: deque[int] = field(default_factory=deque)
    """Tasks handed over and not answered, in order."""
    sent_at: float = 0.0
    """When its tasks were handed over."""
    hard_deadline: float = math.inf
    """Past this its tasks are late whatever its progress says (a chunk: ``timeout_s`` per task)."""

    @property
    def task(self) -> int | None:
        """The task it answers next (None: idle)."""
        return self.tasks[0] if self.tasks else None

    def running(self, now: float) -> tuple[int | None, float]:
        """The task it is on (None: not one it still owes) and since when, from its progress record; a
        start before the hand-over or in the future counts from the hand-over. Without a progress
        record: its next task, since the hand-over."""
        if self.progress is None:
            return self.task, self.sent_at
        raw_task, start = float(self.progress[0]), float(self.progress[1])  # user code could write anything
        task = int(raw_task) if math.isfinite(raw_task) else -1
        start = start if self.sent_at <= start <= now else self.sent_at  # NaN too: from the hand-over
        return (task if task in self.tasks else None), start

    def deadline(self, timeout_s: float, now: float) -> float:
        """When its current task runs out of time (inf: idle); never past ``hard_deadline``."""
        if not self.tasks:
            return math.inf
        return min(self.running(now)[1] + timeout_s, self.hard_deadline)


@dataclass(frozen=True)
class WorkerKind:
    """What a pool's workers run and may say: the reward workers (rewards/pool.py) or the tool workers
    (rewards/tools.py)."""

    target: Callable[..., None]
    """The worker's main: ``target(conn, plan, *args[, progress])``."""
    name: str
    """Processes are ``grpo-<name>-worker``; the sandbox line says ``<name> sandbox``."""
    tag: str
    """The log prefix ``[<tag>]``; scratch directories ``grpo-<tag>-*``."""
    kinds: frozenset[str]
    """The wire.py message kinds the workers may send."""
    first_slot: int = 0
    """Slot of the first worker (scratch directory and uid): pools side by side do not share them."""
    preload: tuple[str, ...] = ()
    """Modules the forkserver imports once, so that a replacement starts warm."""
    progress: bool = False
    """Each worker gets a shared ``[task id, start time]`` record as its last argument (``Worker.progress``)."""


class StartFailure(Exception):
    """A worker did not get ready: ``cause`` says how (it hangs, exited, sent a malformed message), or
    ``init_error`` is what it said (its sandbox or an import failed)."""

    def __init__(self, worker: Worker, cause: str, init_error: str | None = None):
        super().__init__(init_error or cause)
        self.worker, self.cause, self.init_error = worker, cause, init_error


def _kill_all(workers: list[Worker], scratch_root: str | None) -> None:
    """Kill every worker, reap it and remove the scratch directories (also run by weakref.finalize
    if close() was never called)."""
    for w in workers:
        kill_worker(w.process, w.conn)
    for w in workers:
        try:
            w.process.join(timeout=1.0)
        except (OSError, ValueError, AssertionError):
            pass
    workers.clear()
    if scratch_root is not None:
        shutil.rmtree(scratch_root, ignore_errors=True)


class WorkerPool:
    """``num_workers`` sandboxed processes of ``kind`` running ``kind.target(conn, plan, *args)`` (see
    the module docstring), in the sandbox ``cfg`` describes (``reward.sandbox``, ``reward.mp_context``,
    ``reward.worker_memory_mb``). ``imports``: how many items they import at start-up;
    ``component_names``: the names their scores may carry (reward workers)."""

    def __init__(
        self,
        cfg: RewardConfig,
        kind: WorkerKind,
        args: tuple[Any, ...],
        *,
        num_workers: int,
        imports: int,
        component_names: frozenset[str] = frozenset(),
        log: Callable[[str], None] | None = print,
    ):
        self.cfg, self.kind, self.args = cfg, kind, args
        self.imports, self.component_names, self.log = imports, component_names, log
        self.restarts = 0
        self.sandbox: SandboxReport | None = None
        """What the first worker to get ready reported as active."""
        self.graveyard: list[Any] = []
        """Killed processes not yet reaped."""
        self.ctx: mp.context.SpawnContext | mp.context.ForkServerContext = (
            mp.get_context("spawn") if cfg.mp_context == "spawn" else mp.get_context("forkserver")
        )
        if kind.preload and cfg.mp_context == "forkserver":
            self.ctx.set_forkserver_preload(
                list(kind.preload)
            )  # effective only if the forkserver has not started
        self.scratch_root = tempfile.mkdtemp(prefix=f"grpo-{kind.tag}-", dir=cfg.sandbox.scratch_dir)
        os.chmod(self.scratch_root, 0o711)  # workers with a uid of their own reach their sub-directory
        self.workers: list[Worker] = []
        self._finalizer = weakref.finalize(self, _kill_all, self.workers, self.scratch_root)
        for slot in range(num_workers):
            self.workers.append(self.spawn(slot))

    def spawn(self, slot: int) -> Worker:
        sb = self.cfg.sandbox
        plan = SandboxPlan(
            scratch_root=self.scratch_root,
            slot=self.kind.first_slot + slot,
            trainer_pid=os.getpid(),
            isolate=sb.isolate,
            allow_network=sb.allow_network,
            memory_mb=self.cfg.worker_memory_mb,
            file_mb=sb.max_file_mb,
            max_processes=sb.max_processes,
            max_open_files=sb.max_open_files,
            keep_env=tuple(sb.keep_env),
        )
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        progress = None
        if self.kind.progress:
            progress = self.ctx.RawArray("d", 2)
            progress[0] = -1.0
        extra = (progress,) if self.kind.progress else ()
        proc = self.ctx.Process(
            target=self.kind.target,
            args=(child_conn, plan, *self.args, *extra),
            daemon=True,
            name=f"grpo-{self.kind.name}-worker",
        )
        proc.start()
        child_conn.close()
        return Worker(proc, parent_conn, slot, time.monotonic(), progress)

    def replace(self, worker: Worker) -> Worker:
        """Kill ``worker`` (reaped later) and start a fresh one in its slot; returns it."""
        kill_worker(worker.process, worker.conn)
        self.graveyard.append(worker.process)
        fresh = self.spawn(worker.slot)
        self.workers[self.workers.index(worker)] = fresh
        self.restarts += 1
        return fresh

    def reap(self) -> None:
        """Collect the exit status of killed workers without blocking (no zombies pile up)."""
        alive = []
        for proc in self.graveyard:
            try:
                proc.join(timeout=0)
            except (OSError, ValueError, AssertionError):
                continue
            if proc.exitcode is None:
                alive.append(proc)
        self.graveyard[:] = alive

    def receive(self, w: Worker) -> wire.Message:
        """The next message of ``w`` (its pipe is readable), decoded by wire.py's fixed schema, its
        start-up messages checked for order. EOFError/OSError: the worker is gone;
        wire.ProtocolError: it sent something else, or a start-up message out of turn."""
        message = wire.decode(wire.read_frame(w.conn.fileno()), self.component_names, self.kind.kinds)
        if isinstance(message, wire.Importing):
            earlier = -1 if w.importing is None else w.importing
            if w.ready or message.index >= self.imports or earlier >= message.index:
                raise wire.ProtocolError(f"an out-of-turn 'importing {message.index}' message")
        elif isinstance(message, wire.Ready | wire.InitError):
            if w.ready:
                raise wire.ProtocolError("a start-up message from a worker that is ready")
        elif not w.ready:
            raise wire.ProtocolError(f"a {type(message).__name__} message from a worker that is not ready")
        return message

    def wait_ready(self, deadline: float, workers: Sequence[Worker] | None = None) -> None:
        """Until every one of ``workers`` (None: all) is ready, or ``StartFailure`` for the first that
        will not be: past ``deadline`` (``time.monotonic``), gone, lying or reporting an init error."""
        waiting = {w.conn: w for w in (self.workers if workers is None else workers) if not w.ready}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StartFailure(next(iter(waiting.values())), "it hangs")
            for conn in ready_connections(list(waiting), remaining):
                w = waiting[conn]
                try:
                    msg = self.receive(w)
                except (EOFError, OSError):
                    raise StartFailure(w, f"worker exited with code {w.process.exitcode}") from None
                except wire.ProtocolError as err:
                    raise StartFailure(w, f"the worker sent a malformed message: {err}") from None
                if isinstance(msg, wire.Importing):
                    w.importing = msg.index
                elif isinstance(msg, wire.Ready):
                    w.ready = True
                    del waiting[conn]
                    self.note_sandbox(msg)
                else:
                    raise StartFailure(
                        w, "init error", msg.message if isinstance(msg, wire.InitError) else str(msg)
                    )

    def note_sandbox(self, ready: wire.Ready) -> None:
        if self.sandbox is None:  # log once per pool: every worker applies the same plan
            self.sandbox = SandboxReport(scratch=ready.scratch, active=ready.active, inactive=ready.inactive)
            if self.log is not None:
                self.log(f"[{self.kind.tag}] {self.sandbox.line(self.kind.name)}")

    def close(self) -> None:
        """Kill and reap every worker, remove the scratch directories. Idempotent."""
        _kill_all(self.workers, None)
        self.reap()
        self._finalizer.detach()
        shutil.rmtree(self.scratch_root, ignore_errors=True)


def ready_connections(conns: list[mp_conn.Connection], timeout: float) -> list[mp_conn.Connection]:
    """``multiprocessing.connection.wait`` over pipes, typed: the ones of ``conns`` ready to read."""
    ready = {id(c) for c in mp_conn.wait(conns, timeout=timeout)}
    return [c for c in conns if id(c) in ready]


def serve_in_sandbox(
    conn: mp_conn.Connection,
    plan: SandboxPlan,
    load: Callable[[Callable[[int], None]], T],
    *,
    what: str,
    silence_output: bool = False,
) -> T | None:
    """A worker's start (its side of ``WorkerPool.wait_ready``): ignore the trainer's signals, optionally
    send stdout and stderr to /dev/null (a flood cannot reach the trainer's log), enter the sandbox,
    ``load(on_import)`` the user code (``on_import(i)`` says which item it imports), and say ready.
    Returns what ``load`` made, or None after saying why it could not (an ``init_error``)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)  # Ctrl-C and preemption are the trainer's to handle
    if silence_output:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)

    def say(message: wire.Message) -> None:
        conn.send_bytes(wire.encode(message))

    try:
        report = enter_sandbox(plan)
    except BaseException as err:  # noqa: BLE001 - any failure must reach the parent as a message
        say(wire.InitError(f"{what} sandbox set-up failed: {type(err).__name__}: {err}"))
        return None
    try:
        loaded = load(lambda i: say(wire.Importing(i)))
    except BaseException as err:  # noqa: BLE001
        say(wire.InitError(str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"))
        return None
    say(wire.Ready(report.scratch, list(report.active), list(report.inactive)))
    return loaded
