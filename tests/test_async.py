"""The asynchronous loop end to end (training/groups.py: GroupProducer): real megatron-core at EP2 on 2 processes,
each with its embedded engine in a process of its own (rollout/engine_process.py), the reward pool,
checkpoints on disk. A length reward gives every group reward variance, so the policy really moves
and a stale sample's ratio is not 1. Issue 41: engine processes lost (GRPO_ENGINE_FAULT, or a kill) during
a rollout or a weight sync are restarted in place, and past rollout.recovery.max_restarts the run ends naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_megatron.logging_utils.metrics import read_jsonl
from tests.helpers.runs import MOVING, comparable, finish, killed_and_resumed, launch

ASYNC = ["rollout.embedded_process=true"]


@pytest.mark.launches
def test_max_staleness_zero_in_engine_processes_equals_the_synchronous_run_bitwise(tmp_path, monkeypatch):
    # The asynchronous loop with max_staleness=0 in engine processes, which issue 41 also faults: rank 1's
    # engine process is SIGKILLed as it takes its 3rd generate request and rank 0's SIGSTOPped at its 4th
    # (rollouts of iterations 2 and 3); each is restarted in place, given the current weights, its share
    # generated again: the run equals the synchronous one bitwise. (A run of the same loop without the
    # faults, which this one covers with two restarts more, was dropped to keep the suite's time.)
    faults = ["rollout.recovery.max_restarts=2", "rollout.recovery.health_timeout_s=5"]
    runs = {"sync": [], "lost": [*ASYNC, "train.max_staleness=0", *faults]}
    outs = {}
    for name, extra in runs.items():
        if name == "lost":
            monkeypatch.setenv("GRPO_ENGINE_FAULT", "kill:3@1,stop:4@0")
        run = [*MOVING, *extra, "train.iterations=3", f"logging.run_dir={tmp_path / name}"]
        outs[name] = finish(launch("train", run))
    want = [comparable(r) for r in read_jsonl(tmp_path / "sync" / "metrics.jsonl")]
    got = [comparable(r) for r in read_jsonl(tmp_path / "lost" / "metrics.jsonl")]
    restarts = [(r.pop("engine/restarts", 0), r.pop("engine/restart_s", 0)) for r in got]
    assert sum(n for n, _ in restarts) == 2, restarts
    for r in got[1:]:
        assert (
            r.pop("async/staleness/max") == r.pop("async/staleness/min") == r.pop("async/staleness/mean") == 0
        )
        assert r.pop("async/drained_batches") == 0
    assert got == want, json.dumps([got[-1], want[-1]], indent=1)
    out = outs["lost"]
    assert "[engine] engine 1 (rank 1 on" in out and "exited with code -9" in out, out[-4000:]
    assert "[engine] engine 0 (rank 0 on" in out and "(it is stopped: state T)" in out, out[-4000:]


@pytest.mark.launches
def test_more_engine_losses_than_the_bound_end_the_run_naming_them(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_ENGINE_FAULT", "kill:1")  # both engines, at the first rollout
    proc = launch(
        "train",
        [
            *MOVING,
            *ASYNC,
            "rollout.recovery.max_restarts=1",
            "train.iterations=2",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
    )
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "2 engine(s) lost, past rollout.recovery.max_restarts=1 (0 restart(s) so far)" in out, out[-4000:]
    for engine in (0, 1):
        assert f"engine {engine} (rank {engine} on" in out
    assert "exited with code -9" in out and "its log (" in out
    log = tmp_path / "run" / "engines" / "engine-process-rank1.log"  # kept in the run directory
    assert f"its log ({log})" in out and "--- engine process of rank 1, life 0 ---" in log.read_text()


@pytest.mark.launches
def test_one_step_off_lags_by_at_most_one_version_and_resumes_with_the_same_rules(tmp_path):
    # r3: each batch's routes stay held on the engines' ranks until its iteration's plan, while the next
    # batch's are held too; the checkpoint at iteration 2 copies a submitted batch's held routes.
    common = [
        *MOVING,
        *ASYNC,
        "train.max_staleness=1",
        "algorithm.off_policy.correction=icepop",
        "train.iterations=4",
        "checkpoint.save_interval=2",
        "algorithm.routing_replay=r3",
        "logging.samples_interval=1",
    ]
    full = tmp_path / "full"
    finish(launch("train", [*common, f"logging.run_dir={full}"]))
    records = read_jsonl(full / "metrics.jsonl")[1:]
    # Iteration k trains version k-1 on samples of version max(0, k-2): lag 0 first, then exactly 1.
    assert [r["async/staleness/max"] for r in records] == [0, 1, 1, 1]
    assert [r["async/staleness/min"] for r in records] == [0, 1, 1, 1]
    # an engine process loads weights between two requests: no batch is collected early for a sync
    assert [r["async/drained_batches"] for r in records] == [0, 0, 0, 0]
    stale = records[-1]  # the policy moved since the samples' version: their ratio is not 1
    assert stale["off_policy/ratio_max"] > 1 > stale["off_policy/ratio_min"]
    assert 0 <= stale["off_policy/masked_frac"] < 1

    got = killed_and_resumed(common, tmp_path / "cut")
    want = [comparable(r) for r in read_jsonl(full / "metrics.jsonl")]
    assert [r["iteration"] for r in got] == [0, 1, 2, 3, 4]
    assert got == want, json.dumps([got[-1], want[-1]], indent=1)

    # The checkpoint of iteration 2 resumed by the synchronous loop: the prompts of its two submitted
    # batches (iterations 3 and 4) go back to the sampler, so iteration 3 trains the same prompts.
    sync = tmp_path / "sync"
    out = finish(
        launch(
            "train",
            [
                *MOVING,
                "train.iterations=3",
                "algorithm.routing_replay=r3",
                "logging.samples_interval=1",
                f"checkpoint.resume={full / 'checkpoints' / 'iter_0000002'}",
                f"logging.run_dir={sync}",
            ],
        )
    )
    assert "the prompts of its 2 submitted batches are generated again" in out

    def prompts(run: Path, iteration: int) -> list[str]:
        return [r["prompt"] for r in read_jsonl(run / "samples.jsonl") if r["iteration"] == iteration]

    assert prompts(sync, 3) == prompts(full, 3) and len(prompts(full, 3)) == 4
    assert prompts(sync, 3) != prompts(full, 4)


@pytest.mark.launches
def test_engine_process_serves_each_request_with_the_weights_sent_before_it(tmp_path):
    # Two requests in flight around a weight update: the first is served with version 1, the second
    # with version 2, whatever the timing; version 1's completions equal an in-process engine's bitwise.
    import torch

    from grpo_megatron.rollout.engine import SamplingParams
    from grpo_megatron.rollout.engine_process import EngineProcess
    from tests.helpers.engines import load_weights as _load
    from tests.helpers.engines import saved_model as _saved
    from tests.helpers.engines import tiny_engine as _engine
    from tests.helpers.tiny_configs import tiny_hf_config

    saved, _ = _saved("qwen3_moe", tmp_path)
    remote = EngineProcess(tiny_hf_config("qwen3_moe"), dtype=torch.float32, threads=1)
    prompts, params = [[3, 5, 7], [11, 2]], SamplingParams(n=2, max_new_tokens=5, seed=3, routes=True)
    try:
        remote.update_weights(sorted(saved.items()), version=1, last=True)
        first = remote.submit(prompts, params)
        remote.update_weights([(n, t + 0.01) for n, t in sorted(saved.items())], version=2, last=True)
        second = remote.submit(prompts, params)
        got_2, got_1 = second(), first()
    finally:
        remote.shutdown()
    assert {c.weight_version for g in got_1 for c in g} == {1}
    assert {c.weight_version for g in got_2 for c in g} == {2}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = _engine("qwen3_moe")
        _load(local, saved)
        want = local.generate(prompts, params)
    finally:
        torch.set_num_threads(threads)
    for g_got, g_want in zip(got_1, want, strict=True):
        for c, w in zip(g_got, g_want, strict=True):
            assert (c.token_ids, c.logprobs, c.finish_reason) == (w.token_ids, w.logprobs, w.finish_reason)
            assert w.routed_experts is not None and torch.equal(c.routed_experts, w.routed_experts)
    assert [c.logprobs for g in got_2 for c in g] != [c.logprobs for g in got_1 for c in g]


@pytest.mark.launches
def test_the_fleet_restarts_engines_lost_before_or_during_a_sync_or_a_rollout(tmp_path):
    from tests.helpers.dist import run_distributed
    from tests.helpers.engines import write_config as _write_config
    from tests.helpers.tiny_configs import tiny_hf_config

    moe = _write_config(tmp_path / "moe", tiny_hf_config("qwen3_moe"))
    per_rank = run_distributed(
        "tests.workers.rollout_workers:engines_lost_and_restarted", 2, timeout_s=300, hf_dir=moe
    )
    for res in per_rank:
        assert res["after_sync_restart"] == 1 and res["restarts"] == 3, res
        assert res["same"] and res["versions"] == [2] and res["versions_3"] == [3], res
        assert res["metrics"]["engine/restarts"] == 3 and res["metrics"]["engine/restart_s"] > 0
        assert "past rollout.recovery.max_restarts=3 (3 restart(s) so far)" in res["past_bound"]
        assert "code -9" in res["past_bound"] and "its log (" in res["past_bound"]  # the kill, named
