"""Whether a colocated SGLang engine's processes are alive, and a clear end when one is not.

An ``sglang.Engine`` runs its schedulers and detokenizer as child processes of the trainer rank that
started it. When one dies (a crash, the OOM killer, a kill), SGLang's own watchdog (0.5.23) sends
SIGQUIT to that rank, whose default handler kills the rank's whole process tree without a word; an
engine without that watchdog (0.5.17) leaves the next request waiting forever. Here:

- ``EngineProcesses.start`` starts the engine with its processes' output going to a log file of its
  own (``<run_dir>/sglang/engine-rank<R>-<pid>.log``), and records which processes it started; they
  start with SIGTERM ignored (an ignored signal stays ignored through spawn's exec; a blocked one
  does not: spawn clears the mask), so a preemption's SIGTERM, which Slurm sends to every process of
  the job, does not kill them: the trainer's handler saves a checkpoint and then shuts them down
  (SGLang stops its processes with SIGKILL);
- ``check`` (before each generate, score and weight load) raises ``EngineLost`` naming the engine,
  the rank, the host, the dead process and the log's last lines, which the fleet's engine recovery
  (``rollout/recovery.py``) answers with a restart in place (``SGLangEngine.restart``) or, past
  ``rollout.recovery.max_restarts`` (0 included), with a clean exit on every rank naming the engine;
- ``on_sigquit`` replaces SGLang's handler: it prints the engine's death and exits the rank with
  ``EXIT_ENGINE_DIED``, so torchrun ends the job and the last checkpoint (written atomically) stays
  the one a rerun resumes from; with ``recoverable`` (``rollout.recovery.max_restarts`` > 0) it only
  notes the loss, which ``check`` then raises;
- ``stopped`` names processes stopped (state T, e.g. SIGSTOP) past a deadline: they count as lost;
  a scheduler alive but hung (state S or R, answering nothing) is found by the wait for a generation
  (``engine.py:SchedulerProbe``: a state request unanswered past the deadline), or by SGLang's own
  scheduler watchdog (a forward without progress past its ``watchdog_timeout``, 300 s by default),
  whose SIGQUIT ``check`` then reports as the engine lost;
- an engine that fails while it starts is named the same way (``EngineStartError``, or
  ``sigquit_while_starting`` when its scheduler's SIGQUIT comes first): SGLang's launch-phase
  handler would SIGKILL the rank's whole tree, torchrun then reporting only "Signal 9" (seen on an
  H200 with 0.5.17: a rotary-embedding assertion in the scheduler; the traceback was in the log only);
- ``engine_only_shutdown``: ``sglang.Engine.shutdown`` ends by killing every child of the rank
  (``kill_process_tree(os.getpid(), include_parent=False)``): the reward pool's workers, wandb's
  service, megatron's checkpoint writer, before they close. Around it, that one call kills only the
  process trees this engine started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from grpo_megatron.rollout.engine import LOG_TAIL_LINES, EngineLost, last_error_line, log_tail

EXIT_ENGINE_DIED = 70
"""A rank's exit status when its SGLang engine died (EX_SOFTWARE)."""
LOG_LINES = LOG_TAIL_LINES


class EngineStartError(RuntimeError):
    """This rank's SGLang engine failed while it started; the message names the engine, the rank, the
    host, the cause and its log's last lines."""


STARTING: list[EngineProcesses] = []
"""The engine this process is starting now (``EngineProcesses.start``; at most one), for
``sigquit_while_starting``. SGLang pickles its server arguments, a SIGQUIT handler among them, into
every process it spawns: the handler must be a module-level function, so it finds its engine here."""


def sigquit_while_starting(signum: int, frame: Any) -> None:
    """SGLang's ``custom_sigquit_handler`` (a server argument in 0.5.17 and 0.5.23) while an engine
    starts: a scheduler that fails sends SIGQUIT to this rank, whose launch-phase handler would
    SIGKILL the rank's whole process tree without a word. Name the engine and its log's last lines
    (on the console: the rank's own output goes to the log while the engine starts) and exit the rank
    ``EXIT_ENGINE_DIED``. Outside a start (the engine's own error already on its way) it does
    nothing; once the engine runs, ``take_back_signals`` puts ``on_sigquit`` in its place."""
    if STARTING:
        engine = STARTING[-1]
        engine.exit_rank(engine.start_report("one of its processes failed (SGLang's SIGQUIT)"))


