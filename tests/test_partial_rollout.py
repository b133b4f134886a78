"""Continuous generation with partial rollouts (training/partial.py): the pool's segments, per-token
versions and behaviour logprobs with the real embedded engine on a tiny random model, the staleness
policy, oldest-first taking, the pool's JSON round trip and the config's refusals. The job-level
run (overlapped rounds, per-token versions in the dump, resume equal to the uninterrupted run) is the
last test."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpo_megatron.rollout.engine import Completion, SamplingParams
from grpo_megatron.rollout.engine_process import completions_from_json, completions_to_json
from grpo_megatron.training.partial import (
    PartialPool,
    PartialResponse,
    collect_round,
    submit_round,
    take_metrics,
)
from tests.helpers.tiny_configs import tiny_hf_config

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def engine_and_weights():
    """A tiny dense embedded engine and two weight versions of it (1: random, 2: perturbed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_megatron.rollout.embedded import EmbeddedEngine

    hf = tiny_hf_config("qwen2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    v1 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    v2 = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in v1.items()}
    engine = EmbeddedEngine(hf, device="cpu", dtype=torch.float32)
    return engine, {1: v1, 2: v2}


def _load(engine, weights: dict[str, torch.Tensor], version: int) -> None:
    names = sorted(n for n in weights if n in engine.expected_tensors())
    engine.update_weights([(n, weights[n]) for n in names], version=version, last=True)


def _round(pool: PartialPool, engine, seed: int) -> None:
    """One segment round, as the source runs it (``submit_round``), straight to the engine."""
    submit = lambda rows, inputs, params: engine.submit(inputs, params)  # noqa: E731
    collect_round(
        pool, submit_round(pool, lambda index: PROMPTS[index], submit, SamplingParams(n=1, seed=seed))
    )


def test_responses_continue_across_versions_with_each_tokens_version_and_logprob(engine_and_weights):
    engine, weights = engine_and_weights
    pool = PartialPool(n=2, segment_tokens=2, max_new_tokens=5, max_staleness=2, size=2)
    pool.top_up([0, 1])
    _load(engine, weights[1], 1)
    _round(pool, engine, seed=11)
    assert [len(r.token_ids) for g in pool.groups for r in g.responses] == [2, 2, 2, 2]
    assert pool.complete() == 0
    _load(engine, weights[2], 2)  # the weight update between two segments
    _round(pool, engine, seed=12)
    _round(pool, engine, seed=13)  # the last segment: min(K, budget left) = 1 token
    assert pool.complete() == 2
    for g in pool.groups:
        for r in g.responses:
            assert r.finish_reason == "length" and r.versions == [1, 1, 2, 2, 2]
            c = r.completion()
            assert c.token_versions == [1, 1, 2, 2, 2] and c.weight_version == 1 and c.versions == r.versions
    # each behaviour logprob is its token's under the version that sampled it (teacher-forced)
    sequences = [[*PROMPTS[g.index], *r.token_ids] for g in pool.groups for r in g.responses]
    lens = [len(PROMPTS[g.index]) for g in pool.groups for _ in g.responses]
    by_version = {}
    for version in (1, 2):
        _load(engine, weights[version], version)
        by_version[version] = engine.score(sequences, lens, 1.0)
    for k, r in enumerate(r for g in pool.groups for r in g.responses):
        want = [by_version[v][k][t] for t, v in enumerate(r.versions)]
        assert r.logprobs == pytest.approx(want, abs=1e-4)
    assert take_metrics(3, pool.take(2)) == {
        "partial/staleness/mean": pytest.approx((2 * 2 + 3 * 1) / 5),
        "partial/staleness/max": 2.0,
        "partial/mixed_versions_frac": 1.0,
    }


def _filled(pool: PartialPool, index: int, versions: list[list[int]], finished: bool) -> None:
    pool.top_up([index])
    for r, vs in zip(pool.groups[-1].responses, versions, strict=True):
        r.token_ids, r.logprobs, r.versions = [7] * len(vs), [-0.5] * len(vs), list(vs)
        r.finish_reason = "stop" if finished else None


def test_staleness_policy_regenerates_from_scratch_and_never_drops():
    pool = PartialPool(n=2, segment_tokens=2, max_new_tokens=4, max_staleness=1, size=3)
    _filled(pool, 0, [[3, 3], [4, 5]], finished=True)  # lags at version 5: 2 (stale) and 1
    _filled(pool, 1, [[4], [5]], finished=False)
    _filled(pool, 2, [[], []], finished=False)
    assert pool.regenerate_stale(5) == 1
    first = pool.groups[0].responses
    assert first[0] == PartialResponse() and first[1].versions == [4, 5]  # only the stale one restarts
    assert [g.index for g in pool.groups] == [0, 1, 2] and not pool.groups[0].complete
    assert pool.regenerate_stale(5) == 0 and pool.regenerate_stale(6) == 2  # [4, 5] and [4]


def test_take_is_oldest_complete_first_not_quickest():
    pool = PartialPool(n=1, segment_tokens=2, max_new_tokens=4, max_staleness=1, size=3)
    _filled(pool, 10, [[1]], finished=False)  # serial 0, a long response still going
    _filled(pool, 11, [[1]], finished=True)
    _filled(pool, 12, [[1]], finished=True)
    assert [g.index for g in pool.take(1)] == [11]
    pool.groups[0].responses[0].finish_reason = "length"  # the long one ends after 12 did
    assert [g.index for g in pool.take(1)] == [10]
    assert [g.index for g in pool.groups] == [12]


def test_pool_and_completions_round_trip_json_exactly():
    pool = PartialPool(n=2, segment_tokens=2, max_new_tokens=4, max_staleness=1, size=2)
    _filled(pool, 3, [[1, 2], [2]], finished=False)
    pool.groups[0].responses[0].logprobs = [-1 / 3, math.nextafter(-0.1, 0)]
    back = PartialPool(n=2, segment_tokens=2, max_new_tokens=4, max_staleness=1, size=2)
    back.load_json(json.loads(json.dumps(pool.to_json())))
    assert back == pool
    c = Completion([5, 6], [-1 / 3, -0.25], "stop", weight_version=1, token_versions=[1, 2])
    ((got,),) = completions_from_json(json.loads(json.dumps(completions_to_json([[c]]))))
    assert got.token_versions == [1, 2] and got.logprobs == c.logprobs
    ((plain,),) = completions_from_json(
        completions_to_json([[Completion([5], [-1.0], "stop", weight_version=3)]])
    )
    assert plain.token_versions is None and plain.versions == [3]


def test_partial_rollout_dump_keeps_each_tokens_version():
    from grpo_megatron.data import PromptRecord
    from grpo_megatron.training.phases.reward import Group
    from grpo_megatron.training.rollout_dump import decode_groups, encode_groups

    record = PromptRecord("1+1=", "2", {}, (1, 2))
    mixed = Completion([5, 6, 7], [-0.5, -0.25, -0.125], "stop", weight_version=2, token_versions=[2, 2, 3])
    one = Completion([8], [-1.0], "length", weight_version=3)
    tensors, meta = encode_groups([Group(record, [mixed, one], [1.0, 0.0], ["a", "b"])], {}, 1)
    (group,) = decode_groups(tensors, json.loads(json.dumps(meta)), None)  # type: ignore[arg-type]
    assert [c.token_versions for c in group.completions] == [[2, 2, 3], [3]]
    tensors, meta = encode_groups([Group(record, [one], [0.0], ["b"])], {}, 1)
    assert "token_versions" not in tensors  # the other modes' dumps are as before


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.max_staleness=1", "rollout.partial.segment_tokens=2"], "set train.max_staleness>=2 or"),
        (
            [
                "train.max_staleness=2",
                "rollout.partial.segment_tokens=2",
                "algorithm.dynamic_sampling.enabled=true",
            ],
            "with algorithm.dynamic_sampling.enabled=true",
        ),
        (
            [
                "train.max_staleness=2",
                "rollout.partial.segment_tokens=2",
                "rollout.partial.groups_in_flight=3",
            ],
            "is below train.prompts_per_iteration=4",
        ),
        (["rollout.partial.segment_tokens=0"], "rollout.partial.segment_tokens=0 must be >= 1"),
        (
            [
                "train.max_staleness=2",
                "rollout.partial.segment_tokens=2",
                "rollout.partial.overlap=true",
                "rollout.embedded_process=true",
            ],
            "set train.max_staleness>=3 or rollout.partial.segment_tokens>=3",
        ),
        (
            ["train.max_staleness=3", "rollout.partial.segment_tokens=2", "rollout.partial.overlap=true"],
            "rollout.partial.overlap=true needs engines that generate while the trainer trains",
        ),
        (["rollout.partial.overlap=true"], "without rollout.partial.enabled=true"),
        (
            ["rollout.partial.keep_kv=true"],
            "rollout.partial.keep_kv=true without rollout.partial.enabled=true",
        ),
        (
            ["rollout.partial.one_request=true"],
            "rollout.partial.one_request=true without rollout.partial.enabled",
        ),
        (
            ["train.max_staleness=2", "rollout.partial.segment_tokens=2", "rollout.partial.keep_kv=true"],
            "only an SGLang engine keeps its prefix cache",
        ),
        (
            [
                "train.max_staleness=2",
                "rollout.partial.segment_tokens=2",
                "rollout.engine=sglang",
                "rollout.partial.keep_kv=true",
            ],
            "SGLang flushes its prefix cache on each release, so nothing would be kept",
        ),
    ],
)
def test_partial_rollout_config_is_refused_with_the_fix(overrides, message):
    from grpo_megatron.config import ConfigError, load_config, validate
    from tests.helpers.runs import DEMO, SMALL

    flags = (
        "rollout.partial.overlap=true",
        "rollout.partial.keep_kv=true",
        "rollout.partial.one_request=true",
    )
    alone = overrides[0] in flags
    partial = [] if alone else ["rollout.partial.enabled=true"]
    cfg = load_config(DEMO, [*SMALL, *partial, *overrides])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        validate(cfg, 2)


