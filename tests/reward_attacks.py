"""Hostile reward functions for the sandbox tests (imported by reward workers by
`module:function` path). Each returns 1.0 if its attack SUCCEEDED and 0.0 if the sandbox stopped
it; the test passes what to attack in `sample.metadata`.

Module-level code: records the pid of the process that imported this module, so a test can
show that it ran in a worker and never in the trainer."""

import os
import socket
import subprocess

from grpo_megatron.rewards.base import RewardSample

IMPORTED_IN_PID = os.getpid()


def imported_in(sample: RewardSample) -> float:
    return float(IMPORTED_IN_PID)


def _readable(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def read_secrets(sample: RewardSample) -> float:
    """The trainer's secret in this process's environment, its original environment block, or
    the trainer's / parent's /proc/<pid>/environ?"""
    secret = sample.metadata["secret"].encode()
    if any(secret in v.encode() for v in os.environ.values()):
        return 1.0
    for pid in ("self", str(sample.metadata["trainer_pid"]), str(os.getppid())):
        data = _readable(f"/proc/{pid}/environ")
        if data is not None and secret in data:
            return 1.0
    return 0.0


def read_closed_file(sample: RewardSample) -> float:
    """A file in a directory closed to others (0700, like /root) or /etc/shadow."""
    return (
        1.0 if _readable(sample.metadata["path"]) is not None or _readable("/etc/shadow") is not None else 0.0
    )


def run_commands(sample: RewardSample) -> float:
    """os.system and subprocess: did either command run?"""
    os.system("touch pwned_by_system")
    try:
        subprocess.run(["/bin/sh", "-c", "touch pwned_by_subprocess"], check=False, timeout=2)
    except OSError:
        pass
    return 1.0 if os.path.exists("pwned_by_system") or os.path.exists("pwned_by_subprocess") else 0.0


def connect(sample: RewardSample) -> float:
    """A TCP connection to a port the trainer listens on."""
    try:
        with socket.create_connection(("127.0.0.1", sample.metadata["port"]), timeout=2):
            return 1.0
    except OSError:
        return 0.0


def write_outside_scratch(sample: RewardSample) -> float:
    """A write into a world-writable directory outside the scratch directory (and, for
    contrast, into the scratch directory, which must work: a failure there raises)."""
    with open(os.path.join(os.environ["TMPDIR"], "ok.txt"), "w") as f:
        f.write("scratch is writable")
    try:
        with open(os.path.join(sample.metadata["dir"], "pwned.txt"), "w") as f:
            f.write("x")
        return 1.0
    except OSError:
        return 0.0


def signal_others(sample: RewardSample) -> float:
    """Signal 0 (the permission check of every signal, delivering nothing) to the trainer and
    the other workers: 1.0 if any of them could have been killed."""
    for pid in sample.metadata["pids"]:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            return 1.0
        except PermissionError:
            pass
        except ProcessLookupError:
            pass
    return 0.0


def by_prompt(sample: RewardSample) -> float:
    attacks = {
        "imported_in": imported_in,
        "secrets": read_secrets,
        "closed_file": read_closed_file,
        "commands": run_commands,
        "connect": connect,
        "write": write_outside_scratch,
        "signal": signal_others,
    }
    return attacks[sample.prompt](sample)
