"""What a sandboxed worker (a reward or a tool worker, rewards/workers.py) may say to the trainer: bytes in
a fixed schema, never a pickle.

Reward or tool code, and a module's import-time code, runs in the worker and can reach the worker's
end of the pipe. If the trainer unpickled what arrives there, such code could send an object whose
``__reduce__`` runs in the trainer. So every message from a worker is one frame -- multiprocessing's
framing: a 4-byte big-endian length, then that many bytes -- holding a JSON object that
``decode`` checks against the schema below (key set, types, string and list lengths) before the
trainer looks at it. ``read_frame`` reads a frame with a deadline and a size bound, so a worker that
sends a partial, oversized or endless frame cannot stall the trainer. Whatever does not decode is a
``ProtocolError``: the pool kills that worker (its sample falls back) and starts a replacement.

Messages (``kind`` and the other keys, all required):

  importing   index: int (the component being imported; increases)
  init_error  message: str
  ready       scratch: str, active: [str], inactive: [str] (the sandbox report)
  result      task: int, status: "ok" | "error" | "invalid", reward: float | null,
              components: {str: float} | null, message: str | null, component: str | null
  results     results: [result without "kind"] (1 to MAX_ITEMS of them: the samples of a chunk
              scored since the worker's last message, in the order they were handed over)
  tool_output task: int, status: "ok" | "error", output: str | null (null only on error),
              truncated: bool (the tool's text was cut to the pool's limit), message: str | null

A reward worker may send the first five, a tool worker the first three and ``tool_output``
(``decode``'s ``kinds``).

The trainer's messages to a worker (chunks of samples) stay pickles: the trainer is the trusted side.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_TEXT_CHARS",
    "FRAME_TIMEOUT_S",
    "ProtocolError",
    "Importing",
    "InitError",
    "Ready",
    "Result",
    "Results",
    "ToolOutput",
    "Message",
    "REWARD_KINDS",
    "TOOL_KINDS",
    "encode",
    "decode",
    "read_frame",
]

MAX_FRAME_BYTES = 64 << 10
"""The largest frame a worker may send (its longest legitimate one is an error text of a few KiB)."""
MAX_TEXT_CHARS = 4096
"""The longest string in a message (error texts are cut to 2000 characters before sending)."""
MAX_ITEMS = 256
"""The most entries in a list or in the component scores of one message."""
FRAME_TIMEOUT_S = 2.0
"""How long the rest of a frame may take once its first byte arrived."""

_HEADER = struct.Struct("!i")


class ProtocolError(ValueError):
    """A worker sent something that is not a well-formed message (the text says what)."""


@dataclass(frozen=True)
class Importing:
    index: int


@dataclass(frozen=True)
class InitError:
    message: str


@dataclass(frozen=True)
class Ready:
    scratch: str
    active: list[str]
    inactive: list[str]


@dataclass(frozen=True)
class Result:
    task: int
    status: Literal["ok", "error", "invalid"]
    reward: float | None
    components: dict[str, float] | None
    message: str | None
    component: str | None


@dataclass(frozen=True)
class Results:
    """Several samples' results in one frame (a chunk's, or the part of it scored so far)."""

    results: tuple[Result, ...]


@dataclass(frozen=True)
class ToolOutput:
    """One tool call's outcome (rewards/tools.py): ``output`` is the tool's text, at most the pool's
    ``max_output_chars`` (``truncated`` when it was longer); on an error ``message`` says why."""

    task: int
    status: Literal["ok", "error"]
    output: str | None
    truncated: bool
    message: str | None


Message = Importing | InitError | Ready | Result | Results | ToolOutput

_KEYS: dict[str, frozenset[str]] = {
    "importing": frozenset({"kind", "index"}),
    "init_error": frozenset({"kind", "message"}),
    "ready": frozenset({"kind", "scratch", "active", "inactive"}),
    "result": frozenset({"kind", "task", "status", "reward", "components", "message", "component"}),
    "results": frozenset({"kind", "results"}),
    "tool_output": frozenset({"kind", "task", "status", "output", "truncated", "message"}),
}
REWARD_KINDS = frozenset({"importing", "init_error", "ready", "result", "results"})
"""What a reward worker may send."""
TOOL_KINDS = frozenset({"importing", "init_error", "ready", "tool_output"})
"""What a tool worker may send."""
_RESULT_KEYS = _KEYS["result"] - {"kind"}


def result_fields(result: Result) -> dict[str, Any]:
    """One result as the JSON object inside a "results" message (also sized by the worker to keep
    its frames under MAX_FRAME_BYTES)."""
    message = None if result.message is None else result.message[:MAX_TEXT_CHARS]
    return {
        "task": result.task,
        "status": result.status,
        "reward": result.reward,
        "components": result.components,
        "component": result.component,
        "message": message,
    }


def encode_results(fields: list[dict[str, Any]]) -> bytes:
    """The JSON bytes of a "results" message of ``result_fields`` objects (the worker side)."""
    return json.dumps({"kind": "results", "results": fields}, ensure_ascii=True).encode("ascii")


def encode(message: Message) -> bytes:
    """The JSON bytes of ``message`` (the worker side; strings are cut to MAX_TEXT_CHARS)."""
    if isinstance(message, Importing):
        obj: dict[str, Any] = {"kind": "importing", "index": message.index}
    elif isinstance(message, InitError):
        obj = {"kind": "init_error", "message": message.message[:MAX_TEXT_CHARS]}
    elif isinstance(message, Ready):
        obj = {
            "kind": "ready",
            "scratch": message.scratch,
            "active": message.active,
            "inactive": message.inactive,
        }
    elif isinstance(message, Results):
        return encode_results([result_fields(r) for r in message.results])
    elif isinstance(message, ToolOutput):
        text = None if message.message is None else message.message[:MAX_TEXT_CHARS]
        obj = {
            "kind": "tool_output",
            "task": message.task,
            "status": message.status,
            "truncated": message.truncated,
            "output": message.output,
            "message": text,
        }
    else:
        obj = {"kind": "result", **result_fields(message)}
    return json.dumps(obj, ensure_ascii=True).encode("ascii")


def _int(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value < 2**31:
        raise ProtocolError(f"{what} is not a small non-negative integer")
    return value


def _text(value: object, what: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if type(value) is not str or len(value) > MAX_TEXT_CHARS:
        raise ProtocolError(f"{what} is not a string of at most {MAX_TEXT_CHARS} characters")
    return value


def _float(value: object, what: str) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float):  # bool is not accepted: type() is exact
        raise ProtocolError(f"{what} is not a number")
    return float(value)  # type: ignore[arg-type]


def _texts(value: object, what: str) -> list[str]:
    if type(value) is not list or len(value) > MAX_ITEMS:
        raise ProtocolError(f"{what} is not a list of at most {MAX_ITEMS} strings")
    return [_text(v, what) for v in value]


def _scores(value: object, names: frozenset[str]) -> dict[str, float] | None:
    if value is None:
        return None
    if type(value) is not dict or len(value) > MAX_ITEMS:
        raise ProtocolError(f"components is not an object of at most {MAX_ITEMS} scores")
    out: dict[str, float] = {}
    for key, score in value.items():
        _text(key, "a component name")
        if key.split("/", 1)[0] not in names:
            raise ProtocolError(f"component score {key[:80]!r} names no configured component")
        number = _float(score, f"component score {key[:80]!r}")
        if number is None:
            raise ProtocolError(f"component score {key[:80]!r} is null")
        out[key] = number
    return out


def decode(data: bytes, component_names: frozenset[str], kinds: frozenset[str] = REWARD_KINDS) -> Message:
    """The message in ``data``, checked against the schema; ProtocolError for anything else, a kind
    outside ``kinds`` included. Component scores must be named after ``component_names`` (``name`` or
    ``name/key``)."""
    try:
        obj = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ProtocolError(f"not a JSON message ({type(err).__name__})") from None
    if type(obj) is not dict or obj.get("kind") not in _KEYS:
        raise ProtocolError("not an object with a known 'kind'")
    if obj["kind"] not in kinds:
        raise ProtocolError(f"a {obj['kind']!r} message, which this worker may not send")
    kind = obj["kind"]
    if set(obj) != _KEYS[kind]:
        raise ProtocolError(f"a {kind!r} message needs exactly the keys {sorted(_KEYS[kind])}")
    if kind == "importing":
        return Importing(_int(obj["index"], "index"))
    if kind == "init_error":
        return InitError(_text(obj["message"], "message"))
    if kind == "ready":
        return Ready(
            _text(obj["scratch"], "scratch"),
            _texts(obj["active"], "active"),
            _texts(obj["inactive"], "inactive"),
        )
    if kind == "tool_output":
        return _tool_output(obj)
    if kind == "results":
        items = obj["results"]
        if type(items) is not list or not 0 < len(items) <= MAX_ITEMS:
            raise ProtocolError(f"results is not a list of 1 to {MAX_ITEMS} results")
        for item in items:
            if type(item) is not dict or set(item) != _RESULT_KEYS:
                raise ProtocolError(f"each of results needs exactly the keys {sorted(_RESULT_KEYS)}")
        return Results(tuple(_result(item, component_names) for item in items))
    return _result(obj, component_names)


def _result(obj: dict[str, Any], component_names: frozenset[str]) -> Result:
    """One result's fields (keys already checked), checked against the schema."""
    status = obj["status"]
    if status not in ("ok", "error", "invalid"):
        raise ProtocolError("status is not ok, error or invalid")
    component = _text(obj["component"], "component", optional=True)
    if component is not None and component not in component_names:
        raise ProtocolError("component names no configured component")
    return Result(
        task=_int(obj["task"], "task"),
        status=status,
        reward=_float(obj["reward"], "reward"),
        components=_scores(obj["components"], component_names),
        message=_text(obj["message"], "message", optional=True),
        component=component,
    )


