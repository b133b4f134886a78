"""Run a test function on several processes through ``torch.distributed.run``.

``run_distributed("tests.workers.compat_workers:tp2_moe", world_size=2, hidden=64)`` starts
``python -m torch.distributed.run --standalone --nproc-per-node 2`` (the same env:// rendezvous
that torchrun and srun jobs use), each rank imports the target, calls it with the keyword
arguments and saves what it returns; the parent loads the per-rank results and returns them in
rank order.

Rules for targets:
- they initialise the process group themselves (``init_gloo()`` below, or the package's own
  bootstrap), so the bootstrap under test is the real one;
- they return ``None`` or nested dicts / lists / tuples of tensors, floats, ints, bools and
  strings: results are loaded with ``torch.load(weights_only=True)``, nothing is unpickled.

A hang fails: after ``timeout_s`` the whole process group is killed and the test gets an
``AssertionError`` with the tail of the combined log. A failing rank is named in the error.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tests.helpers import tier

REPO_ROOT = Path(__file__).resolve().parents[2]
# Config overrides of every test job meant for CPU: the device follows parallel.backend, so these
# run on CPU (gloo) on a GPU machine too, instead of picking cuda:<local rank> there.
CPU_JOB = ["parallel.backend=gloo"]
LOG_TAIL_LINES = 60
_ENTRY_MODULE = "tests.helpers.dist_entry"


_PORTS = random.Random(os.getpid() ^ time.time_ns())
_LOWEST_PORT = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (``ip_local_port_range``; Linux's default 32768)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def free_port() -> int:
    """A TCP port free a moment ago, for a job to listen on. Below the kernel's ephemeral range, so no
    outgoing connection (gloo's pairs, an engine's sockets) is given it before the job binds it (seen:
    torchrun's store failing with EADDRINUSE on a port the OS had picked), and in this pytest-xdist
    worker's own slice of the ports below it, so two workers never pick the same one."""
    low = _ephemeral_low()
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % workers
    span = (low - _LOWEST_PORT) // workers
    for _ in range(100) if span > 100 else ():
        port = _LOWEST_PORT + worker * span + _PORTS.randrange(span)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below: the OS picks one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(timeout_s: float = 120.0) -> tuple[int, int]:
    """Initialise the default gloo process group from the env:// variables torchrun sets.

    Returns ``(rank, world_size)``. The timeout bounds every collective, so a rank that never
    arrives makes the others fail instead of waiting forever.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def tcp_bytes_received() -> dict[str, int]:
    """Bytes received so far on each of this process's open TCP sockets, as the kernel counts them
    (``TCP_INFO``'s ``tcpi_bytes_received``: gloo's pairs, the launcher's store), by socket
    (``socket:[inode]``): a reading for ``received_since``."""
    import struct

    reading = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
            if not name.startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with sock:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                if len(info) >= 136:  # struct tcp_info: tcpi_bytes_received is the u64 at offset 128
                    reading[name] = struct.unpack_from("Q", info, 128)[0]
    return reading


def received_since(start: dict[str, int]) -> int:
    """Bytes this process received over TCP since the reading ``start``: each socket open now, less
    what it had then (0 if opened since). A socket closed in between is not read (its bytes since
    ``start`` are not counted; before, a sum of totals subtracted its whole history: a rank once
    measured -8 bytes received)."""
    return sum(now - start.get(name, 0) for name, now in tcp_bytes_received().items())


def group_timeouts_minutes() -> dict[str, list[float]]:
    """Every process group of this process (torch's registry), by its description: the timeout of
    each of its backends in minutes, read back from torch (``megatron_compat.group_timeouts``)."""
    from torch.distributed import distributed_c10d as c10d

    from grpo_megatron.distributed.megatron_compat import group_timeouts

    out: dict[str, list[float]] = {}
    for group in c10d._world.pg_map:
        out.setdefault(group.group_desc, []).extend(
            sorted(t.total_seconds() / 60 for t in group_timeouts(group))
        )
    return out


def _tail(text: str, n: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-n:])


def _failed_ranks(out_dir: Path) -> dict[int, str]:
    """Tracebacks the entry wrote for ranks whose target raised, keyed by rank."""
    failed = {}
    for path in sorted(out_dir.glob("rank*.error")):
        failed[int(path.stem.removeprefix("rank"))] = path.read_text()
    return failed


def _kill_all(proc: subprocess.Popen, out_dir: Path) -> None:
    """End torchrun and every rank. torchrun stops its ranks on SIGTERM; if it does not within a
    few seconds, SIGKILL them: each rank runs in a session of its own (so killing torchrun's
    process group does not reach it) and wrote its pid for this."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    for pid_file in out_dir.glob("rank*.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_distributed(target: str, world_size: int, *, timeout_s: float = 240, **kwargs: Any) -> list[Any]:
    """Run ``target`` ("package.module:function") on ``world_size`` processes; return per-rank results.

    ``kwargs`` are pickled by this process and handed to ``function(**kwargs)`` on every rank.
    """
    tier.require_mark(f"ranks of their own ({target})")
    if ":" not in target:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}")
    with tempfile.TemporaryDirectory(prefix="grpo_dist_") as tmp:
        out_dir = Path(tmp)
        kwargs_path = out_dir / "kwargs.pkl"
        kwargs_path.write_bytes(pickle.dumps(kwargs))
        log_path = out_dir / "log.txt"

        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            TORCH_COMPILE_DISABLE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            PYTHONUNBUFFERED="1",
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(world_size),
            "-m",
            _ENTRY_MODULE,
            target,
            str(out_dir),
        ]
        with open(log_path, "wb") as log:
            # torchrun in a session of its own: on a timeout its whole process group can be killed
            # without touching pytest's.
            proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_all(proc, out_dir)
                raise AssertionError(
                    f"{target} on {world_size} ranks timed out after {timeout_s:.0f} s; "
                    f"log tail:\n{_tail(log_path.read_text(errors='replace'))}"
                ) from None
        log_text = log_path.read_text(errors="replace")
        failed = _failed_ranks(out_dir)
        if rc != 0 or failed:
            where = f"rank(s) {sorted(failed)}" if failed else "a rank (no traceback written)"
            first_tb = _tail(next(iter(failed.values())), LOG_TAIL_LINES) if failed else ""
            raise AssertionError(
                f"{target} on {world_size} ranks failed (exit code {rc}) in {where}.\n"
                f"First traceback:\n{first_tb}\nLog tail:\n{_tail(log_text)}"
            )
        results = []
        for rank in range(world_size):
            path = out_dir / f"rank{rank}.pt"
            if not path.exists():
                raise AssertionError(f"{target}: rank {rank} wrote no result; log tail:\n{_tail(log_text)}")
            results.append(torch.load(path, weights_only=True))
        return results
