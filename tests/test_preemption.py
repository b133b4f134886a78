"""Save on signal (issues 26, 51): SIGTERM at any point of an iteration -- rollout, train, sync, during a
save -- on one rank or on every process of the job (Slurm) makes every rank stop at the next safe point
(a rollout is cut short and its batch dropped: the iteration before is kept; after the update the
iteration ends), write a checkpoint that verifies, and exit 75; rerunning resumes bit-exactly (the
chained reruns' metrics equal an uninterrupted run's, the chain starting with a job SIGKILLed after a
checkpoint). A second signal, or the grace running out, exits at
once without touching ``latest``. Real processes:
the trainer under torchrun (2 ranks, gloo), signals sent by the ranks to themselves at the named
points (tests/workers/preempt_workers.py) or by this test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from grpo_megatron.distributed.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED
from tests.helpers.dist import REPO_ROOT, free_port
from tests.helpers.runs import DEMO, SMALL, comparable, finish, kill_after_checkpoint, launch

COMMON = [*SMALL, "train.iterations=7", "checkpoint.save_interval=2"]
"""The chain's runs (eval_interval left at the demo's 50: evaluations at iterations 0 and 7 only)."""

# ------------------------------------------------------------------------------------------------
# The flag object alone, in a process whose main thread never reaches a safe point

_CHILD = """
import os, sys, time
from pathlib import Path
from grpo_megatron.distributed.preemption import Preemption
from grpo_megatron.fileio import write_text_atomic
import signal
p = Preemption([signal.SIGTERM], grace_s=float(sys.argv[1]))
p.install()
p.checkpoint_written = sys.argv[2] == "written"
latest = Path(sys.argv[3])
print("ready", flush=True)
if sys.argv[4] == "blocked":  # as a rank waiting in a collective: no Python runs in the main thread
    os.read(os.pipe()[0], 1)
i = 0
while True:  # as rank 0 publishing checkpoints: `latest` replaced over and over
    i += 1
    write_text_atomic(latest, f"iter_{i:07d}\\n" * 1000)
