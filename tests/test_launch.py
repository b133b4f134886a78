"""Launch scripts: syntax of every script, and the Slurm script run with two CPU processes standing in
for two nodes: its GRPO_LOCAL_TEST=1 branch, and its real branch (its own srun line) under fake
`srun` / `scontrol` executables that do what Slurm does for it; both run the real per-node torchrun
with a c10d rendezvous."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.dist import REPO_ROOT, free_port
from tests.helpers.slurm import shim, slurm_env

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
        PYTHON=sys.executable,  # the interpreter running the tests, wherever its venv lives
    )
    cmd = ["bash", str(REPO_ROOT / "launch/slurm/train.sbatch"), "examples/tiny_moe.yaml", *args]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    return result, log_dir


@pytest.mark.launches
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


# ----------------------------------------------------------------------------------------------------
# The real Slurm branch under a shim: fake `scontrol` and `srun` executables on PATH that do what Slurm
# does for this script, so that its own `srun` line runs (not the GRPO_LOCAL_TEST branch).


def _run_sbatch_under_slurm(
    tmp_path: Path, *args: str, python: str | None = None
) -> subprocess.CompletedProcess:
    """train.sbatch as sbatch would run it on a 2-node allocation (the job's environment), with the
    fake srun/scontrol first on PATH."""
    cmd = ["bash", str(REPO_ROOT / "launch/slurm/train.sbatch"), "examples/tiny_moe.yaml", *args]
    return subprocess.run(
        cmd, cwd=tmp_path, env=slurm_env(tmp_path, python), capture_output=True, text=True, timeout=240
    )


def test_fake_scontrol_expands_slurm_hostlists(tmp_path: Path) -> None:
    scontrol = shim(tmp_path) / "scontrol"
    out = subprocess.run(
        [scontrol, "show", "hostnames", "gpu[001-003,010],login1,rack2-n[8-9]x"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["gpu001", "gpu002", "gpu003", "gpu010", "login1", "rack2-n8x", "rack2-n9x"]


@pytest.mark.launches
def test_sbatch_real_branch_runs_its_srun_line(tmp_path: Path) -> None:
    """The script's own srun line starts one task per node of the allocation; the two tasks
    rendezvous on the first host into one world of 2 ranks; logs per node; exit code 0."""
    result = _run_sbatch_under_slurm(tmp_path, "train.iterations=2")
    logs = {p.name: p.read_text() for p in sorted((tmp_path / "logs").glob("node*.log"))}
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{logs}"
    assert "job 4242: 2 nodes (127.0.0.[1-2]), rendezvous 127.0.0.1:" in result.stdout
    assert "srun exited with 0" in result.stdout
    assert set(logs) == {"node0.log", "node1.log"}
    assert "[node 0/2 " in logs["node0.log"] and "[node 1/2 " in logs["node1.log"]  # SLURM_NODEID per task
    everything = "".join(logs.values())
    assert "dp 0/2" in everything and "step   2" in everything and "step   3" not in everything


@pytest.mark.launches
def test_sbatch_real_branch_names_the_failing_node(tmp_path: Path) -> None:
    """Node 1 cannot start Python (a broken environment on one host): srun's --kill-on-bad-exit
    stops node 0 (waiting for it at the rendezvous), and the job exits with node 1's code, naming
    node 1 and its log."""
    python = tmp_path / "python-on-node"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$SLURMD_NODENAME" = 127.0.0.2 ]; then echo "no python environment on $SLURMD_NODENAME" >&2; exit 7; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    result = _run_sbatch_under_slurm(tmp_path, python=str(python))
    assert result.returncode == 7, f"{result.stdout}\n{result.stderr}"
    log = tmp_path / "logs" / "node1.log"
    assert f"node 1 (127.0.0.2) exited with 7 (log: {tmp_path / 'logs'}/node1.log)" in result.stderr
    assert "node 0 (127.0.0.1) was stopped before it finished" in result.stderr
    assert "no python environment on 127.0.0.2" in log.read_text()
