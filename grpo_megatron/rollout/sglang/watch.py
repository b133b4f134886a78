"""How a wait on a colocated SGLang engine is watched: its servers behind one guard, and a probe of its
schedulers while a generation is awaited.

``sglang.Engine`` drives its requests on one asyncio loop, which one thread may run at a time, and a
batch submitted ahead must finish under the weights it was submitted with: ``ServerGuard`` makes the
engine's servers reachable only through itself, after the one generation that may run in a thread of
the rank (``SGLangEngine.submit``; its work is done by SGLang's scheduler processes). Every wait for
that generation is watched: a dead or stopped process of the engine (``health.py``), or schedulers
alive but silent (``SchedulerProbe``: a state request unanswered past
``rollout.recovery.health_timeout_s``: a hung scheduler), end the wait with ``EngineLost`` after the
generation's requests are cancelled on the engine's loop (``cancel_requests``); a lost engine's
generation thread is abandoned (``ServerGuard.abandon``, ``stop_loops``) and what is left of it stopped
(``stop_lost_part``) before it restarts.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from grpo_megatron.rollout.sglang.health import EngineProcesses

T = TypeVar("T")

WATCH_S = 0.5
"""How often a wait for the generation in flight looks at the engine's processes (``ServerGuard``)."""
ABORT_S = 10.0
"""How long a lost engine's generation thread is given to end once its requests are cancelled."""
CANCELLED = (asyncio.CancelledError, concurrent.futures.CancelledError)


class ServerGuard:
    """The engine's servers, reachable only through here, and the one generation that may run in a
    thread of this rank meanwhile (``SGLangEngine.submit``; its work is done by SGLang's scheduler
    processes). ``sglang.Engine`` drives its requests on one asyncio loop, which one thread may run at
    a time, and a submitted batch must finish under the weights it was submitted with: so
    ``with guard as servers:`` first waits for that generation, whatever the call (weights, scores,
    memory, health, shutdown). ``start(work)`` runs ``work(servers)`` as the generation in flight.

    Every wait for that generation looks at the engine every ``WATCH_S`` (``watch``: raises when the
    engine is lost, e.g. a scheduler killed or stopped, whose requests would never answer); the wait
    then cancels the generation (``cancel(servers)``: its requests on the engine's loop), gives its
    thread ``ABORT_S`` to end, and raises what ``watch`` raised. ``probe()``, where given, makes each
    wait's ``SchedulerProbe``: the engine alive but not answering (a hung scheduler) is lost too."""

    def __init__(
        self,
        servers: Sequence[Any],
        *,
        watch: Callable[[], None] | None = None,
        cancel: Callable[[list[Any]], None] | None = None,
        probe: Callable[[], SchedulerProbe] | None = None,
    ) -> None:
        self._servers = list(servers)
        self._pool: ThreadPoolExecutor | None = None
        self._running: Future[Any] | None = None
        self._watch = watch
        self._cancel = cancel
        self._probe = probe

    def __enter__(self) -> list[Any]:
        self._settle()
        return self._servers

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        # A call blocked on a lost engine (``cancel``, from the SIGQUIT of SGLang's watchdog) ends with
        # CancelledError: ``watch`` names the loss instead.
        if kind is not None and issubclass(kind, CANCELLED) and self._watch is not None:
            self._watch()

    @property
    def servers(self) -> list[Any]:
        """The servers, for a call from another thread that must not wait (``SGLangEngine.interrupt``)."""
        return list(self._servers)

    def cancel(self) -> None:
        """Cancel whatever waits on the servers now (a lost engine's: ``health.on_lost``), from a
        signal handler or another thread."""
        if self._cancel is not None:
            self._cancel(self._servers)

    def start(self, work: Callable[[list[Any]], T]) -> Future[T]:
        """Run ``work(servers)`` in the generation thread once the one before it is done; its error is
        its caller's, at ``result()``."""
        self._settle()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sglang-generate")
        running = self._pool.submit(work, self._servers)
        self._running = running
        return running

    def result(self, future: Future[T]) -> T:
        """``future``'s result (a generation ``start`` began), waited for under ``watch``."""
        self._wait(future)
        try:
            return future.result()
        except CANCELLED:
            if self._watch is not None:
                self._watch()  # the engine was lost: named (EngineLost)
            raise

    def close(self) -> list[Any]:
        """Wait for the generation in flight, stop the thread; the servers, handed over (the guard
        holds none afterwards)."""
        self._settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        servers, self._servers = self._servers, []
        return servers

    def abandon(self) -> list[Any]:
        """A lost engine's servers, handed over without waiting on them: the generation in flight is
        cancelled and given ``ABORT_S``; a thread still on the servers' event loop after that has the
        loop stopped under it (``stop_loops``: its ``run_until_complete`` returns) and ``ABORT_S``
        more. The thread is joined once it ended (bounded: a thread stuck outside the loop, which
        Python cannot end, is named and left behind); the loop is then the caller's to close
        (``close_loop``, after the shutdown)."""
        ended = self._abort()
        if not ended and self._running is not None:
            stop_loops(self._servers)
            ended = not wait([self._running], timeout=ABORT_S).not_done
        if self._pool is not None:
            self._pool.shutdown(wait=ended, cancel_futures=True)
            self._pool = None
        if not ended:
            print("[engine] the lost SGLang engine's generation thread did not end; left behind", flush=True)
        self._running = None
        servers, self._servers = self._servers, []
        return servers

    def _settle(self) -> None:
        if self._running is not None:
            self._wait(self._running)
            self._running = None

    def _wait(self, future: Future[Any]) -> None:
        probe = self._probe() if self._probe is not None else None
        while wait([future], timeout=WATCH_S).not_done:
            if self._watch is None:
                continue
            try:
                self._watch()
                if probe is not None:
                    probe.poll(self._servers)
            except BaseException:
                self._abort()
                raise

    def _abort(self) -> bool:
        """Cancel the generation in flight; whether its thread ended within ``ABORT_S``."""
        running = self._running
        if running is None or running.done():
            return True
        if self._cancel is not None:
            self._cancel(self._servers)
        return not wait([running], timeout=ABORT_S).not_done


