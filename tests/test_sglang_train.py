"""``grpo-megatron train`` with ``rollout.engine=sglang`` on 2 CPU ranks: SGLang's real engine
colocated with the trainer (one engine per rank), the trainer offloaded around it (SFT, in-place
restarts) or generating one step ahead, checkpoints, one engine's scheduler killed after a checkpoint
(the job ends within a minute naming the engine, its rank, host and last log lines), and the same
command again resuming and finishing. Nothing SGLang-specific is set: on a CPU
job the engine's device and CPU arguments follow from the job."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from grpo_megatron.logging_utils.metrics import read_jsonl
from tests.helpers.dist import free_port
from tests.helpers.runs import SMALL, can_name_hosts, finish, launch, launch_node
from tests.sglang_env import require_sglang_engine

pytestmark = pytest.mark.launches  # every test here: a job, the real engine or ranks of their own

SGLANG = ["rollout.engine=sglang", "rollout.sglang.cpu_path=torch_native"]
"""These jobs train the demo in fp32: on a CPU with AMX SGLang's intel_amx path serves no fp32
(rollout/sglang/cpu_path.py), so their engines take its torch-native path there too (elsewhere the
setting changes nothing); tests/test_sglang_real.py runs the intel_amx path in bf16."""

PROBE_BOUND = 1e-4
"""The demo trains in fp32 and the engine serves fp32: the mismatch probe sits at float32 rounding
(seen: 5e-7), far inside the bf16 floor (3.7e-2, tests/test_sglang_real.py)."""


def _find_scheduler(pid: int) -> psutil.Process:
    """An SGLang scheduler under ``pid`` (processes come and go while the tree is walked)."""
    for _ in range(20):
        with contextlib.suppress(psutil.NoSuchProcess):
            for proc in psutil.Process(pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    if proc.name().startswith("sglang::sched"):
                        return proc
        time.sleep(0.2)
    raise AssertionError("no SGLang scheduler under the job")


def kill_tree(pid: int) -> list[psutil.Process]:
    """SIGKILL ``pid`` and every process under it (torchrun starts each rank in a session of its
    own, so a process-group kill leaves the ranks running); returns them all."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:  # ended already
        return []
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(tree, timeout=30)
    return tree


def _wait_for_checkpoint(proc, latest: Path, iteration: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if latest.is_file() and latest.read_text().strip() == f"iter_{iteration:07d}":
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"the run ended ({proc.returncode}) before checkpoint {iteration}:\n{proc.stdout.read()[-4000:]}"
            )
        time.sleep(0.5)
    kill_tree(proc.pid)
    raise AssertionError(f"no checkpoint {iteration} after {timeout_s} s")


