"""The open-file limit a rank needs at 1024 ranks (distributed/open_files.py): estimated from the
groups it opens, raised at start by the real bootstrap, refused with the fix when the hard limit is
too low (issue 36)."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import pytest

from grpo_megatron.distributed.open_files import open_files_needed
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
    assert (rank0.data_group, rank0.megatron_gloo, rank0.store) == (1023, 127 + 127 + 3, 2048)
    assert other.total < rank0.total and other.total > 1024 and rank0.total == 4552, (rank0, other)
    assert open_files_needed(2, dp=2, cp=1, expert_dp=1, rank=0, nccl=False).total < 1100


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
    assert "RuntimeError: this rank needs about 4552 = 1023 for the rollout data group" in error, error
    assert (
        "its hard limit is 2000 (soft 256)" in error and "at least 4552" in error and "limits.conf" in error
    )