"""


def _child(tmp_path: Path, grace_s: float, written: bool, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(grace_s),
            "written" if written else "no",
            str(tmp_path / "latest"),
            mode,
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline().strip()
    if first != "ready":
        pytest.fail(first + proc.communicate()[1])
    return proc


def _exit_within(proc: subprocess.Popen, bound_s: float) -> tuple[int, float, str]:
    start = time.monotonic()
    out, err = proc.communicate(timeout=bound_s + 30)
    return proc.returncode, time.monotonic() - start, out + err


@pytest.mark.launches
def test_grace_bounds_a_rank_that_never_reaches_the_safe_point(tmp_path: Path):
    for written, code in ((False, EXIT_INTERRUPTED), (True, EXIT_PREEMPTED)):
        proc = _child(tmp_path, 1.0, written, "blocked")
        proc.send_signal(signal.SIGTERM)
        rc, elapsed, out = _exit_within(proc, 1.0)
        assert rc == code, out
        assert 0.9 < elapsed < 3.0, elapsed
        assert "the grace of checkpoint.signal_grace_s=1 s ran out: exiting now" in out, out


@pytest.mark.launches
def test_a_second_signal_exits_at_once_and_latest_stays_whole(tmp_path: Path):
    proc = _child(tmp_path, 60.0, False, "publishing")
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # the same signal by a second route (Slurm and node.sh): one signal
    time.sleep(1.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)  # a second one
    rc, elapsed, out = _exit_within(proc, 1.0)
    assert rc == EXIT_INTERRUPTED and elapsed < 2.0, (rc, elapsed, out)
    assert "a second signal (SIGTERM): exiting now with 143" in out
    lines = set((tmp_path / "latest").read_text().splitlines())
    assert len(lines) == 1 and len((tmp_path / "latest").read_text()) == 13 * 1000  # one whole version


# ------------------------------------------------------------------------------------------------
# The trainer: one signal at each point, each rerun resuming from the checkpoint the last one wrote


def _run(run_dir: Path, point: str, rank: int, extra: list[str] | None = None) -> tuple[int, str, str]:
    """One launch of the trainer whose rank ``rank`` signals itself at ``point``: (torchrun's exit
    code, the code in $GRPO_EXIT_FILE, the output)."""
    exit_file = run_dir.parent / f"exit-{point}"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TORCH_COMPILE_DISABLE="1",
        WANDB_SILENT="true",
        GRPO_EXIT_FILE=str(exit_file),
    )
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "tests.workers.preempt_workers",
        point,
        str(rank),
        "train",
        str(DEMO),
        *COMMON,
        *(extra or []),
        f"logging.run_dir={run_dir}",
    ]
    proc = subprocess.run(
        args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400
    )
    code = exit_file.read_text().strip() if exit_file.exists() else ""
    (run_dir.parent / f"out-{point}.txt").write_text(proc.stdout)  # for a failure's post-mortem
    return proc.returncode, code, proc.stdout


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def _slurm_sigterm_mid_rollout(run_dir: Path, tmp_path: Path) -> tuple[float, str]:
    """Issue 51 item 5, as Slurm preempts: the trainer under launch/slurm/node.sh (one node of 2 ranks),
    resuming ``run_dir`` from its iteration-2 checkpoint, with rollouts slowed to ~3 s
    (tests/workers/slow_rollout/sitecustomize.py); once iteration 4's rollout runs, SIGTERM to every
    process of the tree: node.sh, torchrun's agent, the ranks and their helpers (megatron's checkpoint
    writer queue, the reward workers' forkserver). Returns the seconds from the signal to node.sh's exit
    and the node's output."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(
        os.environ,
        NNODES="1",
        GPUS_PER_NODE="2",
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHON=sys.executable,
        COMMAND="train",
        OMP_NUM_THREADS="1",
        GRPO_EXIT_FILE=str(tmp_path / "exit-slurm"),
        GRPO_TEST_SLOW_ROLLOUT="0.5",
        GRPO_TEST_MARKS=str(marks),
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "tests" / "workers" / "slow_rollout"), str(REPO_ROOT)]),
    )
    args = [str(DEMO), *COMMON, "checkpoint.resume=auto", f"logging.run_dir={run_dir}"]
    node = subprocess.Popen(
        ["bash", str(REPO_ROOT / "launch/slurm/node.sh"), *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not (marks / "generate-0-2").exists():  # rank 0's 2nd generation: iteration 4's rollout
        assert node.poll() is None and time.monotonic() < deadline, node.communicate()[0][-4000:]
        time.sleep(0.05)
    time.sleep(1.0)  # inside it: six decoding steps of 0.5 s
    tree = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
    assert len(tree) >= 6, [p.cmdline()[:4] for p in tree]  # node.sh, torchrun, 2 ranks, their helpers
    signalled = time.monotonic()
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    out, _ = node.communicate(timeout=300)
    return time.monotonic() - signalled, out


@pytest.mark.timeout(1200)  # eight launches of the trainer, each 40-60 s on 2 busy cores
@pytest.mark.launches
def test_sigkill_then_sigterm_at_each_point_saves_and_the_reruns_resume_bit_exactly(tmp_path: Path):
    """One chain of launches into one run directory, each resuming from the checkpoint the one before
    left: a job SIGKILLed (its whole session, as a scheduler's preemption) once its checkpoint of
    iteration 2 is the latest; then Slurm's SIGTERM to every process of the job under node.sh in the
    middle of a rollout, after a checkpoint (the rollout is cut short, its batch dropped, the iteration
    before saved at once); then a SIGTERM at each later point; then a second signal during a save;
    then a plain rerun to the end. The chain's metrics equal an uninterrupted run's bitwise."""
    from grpo_megatron.checkpoint.integrity import verify_checkpoint
    from grpo_megatron.logging_utils.metrics import read_jsonl

    full = tmp_path / "full"
    finish(launch("train", [*COMMON, f"logging.run_dir={full}"]))

    cut = tmp_path / "cut"
    # SIGKILL after the checkpoint of iteration 2 (maybe during iteration 3, whose rows the resume drops)
    kill_after_checkpoint(launch("train", [*COMMON, f"logging.run_dir={cut}"]), cut, iteration=2)
    assert _latest(cut) == "iter_0000002"
    # iteration 4's rollout cut short: iteration 3 (not a periodic save) is saved, within seconds
    seconds, out = _slurm_sigterm_mid_rollout(cut, tmp_path)
    print(f"Slurm's SIGTERM mid-rollout: node.sh exited {seconds:.1f} s after it")
    assert "[node 0] stopped on a signal with a checkpoint written: exit 75" in out, out[-4000:]
    assert "SIGTERM during the rollout and reward of iteration 4: its batch is dropped" in out, out[-4000:]
    assert f"[preempt] SIGTERM: checkpoint {cut / 'checkpoints' / 'iter_0000003'} written" in out, out[-4000:]
    assert "BrokenPipeError" not in out and "SignalException" not in out, out[-4000:]
    assert _latest(cut) == "iter_0000003"
    assert verify_checkpoint(cut / "checkpoints" / "iter_0000003")["iteration"] == 3
    assert seconds < 30, (seconds, out[-3000:])  # a rollout cut short, one save: not the iteration's end
    # (point, signalled rank, the iteration whose checkpoint it leaves): sync is followed by a
    # checkpoint of its own iteration (the update changed the weights: the iteration ends first); 4
    # and 6 are periodic saves (train.save_interval=2), which the safe point does not repeat; the
    # SIGTERM during iteration 6's save lets the save finish.
    for point, rank, saved in (("train:1", 0, 4), ("sync:1", 1, 5), ("save:1", 0, 6)):
        started = time.monotonic()
        rc, code, out = _run(cut, point, rank)
        assert code == str(EXIT_PREEMPTED) and f"exitcode  : {EXIT_PREEMPTED}" in out, (
            point,
            rc,
            out[-4000:],
        )
        assert f"[preempt] SIGTERM: checkpoint {cut / 'checkpoints' / f'iter_{saved:07d}'} written" in out, (
            out[-4000:]
        )
        assert _latest(cut) == f"iter_{saved:07d}", point
        assert verify_checkpoint(cut / "checkpoints" / _latest(cut))["iteration"] == saved
        assert f"SIGTERM at the start of {point.split(':')[0]}" in out
        print(f"{point}: {time.monotonic() - started:.0f} s")

    # SIGTERM, then SIGUSR1, as iteration 7's save starts: rank 1 exits at once; `latest` still names 6
    rc, code, out = _run(cut, "save2:1", 1)
    assert rc != 0 and code == "" and f"exitcode  : {EXIT_INTERRUPTED}" in out, out[-4000:]
    assert "a second signal (SIGUSR1): exiting now" in out
    assert _latest(cut) == "iter_0000006"

    finish(launch("train", [*COMMON, f"logging.run_dir={cut}"]))
    want = [comparable(r) for r in read_jsonl(full / "metrics.jsonl")]
    got = [comparable(r) for r in read_jsonl(cut / "metrics.jsonl")]
    assert [r["iteration"] for r in got] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert got == want, json.dumps([got[-1], want[-1]], indent=1)
    assert _latest(cut) == "iter_0000007"


def test_a_signal_during_the_update_stops_it_at_the_next_mini_batch(tmp_path: Path):
    """Issue 51 item 5: two mini-batches per update (train.updates_per_iteration=2); SIGTERM on rank 0 as
    iteration 2's update starts: the first mini-batch's step is taken, the second skipped (every rank
    asks at the boundary), iteration 2 syncs, is logged with update/minibatches_skipped and saved, and
    every rank exits 75."""
    from grpo_megatron.checkpoint.integrity import verify_checkpoint
    from grpo_megatron.logging_utils.metrics import read_jsonl

    run_dir = tmp_path / "run"
    rc, code, out = _run(run_dir, "train:2", 0, extra=["train.updates_per_iteration=2", "train.iterations=4"])
    assert code == str(EXIT_PREEMPTED), out[-4000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1, 2], out[-3000:]
    assert "update/minibatches_skipped" not in rows[1] and rows[2]["update/minibatches_skipped"] == 1.0
    assert _latest(run_dir) == "iter_0000002" and verify_checkpoint(run_dir / "checkpoints" / "iter_0000002")


def test_signal_fields_are_validated_naming_them():
    from grpo_megatron.config import ConfigError, load_config, validate

    cfg = load_config(DEMO, ["checkpoint.signal=SIGKILL", "checkpoint.signal_grace_s=0"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 2)
    assert "checkpoint.signal='SIGKILL' must be one of SIGUSR1, SIGUSR2, SIGHUP, SIGINT, or null" in str(
        err.value
    )
    assert "checkpoint.signal_grace_s=0.0 must be a number of seconds > 0" in str(err.value)
    validate(load_config(DEMO, ["checkpoint.signal=null", "checkpoint.signal_grace_s=300"]), 2)


def _sbatch_until_preempted(env: dict[str, str], run_dir: Path) -> tuple[int, str]:
    """train.sbatch training the demo until its first iteration is logged, then SIGUSR1 to the script
    as Slurm's --signal=B:USR1@120 sends it; checks it exits 75 with a checkpoint: its iteration and the
    script's output."""
    proc = subprocess.Popen(
        [
            "bash",
            str(REPO_ROOT / "launch/slurm/train.sbatch"),
            str(DEMO),
            *COMMON,
            "train.iterations=50",
            f"logging.run_dir={run_dir}",
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and '"iteration": 1' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=300)
    node_log = "".join(
        p.read_text() for p in sorted(Path(env["LOG_DIR"]).glob("node*.log"))
    )  # rank 0's anywhere
    assert proc.returncode == EXIT_PREEMPTED, out + node_log[-3000:]
    assert "[preempt] SIGUSR1: checkpoint" in node_log and "exit 75 (rerun to resume)" in node_log, node_log
    assert "a second signal (" not in node_log  # the copies of the one signal counted once
    saved = int(_latest(run_dir).removeprefix("iter_"))
    assert 1 <= saved < 50
    return saved, out


@pytest.mark.launches
@pytest.mark.parametrize("branch", ["local", "slurm"])
def test_train_sbatch_forwards_the_early_warning_and_requeues(tmp_path: Path, branch: str):
    # launch/slurm/train.sbatch gets SIGUSR1; node.sh passes it to the ranks past torchrun, which exits 1
    # for any failed worker: the exit code 75 comes from rank 0's $GRPO_EXIT_FILE. "local": its
    # GRPO_LOCAL_TEST branch, one "node" of two ranks. "slurm": its srun line under tests/test_launch.py's
    # fake srun (which passes the signal to each task's process group, as Slurm signals a step) on two
    # "nodes" of one rank, and the job is requeued.
    from grpo_megatron.checkpoint.integrity import verify_checkpoint
    from tests.helpers.slurm import slurm_env

    run_dir = tmp_path / "run"
    if branch == "local":
        env = dict(
            os.environ,
            GRPO_LOCAL_TEST="1",
            NNODES="1",
            GPUS_PER_NODE="2",
            MASTER_PORT=str(free_port()),
            LOG_DIR=str(tmp_path / "logs"),
            OMP_NUM_THREADS="1",
            PYTHON=sys.executable,
        )
        env.pop("GRPO_EXIT_FILE", None)
    else:
        env = slurm_env(tmp_path)
    env["COMMAND"] = "train"
    saved, out = _sbatch_until_preempted(env, run_dir)
    assert verify_checkpoint(run_dir / "checkpoints" / _latest(run_dir))["iteration"] == saved
    if branch == "slurm":
        assert (tmp_path / "slurm.log").read_text() == "requeue 4242\n", out
        assert "requeueing job 4242" in out


_WRITER_CHILD = """
import os, sys
import psutil, torch, torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from grpo_megatron.checkpoint.dist import keep_writer_results_in_process
from grpo_megatron.distributed.megatron_compat import apply_megatron_compat
apply_megatron_compat("cpu")
dist.init_process_group("gloo", rank=0, world_size=1)
assert keep_writer_results_in_process() and not keep_writer_results_in_process()
assert filesystem_async._get_write_results_queue() is filesystem_async._results_queue  # megatron's own getter
for k in range(2):  # the second save as a preempted job's: after an earlier one
    w = torch.arange(6.0) + k
    os.makedirs(f"{sys.argv[1]}/{k}")
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", w)}, f"{sys.argv[1]}/{k}")
    assert psutil.Process().children(recursive=True) == [], psutil.Process().children(recursive=True)
    like = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(6))}
    got = dist_checkpointing.load(like, f"{sys.argv[1]}/{k}")
    assert torch.equal(got["w"], w), got
dist.destroy_process_group()
print("ok", flush=True)
"""


def test_megatrons_checkpoint_writer_keeps_no_helper_process_for_a_signal_to_kill(tmp_path: Path):
    """Issue 51 item 5: megatron-core's checkpoint writer kept a multiprocessing manager for its
    results (filesystem_async._results_queue) from the first save; Slurm's SIGTERM to every process
    killed it and the next save's put raised BrokenPipeError. Our saves are synchronous: the results
    stay in the rank's own queue, so saves after the first leave no process behind (nothing a signal
    could kill) and still write what loads back."""
    proc = subprocess.run(
        [sys.executable, "-c", _WRITER_CHILD, str(tmp_path)],
        cwd=REPO_ROOT,
        env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
