"""Misbehaving reward functions for the reward-pool tests (imported by worker processes by
`module:function` path, so they live in an importable module, not inside a test file)."""

import os
import time

from grpo_megatron.rewards.base import RewardSample


def constant(sample: RewardSample, value: float = 1.0) -> float:
    return value


def sleep_forever(sample: RewardSample) -> float:
    while True:
        time.sleep(3600)


def sleep_if_asked(sample: RewardSample) -> float:
    """Hangs on samples whose prompt is "hang", returns len(response) otherwise."""
    if sample.prompt == "hang":
        while True:
            time.sleep(3600)
    return float(len(sample.response))


def busy_loop(sample: RewardSample) -> float:
    while True:  # pure-Python spin: only SIGKILL stops it
        pass


def raises(sample: RewardSample) -> float:
    raise RuntimeError("reward code is broken")


def returns_nan(sample: RewardSample) -> float:
    return float("nan")


def returns_inf(sample: RewardSample) -> float:
    return float("inf")


def returns_string(sample: RewardSample) -> str:
    return "1.0"


def returns_none(sample: RewardSample) -> None:
    return None


def hard_exit(sample: RewardSample) -> float:
    os._exit(3)


def system_exit(sample: RewardSample) -> float:
    raise SystemExit(1)


def dict_components(sample: RewardSample) -> dict[str, float]:
    return {"a": 0.25, "b": 0.5}


def by_prompt(sample: RewardSample) -> float:
    """Dispatches on the prompt so one batch can mix every failure mode."""
    behaviour = {
        "raise": raises,
        "nan": returns_nan,
        "hang": sleep_forever,
        "exit": hard_exit,
        "str": returns_string,
    }
    return behaviour.get(sample.prompt, lambda s: float(len(s.response)))(sample)


def allocate_too_much(sample: RewardSample) -> float:
    blob = bytearray(4 * 1024**3)  # 4 GiB: past the worker's memory limit in the test
    return float(len(blob))