class SchedulerProbe:
    """Whether an in-process engine's schedulers still answer, while one wait for its generation lasts
    (issue 41: a scheduler alive but hung, neither dead nor stopped, answers nothing and SGLang's
    tokenizer manager awaits it with no deadline). Every ``every_s`` of the wait it sends one state
    request (``TokenizerManager.get_internal_state``: a ``GetInternalStateReq`` the scheduler answers
    from its event loop between two batches, so a healthy one answers within one forward step, whatever
    the generation's length); one unanswered for ``deadline_s`` (``rollout.recovery.health_timeout_s``)
    is the engine lost: ``fail(why)`` is raised. One request at a time, never cancelled (SGLang's
    communicator serializes them: a late answer completes its own request); a request left unanswered
    when the wait ends is answered on the loop's next run, and the next wait starts its own count."""

    def __init__(self, deadline_s: float, fail: Callable[[str], BaseException], every_s: float | None = None):
        self.deadline_s = deadline_s
        self.every_s = min(deadline_s / 8, 10.0) if every_s is None else every_s
        self._fail = fail
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._sent = time.monotonic()
        """When the request in flight (or the last one) was sent; the wait's start before the first."""

    def poll(self, servers: Sequence[Any]) -> None:
        """Look at the request in flight (raise if it is past the deadline), or send the next one."""
        now = time.monotonic()
        if self._pending and not all(f.done() for f in self._pending):
            if now - self._sent >= self.deadline_s:
                raise self._fail(
                    f"its scheduler, alive, left a state request unanswered for {now - self._sent:.1f} s, past "
                    f"rollout.recovery.health_timeout_s={self.deadline_s:g} (hung)"
                )
            return
        if now - self._sent >= self.every_s:
            self._pending, self._sent = ask_state(servers), now


