"""Tools that a multi-turn episode may call (rollout/multiturn.py), run in sandboxed workers.

A tool is a module-level function ``fn(argument: str) -> str``: a built-in by name (``BUILTIN_TOOLS``)
or user code by ``package.module:function``. Like reward code, tool code is imported and run only
in worker processes that first enter the reward sandbox (sandbox.py: own session, scrubbed
environment, resource limits, no network, read-only file system), never in the trainer; the
model's text reaches a tool as a plain string argument and nothing is evaluated in the trainer.

Failure accounting, per ``ToolPool.run`` call (the ``tool/*`` metrics): a tool that raises or
returns a non-string is an ``error``; one past ``timeout_s`` (a hang) is killed with everything it
started and counted as a ``timeout``; a worker that dies or sends anything but a well-formed frame
(wire.py's bounded JSON frames, never a pickle) is killed and replaced, its call an ``error``. A
flood is contained twice: the worker's stdout and stderr go to /dev/null, and a result longer than
``max_output_chars`` is cut in the worker (``truncated`` counts them). Every failed call still
yields an output text (``ToolResult.output``: ``error_text``), so an episode always continues.

``calculator`` is the built-in: exact rational arithmetic on integers with + - * / and parentheses,
by a recursive-descent parser with bounded length, nesting and magnitude (never ``eval``).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import multiprocessing.connection as mp_conn
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from grpo_megatron.rewards import wire
from grpo_megatron.rewards.config import RewardConfig
from grpo_megatron.rewards.loader import load_reward_fn
from grpo_megatron.rewards.sandbox import SandboxPlan, enter_sandbox, kill_worker, set_cpu_backstop

__all__ = ["BUILTIN_TOOLS", "ToolResult", "ToolPool", "calculator", "tool_metrics"]

BUILTIN_TOOLS: dict[str, str] = {"calculator": "grpo_megatron.rewards.tools:calculator"}

ToolStatus = Literal["ok", "error", "timeout"]

# ---------------------------------------------------------------------------------- calculator

_MAX_EXPRESSION_CHARS = 200
_MAX_DEPTH = 32
_MAX_DIGITS = 60  # |numerator| and denominator of every intermediate value


def calculator(expression: str) -> str:
    """The exact value of an integer expression with ``+ - * /``, unary minus and parentheses: an
    integer, or a reduced fraction ``p/q``. Raises ValueError for anything else (letters, ``**``,
    division by zero, more than 200 characters, 32 levels of nesting, or values past 60 digits)."""
    text = expression.replace(" ", "")
    if not text or len(text) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"an expression of 1 to {_MAX_EXPRESSION_CHARS} characters is expected")
    value, end = _sum(text, 0, 0)
    if end != len(text):
        raise ValueError(f"unexpected {text[end]!r} at position {end}")
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _bounded(value: Fraction) -> Fraction:
    if max(abs(value.numerator), value.denominator) >= 10**_MAX_DIGITS:
        raise ValueError(f"a value past {_MAX_DIGITS} digits")
    return value


def _sum(text: str, i: int, depth: int) -> tuple[Fraction, int]:
    value, i = _product(text, i, depth)
    while i < len(text) and text[i] in "+-":
        op = text[i]
        rhs, i = _product(text, i + 1, depth)
        value = _bounded(value + rhs if op == "+" else value - rhs)
    return value, i


def _product(text: str, i: int, depth: int) -> tuple[Fraction, int]:
    value, i = _unary(text, i, depth)
    while i < len(text) and text[i] in "*/":
        op = text[i]
        rhs, i = _unary(text, i + 1, depth)
        if op == "/" and rhs == 0:
            raise ValueError("division by zero")
        value = _bounded(value * rhs if op == "*" else value / rhs)
    return value, i


def _unary(text: str, i: int, depth: int) -> tuple[Fraction, int]:
    if depth > _MAX_DEPTH:
        raise ValueError(f"more than {_MAX_DEPTH} levels of nesting")
    if i < len(text) and text[i] == "-":
        value, i = _unary(text, i + 1, depth + 1)
        return -value, i
    if i < len(text) and text[i] == "(":
        value, i = _sum(text, i + 1, depth + 1)
        if i >= len(text) or text[i] != ")":
            raise ValueError("a '(' without its ')'")
        return value, i + 1
    start = i
    while i < len(text) and text[i] in "0123456789":
        i += 1
    if i == start:
        raise ValueError(f"a number expected at position {start}" + (f", got {text[start]!r}" if start < len(text) else ""))
    if i - start > _MAX_DIGITS:
        raise ValueError(f"a number past {_MAX_DIGITS} digits")
    return Fraction(int(text[start:i])), i


# -------------------------------------------------------------------------------------- worker


def resolve_tool(spec: str, field_name: str) -> Callable[..., Any]:
    """The callable of a built-in tool name or ``package.module:function`` (errors name ``field_name``)."""
    return load_reward_fn(BUILTIN_TOOLS.get(spec, spec), field_name)


def _say(conn: mp_conn.Connection, obj: dict[str, Any] | wire.Message) -> None:
    data = json.dumps(obj, ensure_ascii=True).encode("ascii") if isinstance(obj, dict) else wire.encode(obj)
    conn.send_bytes(data)


def _tool_worker_main(
    conn: mp_conn.Connection, tools: dict[str, str], plan: SandboxPlan, timeout_s: float, max_chars: int
) -> None:
    """Worker loop: silence stdout/stderr, enter the sandbox, import the tools, say ready, then run
    one call per message and reply with a ``tool_output`` frame."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        report = enter_sandbox(plan)
        fns = {}
        for i, (name, spec) in enumerate(sorted(tools.items())):
            _say(conn, wire.Importing(i))
            fns[name] = resolve_tool(spec, f"rollout.multiturn.tools.{name}")
    except BaseException as err:  # noqa: BLE001 - any failure must reach the parent as a message
        _say(conn, wire.InitError(f"tool worker start-up failed: {type(err).__name__}: {err}"))
        return
    _say(conn, wire.Ready(report.scratch, list(report.active), list(report.inactive)))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task, name, argument = msg
        set_cpu_backstop(timeout_s)
        reply: dict[str, Any] = {"kind": "tool_output", "task": task, "status": "ok", "output": None,
                                 "truncated": False, "message": None}
        try:
            out = fns[name](argument)
            if not isinstance(out, str):
                raise TypeError(f"tool {name!r} returned {type(out).__name__}, not str")
            reply.update(output=out[:max_chars], truncated=len(out) > max_chars)
        except BaseException as err:  # noqa: BLE001 - tool code must not stop the worker's protocol
            text = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=2)}"
            reply.update(status="error", message=text[:2000])
        try:
            _say(conn, reply)
        except (OSError, ValueError):
            return


