"""Launching the CLI on several processes as a user would (torchrun), and comparing what runs wrote:
the helpers of every end-to-end test (tests/test_train.py and the tests of async, preemption, faults,
multi-turn, SGLang and the recipes)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from grpo_megatron.logging_utils.metrics import read_jsonl
from tests.helpers import tier
from tests.helpers.dist import REPO_ROOT, free_port

DEMO = REPO_ROOT / "examples" / "demo.yaml"
SMALL = [
    "train.prompts_per_iteration=4",
    "rollout.n_samples_per_prompt=4",
    "data.num_train_prompts=256",
    "data.num_eval_prompts=8",
    "train.micro_batch_size=8",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "parallel.backend=gloo",  # CPU on any machine
    "parallel.timeout_minutes=3",  # a rank stuck in a collective fails the test instead of hanging it
]
MOVING = [
    *SMALL,
    "reward.components=[{name: len, function: length, kwargs: {target_chars: 6}}]",
    "train.lr=1e-3",
]
"""SMALL with a reward the demo model earns from the start, and a learning rate that moves it: runs whose
weights change every iteration (tests/test_async.py, tests/test_sglang_train.py)."""
# Keys that measure wall time differ between any two runs; everything else must match bitwise.
TIMING_PREFIXES = ("time/", "throughput/", "sync/")


def launch(
    command: str, overrides: list[str], *, world_size: int = 2, config: Path = DEMO
) -> subprocess.Popen:
    """``grpo-megatron COMMAND CONFIG OVERRIDES`` on ``world_size`` processes under torchrun, output
    piped; its own session (``kill_job`` ends it all)."""
    tier.require_mark(f"a training job (grpo-megatron {command})")
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", WANDB_SILENT="true")
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world_size),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "grpo_megatron",
        command,
        str(config),
        *overrides,
    ]
    return subprocess.Popen(
        args,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def can_name_hosts() -> str | None:
    """None if this process may give a child a host name of its own (``unshare --uts``: root, or
    user namespaces), else why not (``launch_node`` needs it)."""
    try:
        done = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`unshare --uts` cannot run here ({exc})"
    return None if done.returncode == 0 else f"`unshare --uts` is refused here: {done.stderr.strip()[-200:]}"


def launch_node(
    command: str,
    overrides: list[str],
    *,
    node_rank: int,
    nnodes: int,
    port: int,
    nproc: int = 1,
    config: Path = DEMO,
) -> subprocess.Popen:
    """Node ``node_rank`` of an ``nnodes``-node job on this host, as a cluster starts one torchrun per
    node: in a UTS namespace of its own whose host name is the loopback address 127.0.0.<node_rank + 1>,
    so that whatever the job derives from host names (ranks grouped into nodes, an SGLang engine's
    ``dist_init_addr`` across nodes) sees distinct hosts that still resolve. Node 0's address is the
    rendezvous'."""
    tier.require_mark("a node of a training job")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "-m",
        "grpo_megatron",
        command,
        str(config),
        *overrides,
    ]
    script = f'hostname 127.0.0.{node_rank + 1} && exec "$@"'
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", WANDB_SILENT="true")
    return subprocess.Popen(
        ["unshare", "--uts", "sh", "-c", script, "node", *torchrun],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the whole job at once: torchrun's agent and every process under it. Torchrun starts
    each rank in a session of its own, so a kill of the agent's process group (its session) alone
    leaves the ranks running on to the end of the run."""
    root = psutil.Process(proc.pid)
    tree = [root, *root.children(recursive=True)]
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(tree, timeout=30)


def kill_after_checkpoint(proc: subprocess.Popen, run_dir: Path, iteration: int = 2) -> None:
    """SIGKILL the whole job (every rank, engine and reward processes too: ``kill_job``), as a
    scheduler's preemption would, once its checkpoint of ``iteration`` is the latest; the checkpoint
    of ``iteration`` stays the latest."""
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not (latest.is_file() and latest.read_text().strip() == f"iter_{iteration:07d}"):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, f"no checkpoint at iteration {iteration}"
        time.sleep(0.05)
    kill_job(proc)
    proc.communicate()
    assert latest.read_text().strip() == f"iter_{iteration:07d}", "the job went on after its SIGKILL"


def killed_and_resumed(overrides: list[str], run_dir: Path, *, config: Path = DEMO) -> list[dict]:
    """Train into ``run_dir``, kill the job after its checkpoint of iteration 2, resume it to the end:
    its metrics rows, wall times left out (``comparable``)."""
    proc = launch("train", [*overrides, f"logging.run_dir={run_dir}"], config=config)
    kill_after_checkpoint(proc, run_dir)
    finish(
        launch("train", [*overrides, f"logging.run_dir={run_dir}", "checkpoint.resume=auto"], config=config)
    )
    return [comparable(r) for r in read_jsonl(run_dir / "metrics.jsonl")]


def finish(proc: subprocess.Popen, timeout_s: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_job(proc)  # every rank too: they hold the output pipe open
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout_s} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIXES)}


def cli(args: list[str], world_size: int) -> subprocess.CompletedProcess:
    """``grpo-megatron ARGS`` on ``world_size`` processes (torchrun, gloo: CPU on any machine)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", MASTER_PORT=str(free_port()))
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size)]
    return subprocess.run(
        [sys.executable, *launcher, "-m", "grpo_megatron", *args, "--backend", "gloo"],  # CPU on any machine
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
