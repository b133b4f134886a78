"""The asynchronous loop end to end (training/async_loop.py): real megatron-core at EP2 on 2 processes,
each with its embedded engine in a process of its own (rollout/engine_process.py), the reward pool,
checkpoints on disk. A length reward gives every group reward variance, so the policy really moves
and a stale sample's ratio is not 1."""

from __future__ import annotations

import json
import os
import signal
import time

from grpo_megatron.logging_utils.metrics import read_jsonl
from tests.test_train import SMALL, comparable, finish, launch

MOVING = [*SMALL, "reward.components=[{name: len, function: length, kwargs: {target_chars: 6}}]", "train.lr=1e-3"]
ASYNC = ["rollout.embedded_process=true"]


def test_max_staleness_zero_in_engine_processes_equals_the_synchronous_run_bitwise(tmp_path):
    runs = {"sync": [], "async0": [*ASYNC, "train.max_staleness=0"]}
    for name, extra in runs.items():
        finish(launch("train", [*MOVING, *extra, "train.iterations=3", f"logging.run_dir={tmp_path / name}"]))
    want = [comparable(r) for r in read_jsonl(tmp_path / "sync" / "metrics.jsonl")]
    got = [comparable(r) for r in read_jsonl(tmp_path / "async0" / "metrics.jsonl")]
    for r in got[1:]:
        assert r.pop("async/staleness/max") == r.pop("async/staleness/min") == r.pop("async/staleness/mean") == 0
    assert got == want, json.dumps([got[-1], want[-1]], indent=1)


def test_one_step_off_lags_by_at_most_one_version_and_resumes_with_the_same_rules(tmp_path):
    common = [*MOVING, *ASYNC, "train.max_staleness=1", "algorithm.off_policy.correction=icepop",
              "train.iterations=4", "checkpoint.save_interval=2"]  # fmt: skip
    full = tmp_path / "full"
    finish(launch("train", [*common, f"logging.run_dir={full}"]))
    records = read_jsonl(full / "metrics.jsonl")[1:]
    # Iteration k trains version k-1 on samples of version max(0, k-2): lag 0 first, then exactly 1.
    assert [r["async/staleness/max"] for r in records] == [0, 1, 1, 1]
    assert [r["async/staleness/min"] for r in records] == [0, 1, 1, 1]
    stale = records[-1]  # the policy moved since the samples' version: their ratio is not 1
    assert stale["off_policy/ratio_max"] > 1 > stale["off_policy/ratio_min"]
    assert 0 <= stale["off_policy/masked_frac"] < 1

    cut = tmp_path / "cut"
    proc = launch("train", [*common, f"logging.run_dir={cut}"])
    latest = cut / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not (latest.is_file() and latest.read_text().strip().endswith("2")):
        assert proc.poll() is None or latest.is_file(), proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "no checkpoint at iteration 2"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # engine processes included: they are in the job's session
    proc.communicate()
    finish(launch("train", [*common, f"logging.run_dir={cut}", "checkpoint.resume=auto"]))
    want = [comparable(r) for r in read_jsonl(full / "metrics.jsonl")]
    got = [comparable(r) for r in read_jsonl(cut / "metrics.jsonl")]
    assert [r["iteration"] for r in got] == [0, 1, 2, 3, 4]
    assert got == want, json.dumps([got[-1], want[-1]], indent=1)