def test_colocated_sglang_one_step_off_lags_by_one_version_ends_when_its_engine_dies_and_resumes(
    tmp_path: Path,
) -> None:
    """train.max_staleness=1 with the real engine: SGLang's schedulers generate the next batch while
    the trainer trains (collected before each weight sync, which would wait for it), nothing swaps, and
    every trained sample lags the trained policy by exactly the bound once the pipeline is full. One engine's
    scheduler is killed after the checkpoint of iteration 3 (as by the OOM killer; rollout.recovery.max_restarts
    is 0): the job ends within a minute naming the engine, its rank, host and last log lines, leaving no
    process behind; the same command again resumes it (the submitted batches kept in the checkpoint)
    and finishes it by the same rules. A save waits for the batch in flight (to keep it), so the sync
    after a save finds none to drain; iterations 4 to 6 leave the kill time to land before the engine's
    last use (a kill during the last save would go unnoticed)."""
    require_sglang_engine()
    from tests.helpers.runs import MOVING

    run = tmp_path / "run"
    overrides = [
        *MOVING,
        *SGLANG,
        "train.max_staleness=1",
        "algorithm.off_policy.correction=icepop",
        "train.iterations=6",
        "checkpoint.save_interval=3",
        f"logging.run_dir={run}",
    ]
    first = launch("train", overrides)
    _wait_for_checkpoint(first, run / "checkpoints" / "latest", 3, timeout_s=400)
    # An engine dies (as with the OOM killer): its scheduler, killed during iteration 4 or 5.
    scheduler = _find_scheduler(first.pid)
    job = [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]
    killed_at = time.monotonic()
    scheduler.kill()
    try:
        out, _ = first.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_tree(first.pid)
        raise AssertionError("the job outlived its dead engine by 60 s") from None
    assert time.monotonic() - killed_at < 60
    assert first.returncode != 0
    # Named either by the rank's SIGQUIT handler (SGLang's watchdog came first) or, one type of error
    # for a lost engine (EngineLost), by the recovery past its bound of 0: engine, rank, host, process, log.
    died = r"the SGLang engine of rank \d on \S+ died: process sglang::scheduler\S* \(pid \d+\)"
    lost = (
        r"engine\(s\) lost, past rollout.recovery.max_restarts=0 .*\n  engine \d \(rank \d on \S+\) was lost: "
        r"process sglang::scheduler\S* \(pid \d+\)"
    )
    assert re.search(died, out) or re.search(lost, out), out[-4000:]
    assert ("Last lines of its log" in out and "run the same command again to resume" in out) or (
        "its log (" in out and "resume from the last checkpoint" in out
    ), out[-4000:]
    time.sleep(2)
    left = [p for p in job if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, left  # nothing of the job is left behind (reward workers, writer managers, engines)

    out = finish(launch("train", overrides), timeout_s=400)
    resumed = re.search(r"\[checkpoint\] resumed from \S*iter_(\d+) \(iteration (\d+)\)", out)
    assert resumed and int(resumed.group(2)) == 3, out[-4000:]  # killed after 3, before 6
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    probes = [
        r["mismatch/probe_abs_diff_max"] for r in records if r.get("mismatch/probe_abs_diff_max") is not None
    ]
    assert probes and max(probes) < PROBE_BOUND, probes
    assert (run / "summary.json").is_file()
    records = records[1:]
    assert [r["async/staleness/max"] for r in records] == [0, 1, 1, 1, 1, 1], out[-3000:]
    assert [r["async/staleness/min"] for r in records] == [0, 1, 1, 1, 1, 1]
    # SGLang's weight load waits for the generation in flight: the next batch (in flight at each sync
    # but the last and the one after the save of iteration 3) is collected before the sync stream
    # starts, under the rollout's long phase
    assert [r["async/drained_batches"] for r in records] == [1, 1, 1, 0, 1, 0]
    assert not any(k.startswith("offload/") for r in records for k in r)  # the engines kept their memory
    stale = records[-1]
    assert stale["off_policy/ratio_max"] > 1 > stale["off_policy/ratio_min"]


def test_sft_with_the_sglang_engine_syncs_and_evaluates_through_the_memory_phases(tmp_path: Path) -> None:
    """Issue 36 item 4: ``grpo-megatron sft`` with the real colocated engine. Its engines start, then
    release their memory for training; every dev evaluation's weight sync must bring it back first
    (the same function as GRPO's sync: training/phases/sync.py:sync_weights), and the next step must
    take it again (with the trainer offloaded around them too)."""
    require_sglang_engine()
    sft_dir, hf_dir = tmp_path / "sft", tmp_path / "sft" / "hf"
    finish(
        launch(
            "sft",
            [
                *SMALL,
                *SGLANG,
                "train.offload_trainer=true",
                "sft.max_steps=2",
                "sft.eval_interval=1",
                "sft.batch_size=8",
                f"logging.run_dir={sft_dir}",
                f"sft.output_dir={hf_dir}",
            ],
        ),
        timeout_s=400,
    )
    records = read_jsonl(sft_dir / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert all(r["eval/accuracy"] is not None for r in records)
    assert list(hf_dir.glob("*.safetensors"))


def _sigterm_every_rank_process(agents: list[subprocess.Popen]) -> None:
    """Slurm's preemption: SIGTERM to every rank of each torchrun agent and to everything under them
    (engine processes included); the agents themselves are left out, as Slurm's job step reaches the ranks."""
    ranks = [r for agent in agents for r in psutil.Process(agent.pid).children()]
    for p in [q for r in ranks for q in (r, *r.children(recursive=True))]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)


def test_a_two_node_engine_restarts_both_parts_in_place_and_saves_on_a_slurm_sigterm(
    tmp_path: Path, monkeypatch
) -> None:
    """Issues 36 (item 8) and 41, as a cluster runs them: one SGLang engine (rollout.sglang.tp=2) over two
    one-GPU "nodes", each its own torchrun agent with a host name of its own (tests/helpers/runs.py:
    ``launch_node``). Rank 1 starts node 1's part of the engine as the leader starts its own (its log,
    its health, SIGTERM ignored in its processes). After two iterations node 1's scheduler (SGLang TP
    rank 1, a child of rank 1, which the leader's processes do not include) is SIGKILLed from outside,
    wherever the run is: the engine is lost, and with rollout.recovery.max_restarts=1 both parts restart
    in place at a fresh address (the leader's, SGLangEngine.restart_address), are given the last synced
    version and the run goes on without a restore. Then a Slurm preemption's SIGTERM to every process
    of both nodes saves one checkpoint and both nodes exit 75 (SGLang's own SIGTERM handling neither
    kills a rank nor lets it leave with status 0). (Before: node 1's schedulers took SGLang's CUDA
    paths on a CPU job, and its part failed at ``freeze_gc``, which only the leader's part can take;
    engines across nodes were refused with restarts.)"""
    require_sglang_engine()
    if (why := can_name_hosts()) is not None:
        pytest.skip(f"two nodes on one host need host names of their own: {why}")
    from grpo_megatron.distributed.preemption import EXIT_FILE_ENV, EXIT_PREEMPTED

    run, exit_file = tmp_path / "run", tmp_path / "exit_code"
    monkeypatch.setenv(EXIT_FILE_ENV, str(exit_file))  # what launch/slurm/node.sh reads: rank 0's verdict
    # rollout.sglang.ep=1: SGLang's CPU MoE (moe_forward_native) cannot take expert parallelism's -1 expert ids
    overrides = [
        *SMALL,
        *SGLANG,
        "rollout.sglang.tp=2",
        "rollout.sglang.ep=1",
        "rollout.recovery.max_restarts=1",
        "rollout.recovery.health_timeout_s=60",
        "train.iterations=40",
        "checkpoint.save_interval=20",
        f"logging.run_dir={run}",
    ]
    port = free_port()
    nodes = [launch_node("train", overrides, node_rank=k, nnodes=2, port=port) for k in (0, 1)]

    def records_until(done, what: str) -> list[dict]:
        deadline = time.monotonic() + 400
        while True:
            records = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
            if done(records):
                return records
            if any(n.poll() is not None for n in nodes) or time.monotonic() > deadline:
                outs = [(kill_tree(n.pid), n.stdout.read())[1] for n in nodes]
                raise AssertionError(f"{what}:\n" + "\n=====\n".join(outs))
            time.sleep(0.5)

    records_until(lambda rs: len(rs) >= 3, "no second iteration")
    assert list((run / "sglang").glob("engine-rank1-*.log")), (
        "node 1's part of the engine logs beside the leader's"
    )
    _find_scheduler(nodes[1].pid).kill()  # node 1's only scheduler: SGLang TP rank 1
    restarted = records_until(
        lambda rs: any(r.get("engine/restarts", 0) for r in rs[3:]) and len(rs) >= 6,
        "no restart and two more iterations after node 1's scheduler was killed",
    )
    _sigterm_every_rank_process(nodes)
    outs = []
    for node in nodes:
        try:
            outs.append(node.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for n in nodes:
                kill_tree(n.pid)
            raise AssertionError("the job did not stop within 300 s of the SIGTERM") from None
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["iteration"] for r in records] == list(range(len(records))), "no restore: every iteration once"
    assert sum(r.get("engine/restarts", 0) for r in records) == 1 and len(restarted) >= 6
    assert outs[1].count("[rollout] SGLang engine of rank 1 (node 1 of 2)") == 2, outs[1][-4000:]
    assert outs[0].count("[rollout] SGLang engine of rank 0 (node 0 of 2)") == 2, outs[0][-4000:]
    # node 1's loss is named with its own process and log (the recovery asks each further node's part),
    # beside the leader's when its TP rank 0 scheduler failed on the broken TP group first (every run seen)
    assert re.search(
        r"\[engine\] engine 0 \(rank 1 on \S+\) lost during .*scheduler_TP1 .*restarted", outs[0]
    )
    for out in outs:
        assert f"exitcode  : {EXIT_PREEMPTED}" in out and "died" not in out, out[-4000:]
    assert exit_file.read_text().strip() == str(EXIT_PREEMPTED)
    saved = re.search(r"\[preempt\] SIGTERM: checkpoint \S+(iter_\d+) written", outs[0])
    assert saved and (run / "checkpoints" / "latest").read_text().strip() == saved.group(1), outs[0][-4000:]


def test_a_colocated_sglang_engine_of_two_gpus_killed_or_stopped_in_a_rollout_or_a_sync_restarts_in_place(
    tmp_path: Path, monkeypatch
) -> None:
    """Issue 41 with the real engine, on an engine of two "GPUs" (rollout.sglang.tp=2 over the 2 ranks:
    rank 0 leads it, rank 1 is its member; the one-GPU engine's path is the same with groups of one).
    Faults from GRPO_ENGINE_FAULT (read by SGLangEngine, generations counted over the engine's lives,
    each fault once; always the last TP rank's scheduler, on the member's GPU):
    - in iteration 1's rollout (the 2nd generation, after the first evaluation) it is SIGKILLed as the
      request goes to it. The leader, whose processes include every TP rank's scheduler, finds it
      lost; the whole engine is shut down and started again with both TP ranks in rank 0's process,
      the last synced version streamed into both GPUs (the member feeds its share) and the engine's
      share generated again (same prompts and seeds);
    - the restarted one is SIGKILLed between the 1st and 2nd of the buckets of version 1's sync: the
      member's failed round counts as the engine's loss, which restarts inside the sync and is sent
      that version alone;
    - in iteration 2's rollout (the 4th generation) it is SIGSTOPped: past
      rollout.recovery.health_timeout_s (3 s) the engine is lost (stopped, or its TP rank 0 left waiting
      on it and a state request unanswered) and restarts the same way.
    The run trains every iteration on its whole batch, the samples' logprobs and the mismatch probe
    (engine vs trainer, after the last sync) stay at float32 rounding, and no checkpoint is restored."""
    require_sglang_engine()
    monkeypatch.setenv("GRPO_ENGINE_FAULT", "kill:2@0,killsync:1@0,stop:4@0")
    run = tmp_path / "run"
    # rollout.sglang.ep=1: SGLang's CPU MoE (moe_forward_native) cannot take expert parallelism's -1 expert ids
    out = finish(
        launch(
            "train",
            [
                *SMALL,
                *SGLANG,
                "rollout.sglang.tp=2",
                "rollout.sglang.ep=1",
                "train.offload_trainer=true",
                "train.iterations=2",
                "rollout.recovery.max_restarts=3",
                "rollout.sync_bucket_mb=1",
                "rollout.recovery.health_timeout_s=3",
                "logging.samples_interval=1",
                f"logging.run_dir={run}",
            ],
        ),
        timeout_s=500,
    )
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [0, 1, 2]
    # every prompt of each batch trained (4 x 4 samples: collect refuses a batch short of a share)
    samples = [r["iteration"] for r in read_jsonl(run / "samples.jsonl")]
    assert [samples.count(i) for i in (1, 2)] == [4, 4]
    # the restarted engine sampled with the trained weights (the last synced version, streamed into both GPUs)
    assert max(r["mismatch/logprob_abs_diff_max"] for r in records[1:]) < PROBE_BOUND
    assert [r.get("engine/restarts", 0) for r in records] == [0, 2, 1], out[-4000:]
    # the kill came as its 2nd bucket arrived (each GPU receives its share: 2 buckets of 1 MiB on the leader)
    assert records[1]["sync/buckets"] >= 2
    lost = r"\[engine\] engine 0 \(rank 0 on \S+\) lost during {}: [^\n]*process sglang::scheduler_TP1 \(pid \d+\) "
    assert re.search(lost.format("rollout generate") + "(exited with status -9|is gone)", out), out[-4000:]
    assert re.search(
        lost.format("the weight sync of version 1") + r"(exited with status -9|is gone)[^\n]*; "
        r"restarted for weights version 1",
        out,
    ), out[-4000:]
    stopped = lost.format("rollout generate").split(": ")[0] + r": [^\n]*(stopped \(state T\)|unanswered)"
    assert re.search(stopped, out), out[-4000:]
    assert "resumed from" not in out
    probes = [r.get("mismatch/probe_abs_diff_max") for r in records]
    probes = [p for p in probes if p is not None]
    assert probes and max(probes) < PROBE_BOUND, probes
    log = next((run / "sglang").glob("engine-rank0-*.log")).read_text()
    assert "--- SGLang engine of rank 0, life 3 (restarted in place) ---" in log
    print(json.dumps([{k: r.get(k) for k in ("engine/restart_s", "time/iteration")} for r in records]))
    print("\n".join(line[:200] for line in out.splitlines() if "[engine]" in line))
