"""Launch scripts: syntax of every script, and the Slurm script's command line run locally with two
CPU processes standing in for two nodes (GRPO_LOCAL_TEST=1 replaces srun; the rest is the real
per-node torchrun with a c10d rendezvous)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.dist import REPO_ROOT, free_port

SCRIPTS = sorted([*REPO_ROOT.glob("launch/*.sh"), *REPO_ROOT.glob("launch/slurm/*")])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_bash_syntax(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _run_sbatch_locally(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    log_dir = tmp_path / "logs"
    env = dict(
        os.environ,
        GRPO_LOCAL_TEST="1",
        NNODES="2",
        GPUS_PER_NODE="1",
        COMMAND="sanity",
        MASTER_PORT=str(free_port()),
        LOG_DIR=str(log_dir),
        OMP_NUM_THREADS="1",
    )
    cmd = ["bash", str(REPO_ROOT / "launch/slurm/train.sbatch"), "examples/tiny_moe.yaml", *args]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    return result, log_dir


def test_sbatch_two_local_nodes(tmp_path: Path) -> None:
    """Two "nodes" rendezvous into one world of 2 ranks, run the command with the overrides passed
    through, and write one log per node; then a failing run's exit code reaches the caller."""
    result, log_dir = _run_sbatch_locally(tmp_path, "train.iterations=2")
    logs = {p.name: p.read_text() for p in sorted(log_dir.glob("node*.log"))}
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{logs}"
    assert set(logs) == {"node0.log", "node1.log"}
    everything = "".join(logs.values())
    assert "dp 0/2" in everything  # one world of two ranks across the two "nodes"
    assert "step   2" in everything and "step   3" not in everything  # the override arrived

    bad, bad_logs = _run_sbatch_locally(tmp_path / "bad", "parallel.tp=3")
    assert bad.returncode != 0
    assert "node 0 exited with" in bad.stderr
    assert "parallel.tp=3 does not divide" in (bad_logs / "node0.log").read_text()