def _decode(data: bytes) -> wire.Message | dict[str, Any]:
    """A worker's frame: a start-up message (wire.py's schema) or a checked ``tool_output`` object."""
    try:
        obj = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise wire.ProtocolError("not a JSON message") from None
    if type(obj) is not dict or obj.get("kind") != "tool_output":
        return wire.decode(data, frozenset())
    if set(obj) != {"kind", "task", "status", "output", "truncated", "message"}:
        raise wire.ProtocolError("a tool_output message with other keys")
    if type(obj["task"]) is not int or obj["status"] not in ("ok", "error") or type(obj["truncated"]) is not bool:
        raise wire.ProtocolError("a malformed tool_output message")
    for key in ("output", "message"):
        if obj[key] is not None and (type(obj[key]) is not str or len(obj[key]) > wire.MAX_TEXT_CHARS):
            raise wire.ProtocolError(f"tool_output {key} is not a string of at most {wire.MAX_TEXT_CHARS} characters")
    if obj["status"] == "ok" and obj["output"] is None:
        raise wire.ProtocolError("an ok tool_output without output")
    return obj


# ---------------------------------------------------------------------------------------- pool


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome; ``output`` is what the episode's observation shows (``error_text`` on failure)."""

    status: ToolStatus
    output: str
    message: str | None = None
    truncated: bool = False


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: mp_conn.Connection
    slot: int
    ready: bool = False
    task: int | None = None
    deadline: float = math.inf


def _kill(w: _Worker) -> None:
    kill_worker(w.process, w.conn)