def cancel_requests(servers: Sequence[Any]) -> None:
    """Cancel every task on each in-process server's event loop (``sglang.Engine.loop``), from any
    thread: a generation waiting on a lost scheduler (its tokenizer manager awaits an answer with no
    deadline) then ends with ``CancelledError`` in its thread."""
    for server in servers:
        loop = getattr(server, "loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_cancel_tasks, loop)


def abort_requests(servers: Sequence[Any]) -> None:
    """Abort every request of each in-process server, from any thread: ``TokenizerManager.abort_request(
    abort_all=True)`` on the server's event loop (0.5.17 and 0.5.23); the aborted requests' outputs so
    far come back to their callers with ``finish_reason`` abort and no status code (a normal end)."""
    for server in servers:
        loop, manager = getattr(server, "loop", None), getattr(server, "tokenizer_manager", None)
        abort = getattr(manager, "abort_request", None)
        if isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_closed() and callable(abort):
            loop.call_soon_threadsafe(functools.partial(abort, abort_all=True))


def ask_state(servers: Sequence[Any]) -> list[concurrent.futures.Future[Any]]:
    """A state request to each in-process server's schedulers (``SchedulerProbe``), on the server's event
    loop from this thread: ``TokenizerManager.get_internal_state`` (0.5.17 and 0.5.23:
    ``managers/tokenizer_control_mixin.py``), the request ``Engine.get_server_info`` makes. Servers
    without a loop (HTTP clients) are not asked."""
    futures = []
    for server in servers:
        loop, manager = getattr(server, "loop", None), getattr(server, "tokenizer_manager", None)
        ask = getattr(manager, "get_internal_state", None)
        if isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_closed() and callable(ask):
            futures.append(asyncio.run_coroutine_threadsafe(ask(), loop))
    return futures


def _cancel_tasks(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


def stop_loops(servers: Sequence[Any]) -> None:
    """Stop each in-process server's event loop from any thread (``ServerGuard.abandon``): a thread
    running it returns from ``run_until_complete`` with RuntimeError."""
    for server in servers:
        loop = getattr(server, "loop", None)
        if isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)


def close_loop(server: Any) -> None:
    """A shut-down in-process server's event loop, closed: its tasks (the tokenizer manager's
    receivers) cancelled and given a second to end. Skipped while a generation thread left behind
    still runs it (``ServerGuard.abandon``)."""
    loop = getattr(server, "loop", None)
    if not isinstance(loop, asyncio.AbstractEventLoop) or loop.is_running() or loop.is_closed():
        return
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        with contextlib.suppress(RuntimeError):  # a stop left pending by stop_loops ends this run early
            loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
    loop.close()


def stop_lost_part(server: Any, health: EngineProcesses, life: int) -> None:
    """A lost engine part (a leader's engine, or a further node's part of one across nodes) stopped
    before it starts again in this process: shut down (its own processes only; ``sglang.Engine``'s
    at-exit shutdown, which kills every child of the rank, taken back), what is left of its processes
    SIGKILLed (a stopped one too), its event loop closed and a fresh one made current (SGLang's Engine
    takes the thread's current loop), and its log given a header for life ``life``."""
    atexit.unregister(server.shutdown)
    try:
        with health.engine_only_shutdown():
            server.shutdown()
    except Exception as exc:  # a half-dead engine: what is left is killed below
        print(
            f"[engine] shutting the lost SGLang engine of rank {health.rank} down: {type(exc).__name__}: {exc}",
            flush=True,
        )
    health.kill_all()
    close_loop(server)
    asyncio.set_event_loop(asyncio.new_event_loop())
    with open(health.log_path, "a") as log:  # this process's file again: each life under a header
        log.write(f"--- SGLang engine of rank {health.rank}, life {life} (restarted in place) ---\n")
