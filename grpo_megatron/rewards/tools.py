"""Tools that a multi-turn episode may call (rollout/multiturn.py), run in sandboxed workers.

A tool is a module-level function ``fn(argument: str) -> str``: a built-in by name (``BUILTIN_TOOLS``)
or user code by ``package.module:function``. Like reward code, tool code is imported and run only
in worker processes that first enter the reward sandbox (sandbox.py: own session, scrubbed
environment, resource limits, no network, read-only file system), never in the trainer; the
model's text reaches a tool as a plain string argument and nothing is evaluated in the trainer.

The workers are rewards/workers.py's sandboxed processes (the reward pool's too): the same start,
replace-and-reap and close. A call goes to an idle worker as ``(task, tool name, argument)``; the
worker answers with one ``tool_output`` message of wire.py's bounded schema (never a pickle).

Failure accounting, per call (``ToolResult``; the episodes' ``tool/*`` metrics, rollout/multiturn.py):
a tool that raises or returns a non-string is an ``error``; one past ``timeout_s`` (a hang) is killed
with everything it started and counted as a ``timeout`` (an error too); a worker that dies or sends
anything but a well-formed ``tool_output`` is killed and replaced, its call an ``error``. A flood is
contained twice: the worker's stdout and stderr go to /dev/null, and a result longer than
``max_output_chars`` is cut in the worker (``truncated``). Every failed call still yields an output
text (``ToolResult.output``: ``error_text``), so an episode always continues.

``calculator`` is the built-in: exact rational arithmetic on integers with + - * / and parentheses,
by a recursive-descent parser with bounded length, nesting and magnitude (never ``eval``).
"""

from __future__ import annotations

import math
import multiprocessing.connection as mp_conn
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
from grpo_megatron.rewards.sandbox import SandboxPlan, set_cpu_backstop
from grpo_megatron.rewards.workers import (
    StartFailure,
    Worker,
    WorkerKind,
    WorkerPool,
    ready_connections,
    serve_in_sandbox,
)

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
        raise ValueError(
            f"a number expected at position {start}" + (f", got {text[start]!r}" if start < len(text) else "")
        )
    if i - start > _MAX_DIGITS:
        raise ValueError(f"a number past {_MAX_DIGITS} digits")
    return Fraction(int(text[start:i])), i


# -------------------------------------------------------------------------------------- worker


def resolve_tool(spec: str, field_name: str) -> Callable[..., Any]:
    """The callable of a built-in tool name or ``package.module:function`` (errors name ``field_name``)."""
    return load_reward_fn(BUILTIN_TOOLS.get(spec, spec), field_name)


def _tool_worker_main(
    conn: mp_conn.Connection, plan: SandboxPlan, tools: dict[str, str], timeout_s: float, max_chars: int
) -> None:
    """Worker loop: the sandboxed start (``serve_in_sandbox``, stdout and stderr silenced; the tools
    imported, saying which), then one call per message, answered with a ``tool_output`` frame."""

    def load(on_import: Callable[[int], None]) -> dict[str, Callable[..., Any]]:
        fns = {}
        for i, (name, spec) in enumerate(sorted(tools.items())):
            on_import(i)
            fns[name] = resolve_tool(spec, f"rollout.multiturn.tools.{name}")
        return fns

    fns = serve_in_sandbox(conn, plan, load, what="tool", silence_output=True)
    while fns is not None:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task, name, argument = msg
        set_cpu_backstop(timeout_s)
        try:
            conn.send_bytes(wire.encode(_call(fns[name], name, task, argument, max_chars)))
        except (OSError, ValueError):
            return


def _call(fn: Callable[..., Any], name: str, task: int, argument: str, max_chars: int) -> wire.ToolOutput:
    """One tool call in the worker: its output cut to ``max_chars``, or the error it raised."""
    try:
        out = fn(argument)
        if not isinstance(out, str):
            raise TypeError(f"tool {name!r} returned {type(out).__name__}, not str")
        return wire.ToolOutput(task, "ok", out[:max_chars], len(out) > max_chars, None)
    except BaseException as err:  # noqa: BLE001 - tool code must not stop the worker's protocol
        text = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=2)}"
        return wire.ToolOutput(task, "error", None, False, text[:2000])


TOOL_WORKERS = WorkerKind(_tool_worker_main, "tool", "tools", wire.TOOL_KINDS, first_slot=32)
"""Tool workers: one call at a time; slots 32 and up (scratch directories and uids of their own beside
the reward pool's workers)."""


# ---------------------------------------------------------------------------------------- pool


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome; ``output`` is what the episode's observation shows (``error_text`` on failure)."""

    status: ToolStatus
    output: str
    message: str | None = None
    truncated: bool = False


