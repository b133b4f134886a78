"""Misbehaving tools for tests/test_multiturn.py (imported only in tool workers)."""

import os
import sys
import time


def echo(argument: str) -> str:
    return argument


def hang(argument: str) -> str:
    while True:
        time.sleep(1)


def spin(argument: str) -> str:
    while True:
        pass


def boom(argument: str) -> str:
    raise RuntimeError("tool exploded")


def flood(argument: str) -> str:
    sys.stdout.write("x" * 1_000_000)
    sys.stderr.write("y" * 1_000_000)
    return "z" * 10_000_000


def not_text(argument: str) -> int:
    return 42


def die(argument: str) -> str:
    os._exit(3)


def lie(argument: str) -> str:
    os.write(3, b"\x00\x00\x00\x05hello")  # a frame that is not JSON, on whatever fd 3 is
    return "ok"