@contextlib.contextmanager
def sigterm_ignored() -> Iterator[bool]:
    """While inside, this process ignores SIGTERM, so the processes it starts keep it ignored through
    their exec (a preemption's SIGTERM, which Slurm sends to every process of the job, must reach
    the trainer only: it saves, then stops the engines); its own handler comes back after. From the
    main thread only, where handlers can be set: elsewhere it does nothing (yields False)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield True
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def output_to(log_path: Path) -> Iterator[int]:
    """While inside, this process's stdout and stderr (file descriptors 1 and 2, which the processes
    it starts inherit) write to ``log_path`` (appended); they come back after. Yields a descriptor of
    the stderr from before (the console), valid while inside."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield saved[1]
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


class EngineProcesses:
    """The processes one ``sglang.Engine`` started on this rank, and where they log."""

    def __init__(self, rank: int, log_path: Path):
        self.rank = rank
        self.host = socket.gethostname()
        self.log_path = log_path
        self.procs: list[psutil.Process] = []
        self.names: dict[int, str] = {}
        """Each process's name, read while it ran (a dead one has none to read)."""
        self.stopping = False
        """Set when this rank shuts the engine down: from then on its processes' deaths are expected."""
        self.loop_handlers_removed: list[bool] = []
        """Whether SGLang's own SIGTERM and SIGQUIT handlers came off its event loop (``take_back_signals``)."""
        self.console: int | None = None
        """While the engine starts: a descriptor of the rank's own stderr (fd 2 writes to the log then)."""
        self.recoverable = False
        """A lost engine is restarted in place (``rollout.recovery.max_restarts`` > 0): SIGQUIT no longer
        ends the rank, it is noted for ``check``."""
        self.on_lost: Callable[[], None] | None = None
        """Called by the SIGQUIT handler when ``recoverable``: ends a call blocked on the dead process
        (``ServerGuard.cancel``), which then raises ``EngineLost``."""
        self.stopped_since: dict[int, float] = {}
        """When each process was first seen stopped (state T), by pid; forgotten once it runs again."""
        self.quit_received = False
        """A SIGQUIT came while ``recoverable`` (``on_sigquit``): the engine is lost even with every
        process alive (SGLang's scheduler watchdog: a forward that made no progress past its
        ``watchdog_timeout``)."""

    @contextlib.contextmanager
    def start(self) -> Iterator[None]:
        """Around ``sglang.Engine(...)``: the processes it spawns write to ``log_path`` (this process's
        stdout and stderr point there while it starts; they come back after), inherit SIGTERM
        ignored (``sigterm_ignored``: a SIGTERM during the start is lost, when there is nothing new
        to save), and are recorded. A failure inside is raised as ``EngineStartError``; a SIGQUIT
        inside ends the rank naming the engine (``sigquit_while_starting``)."""
        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        STARTING.append(self)
        try:
            with sigterm_ignored(), output_to(self.log_path) as console:
                self.console = console
                yield
        except Exception as exc:
            raise EngineStartError(self.start_report(f"{type(exc).__name__}: {exc}")) from exc
        finally:
            self.console = None
            STARTING.remove(self)
            self.procs = [p for p in me.children(recursive=True) if p.pid not in before]
            self.names = {p.pid: _name(p) for p in self.procs}

    def dead(self) -> list[tuple[psutil.Process, str]]:
        """(process, how it ended) of every recorded process that is no longer running."""
        out = []
        for proc in self.procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    continue
                code = proc.wait(timeout=0)
                out.append((proc, f"exited with status {code}"))
            except psutil.NoSuchProcess:
                out.append((proc, "is gone"))
            except psutil.TimeoutExpired:
                continue
        return out

    def report(self, dead: list[tuple[psutil.Process, str]] | None = None) -> str:
        return self.died(self.cause(self.dead() if dead is None else dead))

    def cause(self, dead: list[tuple[psutil.Process, str]]) -> str:
        """Why the engine is gone, never empty: each dead process and how it ended (none yet: SGLang's
        SIGQUIT, sent by a failing process before it exits), and the last exception line of its log."""
        what = "; ".join(
            f"process {self.names.get(p.pid, 'of the engine')} (pid {p.pid}) {how}" for p, how in dead
        )
        what = what or "SGLang sent SIGQUIT (a process of the engine failed)"
        error = last_error_line(self.log_path)
        return f"{what}; its log's last error: {error}" if error else what

    def died(self, why: str) -> str:
        return (
            f"the SGLang engine of rank {self.rank} on {self.host} died: {why}. Last lines of its log "
            f"{self.log_path}:\n{tail(self.log_path)}\nThe last checkpoint is intact: run the same command "
            "again to resume from it."
        )

    def start_report(self, cause: str) -> str:
        return (
            f"the SGLang engine of rank {self.rank} on {self.host} failed to start: {cause}. Last lines of "
            f"its log {self.log_path}:\n{tail(self.log_path)}"
        )

    def exit_rank(self, message: str) -> None:
        """Print ``message`` on the rank's console, stop every process this rank started, exit
        ``EXIT_ENGINE_DIED`` (from a signal handler: no clean-up runs)."""
        line = f"grpo-megatron: error (rank {self.rank}): {message}\n"
        if self.console is not None:
            os.write(self.console, line.encode(errors="replace"))
        else:
            print(line, end="", file=sys.stderr, flush=True)
        # Everything this rank started goes with it: what is left of the engine, the reward
        # workers, megatron's checkpoint writer's manager process (an exit that skips Python's
        # clean-up would leave it running, holding the job's output open).
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        os._exit(EXIT_ENGINE_DIED)

    def check(self) -> None:
        """Raise ``EngineLost`` if a process of the engine is gone, or after a SIGQUIT noted with every
        process alive (``recoverable``)."""
        dead = self.dead()
        if dead:
            raise self.lost(self.cause(dead))
        if self.quit_received:
            raise self.lost(
                "SGLang sent SIGQUIT with every process of this rank's part alive (a scheduler "
                "failed: a peer of its TP group lost, on this node or another, or its watchdog: a "
                "forward made no progress past its watchdog_timeout)"
            )

    def check_now(self, stopped_s: float = 0.0) -> None:
        """``check``, and a process stopped (state T) for ``stopped_s`` counts as lost (0: at once, a call
        about to go to it; a wait for a generation gives it ``rollout.recovery.health_timeout_s``)."""
        self.check()
        why = self.stopped(stopped_s)
        if why is not None:
            raise self.lost(why)

    def lost(self, why: str) -> EngineLost:
        """The error for an engine lost because ``why`` (the fleet's recovery restarts it or names it)."""
        log = str(self.log_path)
        return EngineLost(self.rank, self.host, why, tail(self.log_path), log, what="SGLang engine")

    def stopped(self, deadline_s: float) -> str | None:
        """Which processes have been stopped (state T: SIGSTOP, a debugger) for ``deadline_s`` or longer
        (``rollout.recovery.health_timeout_s``); None: none. A stopped scheduler answers nothing, and
        SGLang's watchdog sees it alive: the wait for its generation would never end."""
        now, late = time.monotonic(), []
        for proc in self.procs:
            try:
                state = proc.status()
            except psutil.NoSuchProcess:
                continue
            if state not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                self.stopped_since.pop(proc.pid, None)
                continue
            since = self.stopped_since.setdefault(proc.pid, now)
            if now - since >= deadline_s:
                late.append(f"process {self.names.get(proc.pid, 'of the engine')} (pid {proc.pid})")
        if not late:
            return None
        return (
            f"{'; '.join(late)} stopped (state T) for {deadline_s:g} s or more, past "
            "rollout.recovery.health_timeout_s"
        )

    def kill_all(self) -> None:
        """SIGKILL what is left of the engine's processes and their children (a stopped one too) and
        reap them: after a shutdown of a lost engine, before it starts again."""
        procs = []
        for proc in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs += [*proc.children(recursive=True), proc]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(procs, timeout=30)

    def on_sigquit(self) -> Callable[[int, Any], None]:
        """A SIGQUIT handler (SGLang's processes send SIGQUIT to this one when one of them fails):
        name the engine, stop every process this rank started, exit ``EXIT_ENGINE_DIED``; with
        ``recoverable`` only note it (``check`` then raises ``EngineLost``). Installed by the caller
        after the engine started (signal handlers belong to the main thread)."""

        def handler(signum: int, frame: Any) -> None:
            if self.stopping:  # a scheduler that saw its peer killed first, while we shut it down
                return
            if self.recoverable:  # the wait for the engine finds it lost (check) and the fleet restarts it
                self.quit_received = True
                if self.on_lost is not None:
                    self.on_lost()
                return
            self.exit_rank(self.report())

        return handler

    @contextlib.contextmanager
    def engine_only_shutdown(self) -> Iterator[None]:
        """Around ``sglang.Engine.shutdown()``: its blanket kill of this rank's children
        (``kill_process_tree(os.getpid(), include_parent=False)``, looked up in
        ``sglang.srt.entrypoints.engine`` when it runs) kills each process this engine started and
        their children instead; every other call of it is SGLang's own. Restored afterwards.

        From its start on, SIGQUIT no longer ends the rank: the schedulers of a TP>1 engine are killed
        one after the other, and one still running when its peer goes sends SIGQUIT from its broken
        collective (seen at the end of a TP2 engine's life: the rank exited ``EXIT_ENGINE_DIED``)."""
        self.stopping = True
        engine_module: Any = sys.modules.get("sglang.srt.entrypoints.engine")
        original = getattr(engine_module, "kill_process_tree", None)
        if original is None:  # not this SGLang's shutdown: nothing to narrow
            yield
            return
        procs = list(self.procs)

        def engine_only(parent_pid: Any, include_parent: bool = True, *args: Any, **kwargs: Any) -> Any:
            if parent_pid in (None, os.getpid()) and not include_parent:
                for proc in procs:
                    original(proc.pid, True, *args, **kwargs)
                return None
            return original(parent_pid, include_parent, *args, **kwargs)

        engine_module.kill_process_tree = engine_only
        try:
            yield
        finally:
            engine_module.kill_process_tree = original

    def take_back_signals(self, engine: Any, saved: SignalState) -> None:
        """After the engine started, in the main thread: SGLang's tokenizer manager puts its own
        SIGTERM and SIGQUIT handlers on its asyncio loop at its first request, replacing the
        trainer's (the save-on-signal handler and its wakeup pipe, ``distributed/preemption.py``).
        Have it make its loop now, take both signals off the loop, put the trainer's handlers and
        wakeup fd back (``saved``, from before the engine started), and let SIGQUIT (what SGLang's
        processes and watchdog send when one fails) name the engine and end the rank."""
        manager: Any = getattr(engine, "tokenizer_manager", None)
        loop: Any = getattr(engine, "loop", None)
        if callable(getattr(manager, "auto_create_handle_loop", None)) and loop is not None:

            async def make_handle_loop() -> list[bool]:  # on the engine's own loop, as its requests do
                manager.auto_create_handle_loop()
                # While the loop runs: uvloop's (SGLang's loop) removes nothing otherwise (it returns
                # False and keeps the handler, whose SIGTERM ends the rank with exit 0 mid-request).
                return [loop.remove_signal_handler(s) for s in (signal.SIGTERM, signal.SIGQUIT)]

            self.loop_handlers_removed = loop.run_until_complete(make_handle_loop())
        saved.restore()
        signal.signal(signal.SIGQUIT, self.on_sigquit())


class SignalState:
    """The trainer's SIGTERM handler and signal wakeup fd, taken before an engine starts (main
    thread only), to be put back after SGLang replaced them."""

    def __init__(self) -> None:
        self.sigterm = signal.getsignal(signal.SIGTERM)
        self.wakeup_fd = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(self.wakeup_fd)

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self.sigterm)
        signal.set_wakeup_fd(self.wakeup_fd)


def _name(proc: psutil.Process) -> str:
    """SGLang names its processes with setproctitle (``sglang::scheduler_TP0``): the full title is
    the command line; ``name()`` is the kernel's 15 characters of it."""
    try:
        return (proc.cmdline() or [proc.name()])[0].split()[0]
    except (psutil.NoSuchProcess, psutil.AccessDenied, IndexError):
        return "of the engine"


def tail(path: Path, lines: int = LOG_LINES) -> str:
    """The last ``lines`` lines of the engine's log at ``path``, indented (``rollout.engine.log_tail``)."""
    return log_tail(path, lines, indent="  ")
