"""bench/gpu_check.py's SGLang stages cannot rot between GPU loans: the engine stage runs here on
SGLang's CPU engine (the same script, the tiny model), and the pass rules read what a GPU run writes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sglang_env import ENGINE_TIMEOUT_S, require_sglang_engine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import _gpu_check_sglang as stages  # noqa: E402
import gpu_check  # noqa: E402


@pytest.mark.launches
def test_the_sglang_engine_stage_passes_on_the_cpu_engine(tmp_path: Path) -> None:
    require_sglang_engine()
    cmd = [
        sys.executable,
        str(REPO / "bench" / "gpu_check.py"),
        "--device",
        "cpu",
        "--stages",
        "sglang_engine",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (stage,) = json.loads((tmp_path / "gpu_check.json").read_text())
    assert stage["name"] == "sglang_engine" and stage["status"] == "ok", stage
    steps = stage["details"]["steps"]
    assert steps["generate"]["tokens"] == 4 * 2 * 8  # prompts x samples x new tokens
    assert steps["score"]["max_abs_vs_hf"] <= stages.SCORE_LIMIT
    assert stage["details"]["resync_max_abs"] == 0.0  # the same weights sent again change nothing
    assert "| sglang_engine | ok |" in (tmp_path / "gpu_check.md").read_text()


def probe_json(**changes: object) -> dict:
    steps = {s: {"seconds": 0.1} for s in ("engine_start", "generate", "score", "sync", "release", "resume")}
    steps["generate"] |= {"routed": True}
    steps["score"] |= {"max_abs_vs_hf": 0.05}
    return {"steps": steps, "routes_expected": True, "resync_max_abs": 0.0} | changes


def test_engine_stage_rules() -> None:
    assert stages.engine_problems(probe_json(), rc=0) == []
    bad = probe_json(resync_max_abs=1e-3)
    bad["steps"]["score"]["max_abs_vs_hf"] = 0.5
    bad["steps"]["generate"]["routed"] = False
    del bad["steps"]["resume"]
    problems = stages.engine_problems(bad, rc=1)
    assert problems[0] == "exit 1" and "steps not reached: ['resume']" in problems
    assert "no routed experts returned" in problems and any("0.500 > 0.1" in p for p in problems)
    assert any("moved the scores" in p for p in problems)


def test_train_stage_rules() -> None:
    cached = {"offload/cached_free_bytes": 0.1 * 2**30}
    resident = [{"iteration": 0}] + [
        {"iteration": i, "mismatch/probe_abs_diff_max": 0.01} | cached for i in (1, 2, 3)
    ]
    replay = [{"iteration": i, "mismatch/probe_replay_abs_diff_max": 0.0} | cached for i in (1, 2, 3)]
    details = stages.train_details(resident, replay, replayed=True)
    assert details["resident_last"] == 3 and details["replay_iterations"] == 3
    assert stages.train_problems(details) == []
    # An r3 run whose probe replayed nothing (an H100, 2026-12-05: SGLang's score sent no routes) fails.
    unreplayed = [{k: v for k, v in r.items() if "replay" not in k} for r in replay]
    assert stages.train_problems(stages.train_details(resident, unreplayed, replayed=True)) == [
        "the r3 run's mismatch probe replayed no engine routes (mismatch/probe_replay_abs_diff_max "
        "missing): the engine's score returned none (rollout/sglang/protocol.py:score_routes)"
    ]
    assert stages.train_problems(stages.train_details(resident, unreplayed)) == []  # CPU: no r3
    held = stages.train_details(
        resident[:3], [r | {"offload/cached_free_bytes": 22.8 * 2**30} for r in replay]
    )
    problems = stages.train_problems(held)
    assert "the resumed run ended at iteration 2, not 3" in problems
    assert any("22.80 GiB of cached blocks" in p for p in problems)
    # Issue 51 item 1: a memory phase that drops its metric fails the stage (it was a NaN, skipped)
    dropped = [
        {k: v for k, v in r.items() if k != "offload/cached_free_bytes" or r["iteration"] != 2}
        for r in resident
    ]
    problems = stages.train_problems(stages.train_details(dropped, replay))
    assert problems == [
        "offload/cached_free_bytes missing from the resident run's rows of iterations [2]: a memory "
        "phase did not report its engine resume (training/offload.py)"
    ], problems
    nowhere = [{k: v for k, v in r.items() if k != "offload/cached_free_bytes"} for r in replay]
    assert math.isnan(stages.train_details(dropped[:1], nowhere)["cached_at_resume_gib"])
    assert any(
        "replay run's rows of iterations [1, 2, 3]" in p
        for p in stages.train_problems(stages.train_details(resident, nowhere))
    )


def test_the_smoke_stages_require_the_cached_bytes_of_every_engine_resume() -> None:
    import gpu_check

    records = [{"iteration": 0.0, "trainer_cached_free_bytes_at_resume": 0.0}, {"iteration": 1.0}]
    assert gpu_check.memory_metric_problems(records) == [
        "offload/cached_free_bytes missing at the engine resumes of iterations [1]"
    ]
    records[1]["trainer_cached_free_bytes_at_resume"] = 0.7 * 2**30
    assert gpu_check.memory_metric_problems(records) == [
        "the trainer held 0.70 GiB of cached blocks at an engine resume (> 0.5)"
    ]


def test_the_budget_stops_the_running_stage_and_the_table_is_written_into_out(tmp_path: Path) -> None:
    """Issue 51 item 1: the budget holds while a stage runs (its processes killed at the deadline, the
    stage "stopped"), the table is written after each stage, under $OUT when the caller has one."""
    import os

    env = dict(os.environ, OUT=str(tmp_path))
    cmd = [
        sys.executable,
        str(REPO / "bench" / "gpu_check.py"),
        "--device",
        "cpu",
        "--stages",
        "smoke,resume",
        "--budget-s",
        "4",
    ]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert time.monotonic() - start < 30, done.stdout[-2000:]
    assert done.returncode == 0, (
        done.stdout[-3000:] + done.stderr[-3000:]
    )  # stopped and skipped are no failure
    (out,) = tmp_path.glob("gpu_check-*")
    smoke, resume = json.loads((out / "gpu_check.json").read_text())
    assert smoke["status"] == "stopped" and smoke["seconds"] < 15, smoke
    assert smoke["summary"].startswith("stopped at the 4 s budget (--budget-s)"), smoke
    assert resume["status"] == "skipped" and "budget" in resume["summary"]
    assert "| smoke | stopped |" in (out / "gpu_check.md").read_text()


def test_on_policy_stage_reports_the_worst_of_each_mismatch_and_ratio() -> None:
    """The sglang_on_policy stage (issue 53 item 3): the largest of each mismatch, the smallest
    ratio_min, over the training iterations only (0 is the evaluation before training)."""
    rows = [
        {"iteration": 0, "mismatch/logprob_abs_diff_max": 9.0},
        {"iteration": 1, "mismatch/logprob_abs_diff_max": 0.02, "off_policy/ratio_min": 0.97},
        {"iteration": 2, "mismatch/logprob_abs_diff_max": 0.01, "off_policy/ratio_min": 0.95},
    ]
    got = stages.on_policy_summary(rows)
    assert got == {"mismatch/logprob_abs_diff_max": 0.02, "off_policy/ratio_min": 0.95}
    assert set(stages.ON_POLICY_SERVER_ARGS) == {"enable_deterministic_inference", "rl_on_policy_target"}


def test_true_on_policy_stage_requires_exactness_in_every_training_iteration() -> None:
    """The true_on_policy stage (issue 53 on a GPU): every iteration after 0 must have mismatch max 0.0
    and the ratio exactly 1; one that differs fails it, and so does a run without training rows."""
    exact = {"mismatch/logprob_abs_diff_max": 0.0, "off_policy/ratio_min": 1.0, "off_policy/ratio_max": 1.0}
    rows = [{"iteration": 0}, *({"iteration": i, **exact} for i in (1, 2, 3))]
    assert gpu_check.true_on_policy_verdict(rows)[0]
    rows[2] = {**rows[2], "mismatch/logprob_abs_diff_max": 3e-3, "off_policy/ratio_min": 0.997}
    ok, summary = gpu_check.true_on_policy_verdict(rows)
    assert not ok and "iterations [2]" in summary
    assert not gpu_check.true_on_policy_verdict([{"iteration": 0}])[0]
    assert "true_on_policy" in gpu_check.STAGES and "true_on_policy" in gpu_check.RUNNERS


def test_fp8_stage_rules() -> None:
    """The FP8 stage (rollout.weight_dtype=fp8 beside bf16): on this CPU it is skipped with its reason
    unless SGLang's CPU FP8 path can run (AMX); its pass rules read what a GPU run writes."""
    pytest.importorskip("sglang")
    why = stages.fp8_unsupported("cpu")
    assert stages.fp8_unsupported("cuda") is None and (why is None or "AMX" in why)

    def run(probe_mean: float, masked: bool = False) -> list[dict]:
        return [
            {
                "iteration": i,
                "mismatch/probe_abs_diff_max": probe_mean * 8,
                "mismatch/probe_abs_diff_mean": probe_mean,
                "sync/seconds": 0.2 * i if i > 1 else 5.0,
                "sync/bytes": 1e9,
            }
            | ({"off_policy/masked_frac": 0.01} if masked else {})
            for i in (1, 2, 3)
        ]

    details = stages.fp8_details(run(0.002), run(0.02, masked=True))
    assert details["fp8_sync_s"] == pytest.approx(0.5) and details["sync_ratio"] == pytest.approx(1.0)
    assert stages.fp8_problems(details) == []
    problems = stages.fp8_problems(stages.fp8_details(run(0.002)[:2], run(0.001)))
    assert "the bf16 run logged 2 iterations, not 3" in problems
    assert any("not above bf16's" in p for p in problems) and any("IcePop" in p for p in problems)
    assert any("> 0.5" in p for p in stages.fp8_problems(stages.fp8_details(run(0.0), run(0.9, True))))