class ToolPool:
    """Runs tool calls in sandboxed workers (rewards/workers.py, with the reward pool's sandbox:
    ``reward.sandbox`` and ``reward.worker_memory_mb``); only global rank 0 holds one. ``run`` never
    raises because of tool code and returns within about ``timeout_s`` per wave of ``num_workers``
    calls."""

    def __init__(
        self,
        tools: Mapping[str, str],
        reward: RewardConfig,
        *,
        timeout_s: float,
        num_workers: int,
        max_output_chars: int,
        error_text: str = "error",
        log: Callable[[str], None] | None = print,
    ):
        if num_workers < 1:
            raise ValueError(
                f"tool workers: num_workers={num_workers} must be >= 1 (tools never run in the trainer)"
            )
        self.tools, self.reward, self.timeout_s = dict(tools), reward, timeout_s
        self.num_workers, self.max_output_chars, self.error_text = num_workers, max_output_chars, error_text
        self.workers = WorkerPool(
            reward,
            TOOL_WORKERS,
            (self.tools, timeout_s, max_output_chars),
            num_workers=num_workers,
            imports=len(self.tools),
            log=log,
        )
        try:
            self.workers.wait_ready(time.monotonic() + reward.startup_timeout_s)
        except StartFailure as failure:
            self.close()
            if failure.init_error is not None:
                raise ValueError(failure.init_error) from None
            if failure.cause == "it hangs":
                raise RuntimeError(
                    f"a tool worker did not start within reward.startup_timeout_s="
                    f"{reward.startup_timeout_s:g} s"
                ) from None
            raise RuntimeError(f"a tool worker failed to start: {failure.cause}") from None

    @property
    def restarts(self) -> int:
        return self.workers.restarts

    def _replace(self, w: Worker) -> None:
        """A fresh worker in ``w``'s slot, waited for (one that does not start stays not ready: the
        calls it would get fail)."""
        fresh = self.workers.replace(w)
        try:
            self.workers.wait_ready(time.monotonic() + self.reward.startup_timeout_s, [fresh])
        except StartFailure:
            pass
        self.workers.reap()

    def run(self, calls: Sequence[tuple[str, str]]) -> list[ToolResult]:
        """One result per ``(tool name, argument)``, in order; unknown tools are errors."""
        results: list[ToolResult | None] = [None] * len(calls)
        pending = deque(i for i, (name, _) in enumerate(calls) if name in self.tools)
        for i, (name, _) in enumerate(calls):
            if name not in self.tools:
                results[i] = ToolResult("error", self.error_text, f"no tool named {name!r}")
        workers = self.workers.workers
        while pending or any(w.tasks for w in workers):
            if not any(w.ready for w in workers):
                while pending:
                    results[pending.popleft()] = ToolResult(
                        "error", self.error_text, "tool workers failed to start"
                    )
                break
            now = time.monotonic()
            for w in list(workers):
                if w.tasks and now >= w.hard_deadline:
                    results[w.tasks[0]] = ToolResult(
                        "timeout", self.error_text, f"call exceeded {self.timeout_s:g} s"
                    )
                    self._replace(w)
            for w in list(workers):
                if pending and w.ready and not w.tasks:
                    i = pending.popleft()
                    w.conn.send((i, *calls[i]))
                    w.tasks.append(i)
                    w.sent_at = time.monotonic()
                    w.hard_deadline = w.sent_at + self.timeout_s
            busy = {w.conn: w for w in workers if w.tasks}
            wait_s = max(0.0, min([w.hard_deadline for w in busy.values()], default=now) - time.monotonic())
            for conn in ready_connections(list(busy), wait_s):
                self._receive(busy[conn], results)
        return [r if r is not None else ToolResult("error", self.error_text, "not run") for r in results]

    def _receive(self, w: Worker, results: list[ToolResult | None]) -> None:
        task = w.tasks[0]
        try:
            msg = self.workers.receive(w)
            if not isinstance(msg, wire.ToolOutput) or msg.task != task:
                raise wire.ProtocolError("a message out of turn")
        except (EOFError, OSError, wire.ProtocolError) as err:
            results[task] = ToolResult("error", self.error_text, f"tool worker died or misbehaved: {err}")
            self._replace(w)
            return
        if msg.status == "ok" and msg.output is not None:
            results[task] = ToolResult("ok", msg.output, None, msg.truncated)
        else:
            results[task] = ToolResult("error", self.error_text, msg.message)
        w.tasks.clear()
        w.hard_deadline = math.inf

    def close(self) -> None:
        self.workers.close()


def tool_metrics(results: Sequence[ToolResult]) -> dict[str, float]:
    """``tool/calls``, ``tool/errors`` (raised, bad output, died, unknown tool or timed out),
    ``tool/timeouts`` and ``tool/truncated`` (outputs cut to max_output_chars): counts."""
    return {
        "tool/calls": float(len(results)),
        "tool/errors": float(sum(r.status != "ok" for r in results)),
        "tool/timeouts": float(sum(r.status == "timeout" for r in results)),
        "tool/truncated": float(sum(r.truncated for r in results)),
    }
