"""The open-file limit a rank needs at 1024 ranks (distributed/open_files.py): estimated from the
groups it opens, raised at start by the real bootstrap, refused with the fix when the hard limit is
too low (issue 36)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_megatron.distributed.open_files import agent_serves_store, open_files_needed, store_open_files
from tests.helpers.dist import REPO_ROOT


def _run(code: str, soft: int, hard: int | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter whose open-file limits start at (soft, hard); hard None: ours."""
    _, our_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limits = (soft, our_hard if hard is None else hard)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits),
    )


def test_the_deepseek_recipe_needs_more_than_the_usual_soft_limit():
    # examples/recipes/deepseek_v3_671b.yaml: 1024 ranks, TP 8 (dp 128), EP 256 (expert dp 4), NCCL
    rank0 = open_files_needed(1024, dp=128, cp=1, expert_dp=4, rank=0, nccl=True)
    other = open_files_needed(1024, dp=128, cp=1, expert_dp=4, rank=5, nccl=True)
    assert (rank0.data_group, rank0.megatron_gloo, rank0.store) == (1023, 127 + 127 + 3, 2)
    assert rank0.total == other.total == 2506 > 1024, (
        rank0,
        other,
    )  # under torchrun the agent serves the store
    # Issue 51 item 6: the store where it lives: node 0's torchrun agent (2 connections per rank, 1 per agent)
    assert store_open_files(1024, 128) == 2 * 1024 + 128 + 1024 == 3200
    # without an agent (srun straight into the ranks) rank 0 serves it
    alone = open_files_needed(1024, dp=128, cp=1, expert_dp=4, rank=0, nccl=True, agent_store=False)
    assert alone.store == 2048 and alone.total == 4552
    assert agent_serves_store({"TORCHELASTIC_USE_AGENT_STORE": "True"}) and not agent_serves_store({})
    assert open_files_needed(2, dp=2, cp=1, expert_dp=1, rank=0, nccl=False).total < 1100


_FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for the interpreter node.sh starts torchrun with: reports the agent's limits, starts nothing
if [ "$2" = torch.distributed.run ]; then echo "agent nofile $(ulimit -Sn) $(ulimit -Hn)"; exit 0; fi
exec {python} "$@"
"""


def _node_sh(tmp_path: Path, soft: int, hard: int, node_rank: int) -> subprocess.CompletedProcess:
    fake = tmp_path / "python"
    fake.write_text(_FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    env = dict(
        os.environ,
        PYTHON=str(fake),
        NNODES="128",
        GPUS_PER_NODE="8",
        NODE_RANK=str(node_rank),
        MASTER_ADDR="127.0.0.1",
        COMMAND="sanity",
    )
    return subprocess.run(
        ["bash", str(REPO_ROOT / "launch/slurm/node.sh"), "examples/demo.yaml"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
    )


def test_node_sh_raises_the_open_file_limit_of_node_0s_torchrun_agent(tmp_path: Path):
    """Issue 51 item 6: at 1024 ranks node 0's torchrun agent serves the c10d store to ~2,200
    connections; launch/slurm/node.sh starts it with the soft limit raised to the hard one, and on node
    0 refuses a hard limit below the store's need (3,200 here), naming the fix."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 3300:
        pytest.skip(f"this machine's hard limit of open files is {hard}: below the 3,200 the test asks for")
    top = 3300 if hard == resource.RLIM_INFINITY else hard
    done = _node_sh(tmp_path, 256, top, node_rank=0)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"agent nofile {top} {top}" in done.stdout, done.stdout
    low = _node_sh(tmp_path, 256, 2000, node_rank=0)
    assert low.returncode == 1 and "agent nofile" not in low.stdout
    assert "it needs about 3200 open files, but the hard limit is 2000: raise nofile" in low.stderr, (
        low.stderr
    )
    other = _node_sh(
        tmp_path, 256, 2000, node_rank=1
    )  # other nodes' agents serve no store: raised, not refused
    assert other.returncode == 0 and "agent nofile 2000 2000" in other.stdout, other.stdout + other.stderr


@pytest.mark.launches
def test_the_bootstrap_raises_the_soft_limit_to_the_hard_one():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine's hard limit of open files is {hard}: nothing to raise to")
    out = _run(
        """
        import resource
        from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed
        from grpo_megatron.distributed.config import ParallelConfig

        init_distributed(ParallelConfig(backend="gloo"))
        print("limits", *resource.getrlimit(resource.RLIMIT_NOFILE))
        destroy_distributed()
        """,
        soft=256,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    soft, new_hard = (int(x) for x in out.stdout.split("limits", 1)[1].split())
    assert new_hard == hard and soft == (hard if hard != resource.RLIM_INFINITY else 1 << 20), out.stdout


@pytest.mark.launches
def test_a_hard_limit_below_the_need_is_refused_with_the_numbers_and_the_fix():
    out = _run(
        """
        from grpo_megatron.distributed.open_files import open_files_needed, raise_open_file_limit

        raise_open_file_limit(open_files_needed(1024, dp=128, cp=1, expert_dp=4, rank=0, nccl=True))
        """,
        soft=256,
        hard=2000,
    )
    assert out.returncode == 1
    error = out.stderr.strip().splitlines()[-1]
    assert "RuntimeError: this rank needs about 2506 = 1023 for the rollout data group" in error, error
    assert (
        "its hard limit is 2000 (soft 256)" in error and "at least 2506" in error and "limits.conf" in error
    )
