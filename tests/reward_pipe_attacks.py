"""Reward code that writes to its worker's pipe (tests/test_reward_wire.py): the trainer must
decode nothing but wire.py's schema from it. Each function finds the worker's connection the
way hostile code would, by walking up the stack to the worker loop's frame, and attacks the
trainer through it; `sample.prompt` picks the attack and `sample.metadata` holds its target."""

import os
import struct
import sys
import time
from typing import Any

from grpo_megatron.rewards.base import RewardSample


class Touch:
    """Unpickles into open(path, "w"): a file appears wherever it is unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def worker_frame() -> Any:
    """The frame of the worker loop, which holds the connection (`conn`) and the task id."""
    frame = sys._getframe()
    while frame is not None and "conn" not in frame.f_locals:
        frame = frame.f_back
    assert frame is not None, "no frame holds the worker's connection"
    return frame


def _result(task: int, reward: Any = 1.0, **changes: Any) -> bytes:
    import json

    msg = {
        "kind": "result",
        "task": task,
        "status": "ok",
        "reward": reward,
        "components": {"c0": 1.0},
        "message": None,
        "component": None,
        **changes,
    }
    return json.dumps(msg).encode()


def _frame(payload: bytes) -> bytes:
    return struct.pack("!i", len(payload)) + payload


def _malformed(kind: str, task: int) -> bytes:
    """Frames of the right size that are not what the schema allows, or not now."""
    return {
        "not_json": lambda: b"\x80\x04\x95 not json",
        "deep": lambda: b"[" * 30_000 + b"]" * 30_000,
        "string_reward": lambda: _result(task, reward="1.0"),
        "bool_task": lambda: _result(task).replace(f'"task": {task}'.encode(), b'"task": true'),
        "extra_key": lambda: _result(task, evil="x"),
        "unknown_component": lambda: _result(task, components={"nope": 1.0}),
        "other_task": lambda: _result(task + 1),
        "importing": lambda: b'{"kind": "importing", "index": 0}',
    }[kind]()


def attack(sample: RewardSample) -> float:
    frame = worker_frame()
    conn, task = frame.f_locals["conn"], frame.f_locals["task_id"]
    fd = conn.fileno()
    kind = sample.prompt
    if kind == "pickle":  # what the trainer received before: an object whose __reduce__ runs there
        conn.send(Touch(sample.metadata["marker"]))
    elif kind == "huge_header":  # claims 2 GiB - 1; never sends them
        os.write(fd, struct.pack("!i", 2**31 - 1))
    elif kind == "negative_header":  # multiprocessing's 8-byte length form
        os.write(fd, struct.pack("!i", -1) + struct.pack("!Q", 1 << 40))
    elif kind == "oversized":  # a real frame one byte past the bound, with a valid result inside
        body = _result(task)
        conn.send_bytes(body + b" " * (64 * 1024 + 1 - len(body)))
    elif kind == "partial":  # a header for 100 bytes, 10 of them, then silence
        os.write(fd, struct.pack("!i", 100) + b"{" * 10)
        time.sleep(3600)
    elif kind == "flood":  # many results for its own task: the first one counts, the rest kill it
        for _ in range(10_000):
            try:
                conn.send_bytes(_result(task, reward=1e9))
            except OSError:
                break
    elif kind.startswith("malformed:"):
        os.write(fd, _frame(_malformed(kind.split(":", 1)[1], task)))
        time.sleep(3600)  # a trainer that ignored the frame would wait for the timeout
    return float(len(sample.response))  # "ok" and attacks the trainer refused