def _tool_output(obj: dict[str, Any]) -> ToolOutput:
    status = obj["status"]
    if status not in ("ok", "error") or type(obj["truncated"]) is not bool:
        raise ProtocolError("a malformed tool_output message")
    output = _text(obj["output"], "tool_output output", optional=True)
    if status == "ok" and output is None:
        raise ProtocolError("an ok tool_output without output")
    return ToolOutput(
        _int(obj["task"], "task"),
        status,
        output,
        obj["truncated"],
        _text(obj["message"], "tool_output message", optional=True),
    )


def _readable(fd: int, timeout_s: float) -> bool:
    poller = select.poll()  # not select.select: a trainer's fds may number past FD_SETSIZE (1024)
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))


def _read_exactly(fd: int, n: int, deadline: float) -> bytes:
    chunks: list[bytes] = []
    while n > 0:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not _readable(fd, remaining):
            raise ProtocolError(f"an incomplete frame: {n} bytes still missing after {FRAME_TIMEOUT_S:g} s")
        chunk = os.read(fd, min(n, MAX_FRAME_BYTES))
        if not chunk:
            raise EOFError("the worker closed its end of the pipe")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> bytes:
    """One frame from ``fd``, which select() reported readable: EOFError when the worker is gone,
    ProtocolError for a negative or oversized length, or one not complete within FRAME_TIMEOUT_S.
    The payload of an oversized frame is never read."""
    deadline = time.monotonic() + FRAME_TIMEOUT_S
    (length,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    if not 0 <= length <= MAX_FRAME_BYTES:
        raise ProtocolError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return _read_exactly(fd, length, deadline)