@pytest.mark.launches
def test_partial_rollouts_train_with_per_token_versions_and_resume_bitwise(tmp_path, monkeypatch):
    """2 ranks (EP2, the demo's tiny MoE, each engine a process of its own, as issue 40 asks the
    resume to be bitwise with), 3 iterations of 4 groups, segments of 3 of the 6 new tokens, a pool
    of 8 groups, rollout.partial.overlap (each iteration's first round submitted before it trains):
    iteration 1 ends by submitting the next 4 groups' first segments under version 0, iteration 2
    takes the 4 groups left complete and submits their second segments under version 1, so
    iteration 3 trains responses begun under version 0 and ended under version 1 (lag 2, the dump
    and the metrics say so); killed after the checkpoint of iteration 2 (a round in flight, collected
    into the pool it saves) and resumed, the run's metrics equal the uninterrupted run's bitwise.
    Each response's tokens are on one rank, its engine's (issue 51 item 9): every round, each rank
    holds part of the pool's tokens and the two parts make the whole, and receives less than a
    broadcast of every segment would have given it (``_pool_stays_with_its_engines``)."""
    from grpo_megatron.logging_utils.metrics import read_jsonl
    from grpo_megatron.training.rollout_dump import read_iteration
    from tests.helpers.runs import SMALL, comparable, finish, killed_and_resumed, launch

    common = [
        *SMALL,
        "reward.components=[{name: len, function: length, kwargs: {target_chars: 6}}]",
        "train.lr=1e-3",
        "rollout.partial.enabled=true",
        "train.max_staleness=2",
        "rollout.partial.segment_tokens=3",
        "rollout.partial.overlap=true",
        "train.iterations=3",
        "checkpoint.save_interval=2",
        "algorithm.off_policy.correction=icepop",
        "rollout.embedded_process=true",
    ]
    full = tmp_path / "full"
    monkeypatch.setenv("GRPO_ROUND_TRACE", str(tmp_path / "rounds.jsonl"))  # both ranks append their events
    finish(launch("train", [*common, f"logging.run_dir={full}", f"rollout.dump_dir={tmp_path / 'dump'}"]))
    monkeypatch.delenv("GRPO_ROUND_TRACE")
    _pool_stays_with_its_engines(tmp_path / "rounds.jsonl")
    records = read_jsonl(full / "metrics.jsonl")[1:]
    assert all(r["partial/staleness/max"] <= 2 for r in records)
    assert [r["partial/regenerated"] for r in records] == [0, 0, 0]
    assert [r["partial/segments"] >= 1 for r in records] == [True, True, True]
    assert records[-1]["partial/mixed_versions_frac"] > 0 and records[-1]["partial/staleness/max"] == 2
    groups, _ = read_iteration(tmp_path / "dump", 3)
    versions = [c.token_versions for g in groups for c in g.completions]
    assert [0, 0, 0, 1] == [v for v in versions if v is not None and len(set(v)) > 1][0][:4]

    got = killed_and_resumed(common, tmp_path / "cut")
    want = [comparable(r) for r in read_jsonl(full / "metrics.jsonl")]
    assert [r["iteration"] for r in got] == [0, 1, 2, 3]
    assert got == want, json.dumps([got[-1], want[-1]], indent=1)


def _pool_stays_with_its_engines(trace) -> None:
    """The continuous source's trace at 2 ranks, an engine on each: after every round each rank holds
    some of the pool's tokens and not all, the two parts add up to the pool, and each rank received
    (its segments' headers, the rows moved to it) less than the broadcast of every segment the pool kept
    on every rank before (issue 51 item 9)."""
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    by_rank = [[e for e in events if e["event"] == "received" and e["rank"] == rank] for rank in (0, 1)]
    assert len(by_rank[0]) == len(by_rank[1]) >= 3
    for first, second in zip(*by_rank, strict=True):  # the same round on both ranks
        assert first["pool_tokens"] == second["pool_tokens"] == first["held_tokens"] + second["held_tokens"]
        assert 0 < first["held_tokens"] < first["pool_tokens"] and 0 < second["held_tokens"]
    for rounds in by_rank:
        assert sum(e["received_bytes"] for e in rounds) < sum(e["broadcast_bytes"] for e in rounds)
