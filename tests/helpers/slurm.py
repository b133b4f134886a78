"""A fake Slurm for tests: ``scontrol`` (hostlist expansion, ``requeue`` noted) and ``srun`` (one task
per node on loopback addresses), first on PATH, and the environment of a batch script on a 2-node
allocation (tests/test_launch.py, tests/test_preemption.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.helpers.dist import REPO_ROOT, free_port

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


def shim(tmp_path: Path) -> Path:
    """A directory with the fake ``scontrol`` and ``srun``, to put first on PATH."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    (bin_dir / "scontrol.py").symlink_to(bin_dir / "scontrol")  # srun imports its expansion
    return bin_dir


def slurm_env(tmp_path: Path, python: str | None = None) -> dict[str, str]:
    """The environment of a batch script on a 2-node allocation (job 4242, one process per node),
    with the fake srun/scontrol first on PATH; `scontrol requeue` is noted in $FAKE_SLURM_LOG."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM", "GRPO_LOCAL_TEST", "MASTER_", "GRPO_EXIT_FILE"))
    }
    env.update(
        PATH=f"{shim(tmp_path)}:{os.environ['PATH']}",
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