class ToolPool:
    """Runs tool calls in sandboxed workers (the reward pool's sandbox, ``reward.sandbox`` and
    ``reward.worker_memory_mb``); only global rank 0 holds one. ``run`` never raises because of tool
    code and returns within about ``timeout_s`` per wave of ``num_workers`` calls."""

    def __init__(self, tools: Mapping[str, str], reward: RewardConfig, *, timeout_s: float, num_workers: int,
                 max_output_chars: int, error_text: str = "error", log: Callable[[str], None] | None = print):
        if num_workers < 1:
            raise ValueError(f"tool workers: num_workers={num_workers} must be >= 1 (tools never run in the trainer)")
        self.tools, self.reward, self.timeout_s = dict(tools), reward, timeout_s
        self.num_workers, self.max_output_chars, self.error_text = num_workers, max_output_chars, error_text
        self.restarts = 0
        self._ctx: mp.context.SpawnContext | mp.context.ForkServerContext = (
            mp.get_context("spawn") if reward.mp_context == "spawn" else mp.get_context("forkserver")
        )
        self._scratch = tempfile.mkdtemp(prefix="grpo-tools-", dir=reward.sandbox.scratch_dir)
        os.chmod(self._scratch, 0o711)
        self._workers = [self._spawn(slot) for slot in range(num_workers)]
        self._wait_ready(reward.startup_timeout_s, log)

    def _spawn(self, slot: int) -> _Worker:
        sb = self.reward.sandbox
        plan = SandboxPlan(scratch_root=self._scratch, slot=32 + slot, trainer_pid=os.getpid(), isolate=sb.isolate,
                           allow_network=sb.allow_network, memory_mb=self.reward.worker_memory_mb,
                           file_mb=sb.max_file_mb, max_processes=sb.max_processes,
                           max_open_files=sb.max_open_files, keep_env=tuple(sb.keep_env))
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_tool_worker_main, daemon=True, name="grpo-tool-worker",
                                 args=(child, self.tools, plan, self.timeout_s, self.max_output_chars))
        proc.start()
        child.close()
        return _Worker(proc, parent, slot)

    def _wait_ready(self, timeout_s: float, log: Callable[[str], None] | None) -> None:
        deadline = time.monotonic() + timeout_s
        for w in self._workers:
            while not w.ready:
                if not w.conn.poll(max(0.0, deadline - time.monotonic())):
                    self.close()
                    raise RuntimeError(f"a tool worker did not start within reward.startup_timeout_s={timeout_s:g} s")
                try:
                    msg = _decode(wire.read_frame(w.conn.fileno()))
                except (EOFError, OSError, wire.ProtocolError) as err:
                    self.close()
                    raise RuntimeError(f"a tool worker failed to start: {err}") from None
                if isinstance(msg, wire.InitError):
                    self.close()
                    raise ValueError(msg.message)
                if isinstance(msg, wire.Ready):
                    w.ready = True
                    if log is not None and w.slot == 0:
                        off = "; NOT active: " + ", ".join(msg.inactive) if msg.inactive else ""
                        log("[tools] sandbox: " + ", ".join(msg.active) + off)

    def _replace(self, w: _Worker) -> None:
        _kill(w)
        fresh = self._spawn(w.slot)
        self._workers[self._workers.index(w)] = fresh
        self._wait_one(fresh)
        self.restarts += 1

    def _wait_one(self, w: _Worker) -> None:
        deadline = time.monotonic() + self.reward.startup_timeout_s
        while not w.ready and w.conn.poll(max(0.0, deadline - time.monotonic())):
            try:
                msg = _decode(wire.read_frame(w.conn.fileno()))
            except (EOFError, OSError, wire.ProtocolError):
                return  # it stays not ready: run() gives its calls an error
            if isinstance(msg, wire.InitError):
                return
            w.ready = isinstance(msg, wire.Ready)

    def run(self, calls: Sequence[tuple[str, str]]) -> list[ToolResult]:
        """One result per ``(tool name, argument)``, in order; unknown tools are errors."""
        results: list[ToolResult | None] = [None] * len(calls)
        pending = deque(i for i, (name, _) in enumerate(calls) if name in self.tools)
        for i, (name, _) in enumerate(calls):
            if name not in self.tools:
                results[i] = ToolResult("error", self.error_text, f"no tool named {name!r}")
        while pending or any(w.task is not None for w in self._workers):
            if not any(w.ready for w in self._workers):
                while pending:
                    results[pending.popleft()] = ToolResult("error", self.error_text, "tool workers failed to start")
                break
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now >= w.deadline:
                    results[w.task] = ToolResult("timeout", self.error_text, f"call exceeded {self.timeout_s:g} s")
                    self._replace(w)
            for w in list(self._workers):
                if pending and w.ready and w.task is None:
                    i = pending.popleft()
                    w.conn.send((i, *calls[i]))
                    w.task, w.deadline = i, time.monotonic() + self.timeout_s
            busy = {w.conn: w for w in self._workers if w.task is not None}
            wait_s = max(0.0, min([w.deadline for w in busy.values()], default=now) - time.monotonic())
            for conn in mp_conn.wait(list(busy), timeout=wait_s):
                self._receive(busy[conn], results)  # type: ignore[index]
        return [r if r is not None else ToolResult("error", self.error_text, "not run") for r in results]

    def _receive(self, w: _Worker, results: list[ToolResult | None]) -> None:
        assert w.task is not None
        try:
            msg = _decode(wire.read_frame(w.conn.fileno()))
            if not isinstance(msg, dict) or msg["task"] != w.task:
                raise wire.ProtocolError("a message out of turn")
        except (EOFError, OSError, wire.ProtocolError) as err:
            results[w.task] = ToolResult("error", self.error_text, f"tool worker died or misbehaved: {err}")
            self._replace(w)
            return
        if msg["status"] == "ok":
            results[w.task] = ToolResult("ok", msg["output"], None, msg["truncated"])
        else:
            results[w.task] = ToolResult("error", self.error_text, msg["message"])
        w.task, w.deadline = None, math.inf

    def close(self) -> None:
        for w in self._workers:
            _kill(w)
        self._workers = []
        shutil.rmtree(self._scratch, ignore_errors=True)


def tool_metrics(results: Sequence[ToolResult]) -> dict[str, float]:
    """``tool/calls``, ``tool/errors`` (raised, bad output, died, unknown tool or timed out),
    ``tool/timeouts`` and ``tool/truncated`` (outputs cut to max_output_chars): counts."""
    return {
        "tool/calls": float(len(results)),
        "tool/errors": float(sum(r.status != "ok" for r in results)),
        "tool/timeouts": float(sum(r.status == "timeout" for r in results)),
        "tool/truncated": float(sum(r.truncated for r in results)),
    }
