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

FAKE_SCONTROL = '''#!{python}
"""scontrol show hostnames LIST: one host per line, Slurm's hostlist syntax expanded."""
import re, signal, sys

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head -n1` closes the pipe early, as with the real one


def expand(hostlist):
    hosts = []
    for part in re.findall(r"[^,\\[]+(?:\\[[^\\]]*\\])?[^,]*", hostlist):
        m = re.fullmatch(r"(.*)\\[(.*)\\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{{prefix}}{{i:0{{len(lo)}}d}}{{suffix}}")
    return hosts

if __name__ == "__main__":
    if sys.argv[1:2] == ["requeue"]:  # what the script asks of Slurm, noted for the test
        with open(__import__("os").environ["FAKE_SLURM_LOG"], "a") as log:
            log.write(" ".join(sys.argv[1:]) + "\\n")
        sys.exit(0)
    assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
    print("\\n".join(expand(sys.argv[3] if len(sys.argv) > 3 else __import__("os").environ["SLURM_JOB_NODELIST"])))
'''

FAKE_SRUN = '''#!{python}
"""srun --nodes N --ntasks-per-node 1 [--kill-on-bad-exit=1] [--output PATTERN] CMD...: one task per
node of the allocation with Slurm's task variables, output to PATTERN (%n node index, %t task, %N
host, %j job id), the other tasks killed when one fails (with --kill-on-bad-exit), exit code the
worst task's. SIGUSR1 and SIGTERM are passed on to every task's process group."""
import os, signal, subprocess, sys, time

sys.path.insert(0, os.path.dirname(__file__))
from scontrol import expand

args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("-"):
    flag = args.pop(0)
    key, eq, value = flag.partition("=")
    opts[key] = value if eq else args.pop(0)
assert opts.get("--ntasks-per-node", "1") == "1", "this shim starts one task per node"
hosts = expand(os.environ["SLURM_JOB_NODELIST"])
nodes = int(opts.get("--nodes", os.environ["SLURM_JOB_NUM_NODES"]))
assert nodes <= len(hosts), f"srun: error: {{nodes}} nodes asked for, the job has {{len(hosts)}}"
tasks = []
for i, host in enumerate(hosts[:nodes]):
    env = dict(os.environ, SLURM_PROCID=str(i), SLURM_NODEID=str(i), SLURM_LOCALID="0",
               SLURM_NNODES=str(nodes), SLURM_NTASKS=str(nodes), SLURM_STEP_NUM_NODES=str(nodes),
               SLURM_STEP_NODELIST=",".join(hosts[:nodes]), SLURMD_NODENAME=host, SLURM_STEP_ID="0")
    out = None
    if "--output" in opts:
        path = (opts["--output"].replace("%%", "\\0").replace("%n", str(i)).replace("%t", str(i))
                .replace("%N", host).replace("%j", os.environ["SLURM_JOB_ID"]).replace("\\0", "%"))
        out = open(path, "w")
    tasks.append(subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                  start_new_session=True))
kill = opts.get("--kill-on-bad-exit", "0") == "1"
codes = {{}}


def forward(signum, frame):
    for task in tasks:
        if task.poll() is None:
            os.killpg(task.pid, signum)


signal.signal(signal.SIGUSR1, forward)
signal.signal(signal.SIGTERM, forward)
while len(codes) < len(tasks):
    for i, task in enumerate(tasks):
        if i not in codes and task.poll() is not None:
            codes[i] = task.returncode
            if task.returncode != 0:
                print(f"srun: error: {{hosts[i]}}: task {{i}}: Exited with exit code {{task.returncode}}", file=sys.stderr)
                if kill:
                    for other in tasks:
                        if other.poll() is None:
                            os.killpg(other.pid, signal.SIGKILL)
    time.sleep(0.05)
sys.exit(max((c if c >= 0 else 128 - c for c in codes.values()), default=0))
'''


def _shim(tmp_path: Path) -> Path:
    """A directory with the fake ``scontrol`` and ``srun``, to put first on PATH."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    (bin_dir / "scontrol.py").symlink_to(bin_dir / "scontrol")  # srun imports its expansion
    return bin_dir


def _run_sbatch_under_slurm(
    tmp_path: Path, *args: str, python: str | None = None
) -> subprocess.CompletedProcess:
    """train.sbatch as sbatch would run it on a 2-node allocation (the job's environment), with the
    fake srun/scontrol first on PATH."""
    cmd = ["bash", str(REPO_ROOT / "launch/slurm/train.sbatch"), "examples/tiny_moe.yaml", *args]
    return subprocess.run(
        cmd, cwd=tmp_path, env=slurm_env(tmp_path, python), capture_output=True, text=True, timeout=240
    )


def slurm_env(tmp_path: Path, python: str | None = None) -> dict[str, str]:
    """The environment of a batch script on a 2-node allocation (job 4242, one process per node),
    with the fake srun/scontrol first on PATH; `scontrol requeue` is noted in $FAKE_SLURM_LOG."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM", "GRPO_LOCAL_TEST", "MASTER_", "GRPO_EXIT_FILE"))
    }
    env.update(
        PATH=f"{_shim(tmp_path)}:{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="grpo-megatron",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="127.0.0.[1-2]",  # two loopback addresses: the first is the rendezvous host
        SLURM_SUBMIT_DIR=str(REPO_ROOT),
        SLURM_GPUS_ON_NODE="1",  # one process per "node"
        COMMAND="sanity",
        MASTER_PORT=str(free_port()),
        RDZV_TIMEOUT="120",
        LOG_DIR=str(tmp_path / "logs"),
        OMP_NUM_THREADS="1",
        PYTHON=python or sys.executable,
        FAKE_SLURM_LOG=str(tmp_path / "slurm.log"),
    )
    return env


def test_fake_scontrol_expands_slurm_hostlists(tmp_path: Path) -> None:
    scontrol = _shim(tmp_path) / "scontrol"
    out = subprocess.run(
        [scontrol, "show", "hostnames", "gpu[001-003,010],login1,rack2-n[8-9]x"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["gpu001", "gpu002", "gpu003", "gpu010", "login1", "rack2-n8x", "rack2-n9x"]


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
