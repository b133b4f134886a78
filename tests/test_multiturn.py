"""Multi-turn, tool-using rollouts (rollout/multiturn.py, rewards/tools.py): exact tokens, the loss mask,
tool containment. The engine is the real embedded transformers engine (the tool demo's random
Qwen3-MoE); tools run in the real sandboxed workers."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from grpo_megatron.data import PromptRecord, load_tokenizer
from grpo_megatron.rewards.config import RewardConfig
from grpo_megatron.rewards.tools import ToolPool, calculator, tool_metrics
from grpo_megatron.rollout.config import MultiTurnConfig, RolloutConfig
from grpo_megatron.rollout.engine import SamplingParams
from grpo_megatron.rollout.multiturn import (
    TOOL_NAME,
    EpisodeRunner,
    ToolEnvironment,
    trajectory_metrics,
)
from grpo_megatron.training.batching import make_sample
from tests.helpers.dist import REPO_ROOT
from tests.helpers.episodes import CountingEnvironment, RecordingEngine, rebuild

TOOL_DEMO = REPO_ROOT / "examples" / "demo_tool"
HELPERS = "tests.tool_helpers"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOOL_DEMO)


# ------------------------------------------------------------------------------------------- tools


def test_calculator_is_exact_and_evaluates_nothing_else():
    assert calculator("12*34") == "408"
    assert calculator("-(3+4)*2-1") == "-15"
    assert calculator("(1+2)/6") == "1/2"
    assert calculator(" 007 + 1 ") == "8"
    for bad in (
        "2**10",
        "__import__('os')",
        "1/0",
        "9" * 61,
        "1+",
        "(1",
        "1e5",
        "",
        "(" * 40 + "1" + ")" * 40,
        "99999999999999999999999999999999*99999999999999999999999999999999",
        "x" * 300,
    ):
        with pytest.raises(ValueError):
            calculator(bad)


def test_a_tool_that_hangs_raises_floods_or_dies_is_contained_and_counted():
    tools = {n: f"{HELPERS}:{n}" for n in ("echo", "hang", "spin", "boom", "flood", "not_text", "die")}
    tools["calc"] = "calculator"
    pool = ToolPool(tools, RewardConfig(), timeout_s=1.0, num_workers=2, max_output_chars=50, log=None)
    try:
        calls = [
            ("calc", "12*34"),
            ("hang", ""),
            ("boom", ""),
            ("flood", ""),
            ("not_text", ""),
            ("die", ""),
            ("missing", ""),
            ("spin", ""),
            ("echo", "still here"),
        ]
        results = pool.run(calls)
        status = [r.status for r in results]
        assert status == ["ok", "timeout", "error", "ok", "error", "error", "error", "timeout", "ok"]
        assert results[0].output == "408" and results[-1].output == "still here"
        assert results[3].output == "z" * 50 and results[3].truncated  # cut in the worker
        assert all(r.output == "error" for r in results if r.status != "ok")
        assert tool_metrics(results) == {
            "tool/calls": 9.0,
            "tool/errors": 6.0,
            "tool/timeouts": 2.0,
            "tool/truncated": 1.0,
        }
        assert pool.restarts == 3  # the two timeouts and the death; the pool still answers
        assert [r.output for r in pool.run([("calc", "2+2")] * 3)] == ["4"] * 3
    finally:
        pool.close()


def test_a_tool_that_fails_to_import_stops_the_start_naming_it():
    with pytest.raises(ValueError, match="rollout.multiturn.tools.t"):
        ToolPool(
            {"t": "tests.no_such_module:f"},
            RewardConfig(),
            timeout_s=1.0,
            num_workers=1,
            max_output_chars=10,
            log=None,
        )


def test_the_tool_environment_answers_calls_in_the_documented_format(tokenizer):
    cfg = MultiTurnConfig(enabled=True, error_text="?")
    pool = ToolPool(
        {TOOL_NAME: "calculator"},
        RewardConfig(),
        timeout_s=2.0,
        num_workers=1,
        max_output_chars=20,
        error_text="?",
        log=None,
    )
    env = ToolEnvironment(cfg, tokenizer, pool)
    try:
        steps = env.step([None] * 4, ["<calc>12*34</calc>", "408", "<calc>1/0</calc>", "<calc>1+1"])
    finally:
        env.close()
    assert [s.done for s in steps] == [False, True, False, True]
    assert tokenizer.decode(steps[0].observation_ids) == "<result>408</result>"
    # tokenized once, on its own: the word tokens and digits, no BOS
    assert steps[0].observation_ids == tokenizer.encode("<result>408</result>", add_special_tokens=False)
    assert tokenizer.decode(steps[2].observation_ids) == "<result>?</result>"
    assert [(s.tool_calls, s.tool_errors) for s in steps] == [(1, 0), (0, 0), (1, 1), (0, 0)]


def test_the_episodes_count_tool_timeouts_and_truncated_outputs(tokenizer):
    """rollout.multiturn.tool_timeout_s and max_tool_output_chars promise tool/timeouts and tool/truncated:
    each step counts them, each trajectory sums them, the iteration's metrics report them."""
    from grpo_megatron.rollout.multiturn import Trajectory

    cfg = MultiTurnConfig(enabled=True, error_text="?")
    counted = {}
    for tool, chars in (("flood", 5), ("hang", 50)):
        pool = ToolPool(
            {TOOL_NAME: f"{HELPERS}:{tool}"},
            RewardConfig(),
            timeout_s=1.0,
            num_workers=1,
            max_output_chars=chars,
            error_text="?",
            log=None,
        )
        env = ToolEnvironment(cfg, tokenizer, pool)
        try:
            (step,) = env.step([None], ["<calc>1</calc>"])
        finally:
            env.close()
        counted[tool] = (step.tool_calls, step.tool_errors, step.tool_timeouts, step.tool_truncated)
    assert counted == {"flood": (1, 0, 0, 1), "hang": (1, 1, 1, 0)}
    t = Trajectory(
        [], [], "stop", None, [], turns=2, tool_calls=3, tool_errors=2, tool_timeouts=1, tool_truncated=1
    )
    assert trajectory_metrics([t, t]) == {
        "turns/mean": 2.0,
        "tool/calls": 6.0,
        "tool/errors": 4.0,
        "tool/timeouts": 2.0,
        "tool/truncated": 2.0,
    }


def test_multiturn_config_names_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"rollout.multiturn.max_turns=0 must be >= 1"):
        RolloutConfig(multiturn=MultiTurnConfig(max_turns=0)).validate()
    with pytest.raises(ValueError, match=r"rollout.multiturn.tool='os.system'"):
        MultiTurnConfig(tool="os.system").validate()
    with pytest.raises(ValueError, match=r"rollout.multiturn.call_close must be a non-empty"):
        MultiTurnConfig(call_close="").validate()


# ------------------------------------------------------------------------------- exact tokens


def embedded_engine(tokenizer: Any) -> RecordingEngine:
    """The tool demo's random Qwen3-MoE in the real embedded engine, recorded."""
    from grpo_megatron.rollout.embedded import EmbeddedEngine

    hf = json.loads((TOOL_DEMO / "config.json").read_text())
    return RecordingEngine(EmbeddedEngine(hf, tokenizer=tokenizer))


def test_the_trainer_sees_the_engine_ids_plus_the_observation_ids_bit_for_bit(tokenizer):
    engine = embedded_engine(tokenizer)
    env = CountingEnvironment(tokenizer, turns=2)
    cfg = MultiTurnConfig(enabled=True, max_turns=3, max_total_tokens=40)
    records = [
        PromptRecord(prompt=p, prompt_ids=tuple(tokenizer.encode(p)), answer="0", metadata={})
        for p in ("12*34=", "5+6=")
    ]
    params = SamplingParams(
        n=3, max_new_tokens=7, stop_token_ids=(tokenizer.eos_token_id,), seed=5, routes=True
    )
    groups = EpisodeRunner(engine, cfg, tokenizer, env).run(records, params)  # type: ignore[arg-type]

    assert engine.calls[0][0] == [list(r.prompt_ids) for r in records]
    want = iter(rebuild(records, groups, engine, env))
    for r, g in zip(records, groups, strict=True):
        for t in g:
            want_ids, want_mask, want_lp = next(want)
            assert (t.token_ids, t.loss_mask, t.logprobs) == (want_ids, want_mask, want_lp)
            # what the trainer trains on (training/batching.py)
            s = make_sample(r.prompt_ids, t.token_ids, t.logprobs, 1.0, t.routed_experts, t.loss_mask)
            seq = list(r.prompt_ids) + want_ids
            assert s.tokens_s.tolist() == seq[:-1] and s.labels_s.tolist() == seq[1:]
            p = len(r.prompt_ids)
            assert s.mask_s.tolist() == [0.0] * (p - 1) + [float(m) for m in want_mask]
            assert torch.equal(s.rollout_logprobs_s[p - 1 :], torch.tensor(want_lp) * torch.tensor(want_mask))
            # the last turn's routes cover every input position of the whole trajectory
            assert t.routed_experts is not None and t.routed_experts.shape[1] == len(seq) - 1
            # one environment step per turn that did not end the episode by itself (EOS, limits)
            assert t.tool_calls in (t.turns - 1, t.turns) and (t.env_reward or 0.0) == 0.5 * t.tool_calls
    trajectories = [t for g in groups for t in g]
    assert any(t.turns > 1 for t in trajectories), "no episode went past its first turn"
    metrics = trajectory_metrics(trajectories)
    assert metrics["turns/mean"] > 1 and metrics["tool/calls"] == sum(t.tool_calls for t in trajectories)


def test_continuing_from_token_ids_samples_what_one_forward_would_score(tokenizer):
    # The engine's logprob of every sampled token of a multi-turn trajectory equals the teacher-forced
    # logprob of that token in the whole trajectory (a re-tokenized transcript could differ; ids do not).
    engine = embedded_engine(tokenizer)
    cfg = MultiTurnConfig(enabled=True, max_turns=3, max_total_tokens=40)
    records = [
        PromptRecord(prompt="7*8=", prompt_ids=tuple(tokenizer.encode("7*8=")), answer="56", metadata={})
    ]
    params = SamplingParams(n=4, max_new_tokens=6, stop_token_ids=(tokenizer.eos_token_id,), seed=1)
    (group,) = EpisodeRunner(engine, cfg, tokenizer, CountingEnvironment(tokenizer, 3)).run(records, params)  # type: ignore[arg-type]
    p = len(records[0].prompt_ids)
    scored = engine.engine.score([list(records[0].prompt_ids) + t.token_ids for t in group], [p] * 4, 1.0)
    for t, lp in zip(group, scored, strict=True):
        assert t.loss_mask is not None
        model = [i for i, m in enumerate(t.loss_mask) if m]
        assert max(abs(lp[i] - t.logprobs[i]) for i in model) < 1e-5


def test_limits_on_turns_and_tokens_hold(tokenizer):
    engine = embedded_engine(tokenizer)
    records = [
        PromptRecord(prompt="1+1=", prompt_ids=tuple(tokenizer.encode("1+1=")), answer="2", metadata={})
    ]
    params = SamplingParams(n=6, max_new_tokens=5, stop_token_ids=(tokenizer.eos_token_id,), seed=3)
    cfg = MultiTurnConfig(enabled=True, max_turns=2, max_total_tokens=12)
    (group,) = EpisodeRunner(engine, cfg, tokenizer, CountingEnvironment(tokenizer, 99)).run(records, params)  # type: ignore[arg-type]
    assert all(t.turns <= 2 and len(t.token_ids) <= 12 for t in group)
    assert all(t.loss_mask is not None and t.loss_mask[-1] == 1 for t in group)  # ends with a model turn
    # each open episode of a later turn is asked for its own budget left, not the largest
    p = len(records[0].prompt_ids)
    for (rows, outs), budgets in zip(engine.calls[1:], engine.budgets[1:], strict=True):
        assert budgets == [min(5, 12 - (len(row) - p)) for row in rows]
        assert all(len(c.token_ids) <= b for (c,), b in zip(outs, budgets, strict=True))


def test_each_prompt_stops_at_its_own_budget_and_unbound_budgets_change_nothing(tokenizer):
    # The embedded engine's per-prompt max_new_tokens (SamplingParams.max_new_tokens_each): a row leaves
    # the batch at its limit ("length"); limits that do not bind give the same bits as none.
    engine = embedded_engine(tokenizer).engine
    prompts = [tokenizer.encode(p) for p in ("12*34=", "5+6=", "7*8=")]
    free = SamplingParams(n=2, max_new_tokens=6, greedy=True)
    unbound = engine.generate(prompts, dataclasses.replace(free, max_new_tokens_each=(6, 6, 6)))
    whole = engine.generate(prompts, free)

    def bits(groups: list[list[Any]]) -> list[tuple[list[int], list[float]]]:
        return [(c.token_ids, c.logprobs) for g in groups for c in g]

    assert bits(unbound) == bits(whole)
    limited = engine.generate(prompts, dataclasses.replace(free, max_new_tokens_each=(2, 6, 4)))
    for g_whole, g_limited, limit in zip(whole, limited, (2, 6, 4), strict=True):
        for w, c in zip(g_whole, g_limited, strict=True):
            assert c.token_ids == w.token_ids[:limit] and c.finish_reason == "length"
            assert max(abs(a - b) for a, b in zip(c.logprobs, w.logprobs[:limit], strict=True)) < 1e-5


# ------------------------------------------------------------------ GRPO on real megatron-core


TOOL_YAML = REPO_ROOT / "examples" / "demo_tool.yaml"
# The tool demo from a random initialisation, shrunk. A random model rarely writes "<calc>...</calc>"
# (two word tokens out of 32), so the call markers are the characters "(" and ")" here: a turn that
# ends with ")" after a "(" calls the calculator on what lies between (mostly an error: counted).
TOOL_SMALL = [
    "train.prompts_per_iteration=4",
    "rollout.n_samples_per_prompt=8",
    "data.num_train_prompts=256",
    "data.num_eval_prompts=8",
    "train.micro_batch_size=8",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "parallel.backend=gloo",
    "parallel.timeout_minutes=3",
    "rollout.multiturn.call_open=(",
    "rollout.multiturn.call_close=)",
    "rollout.multiturn.max_turns=4",
    "rollout.max_new_tokens=20",
    "rollout.multiturn.max_total_tokens=48",
    "algorithm.routing_replay=r3",
    "algorithm.tis.enabled=true",
]


@pytest.mark.launches
def test_multiturn_grpo_on_two_ranks_trains_on_model_tokens_only_and_resumes_exactly(tmp_path):

    from grpo_megatron.logging_utils.metrics import read_jsonl
    from tests.helpers.runs import comparable, finish, killed_and_resumed, launch

    common = [*TOOL_SMALL, "train.iterations=4", "checkpoint.save_interval=2"]
    full = tmp_path / "full"
    finish(launch("train", [*common, f"logging.run_dir={full}"], config=TOOL_YAML))
    records = read_jsonl(full / "metrics.jsonl")
    trained = [r for r in records if r["iteration"] > 0]
    assert sum(r["tool/calls"] for r in trained) > 0 and max(r["turns/mean"] for r in trained) > 1
    assert all(r["tool/errors"] <= r["tool/calls"] for r in trained)
    # The engine's logprobs (sampled tokens) against the trainer's at the masked-in positions: equal in
    # fp32. An observation token left in the mask would count its 0.0 "logprob" against a real one.
    assert max(r["mismatch/logprob_abs_diff_max"] for r in trained) < 1e-5
    assert all(r["routing/disagreement"] == 0.0 for r in trained)  # r3 replays the last turn's routes

    got = killed_and_resumed(common, tmp_path / "cut", config=TOOL_YAML)
    assert [r["iteration"] for r in got] == [0, 1, 2, 3, 4]
    assert got == [comparable(r) for r in records]


@pytest.mark.launches
def test_multiturn_samples_under_context_parallelism(tmp_path):
    # CP2 x EP2 on 2 ranks: packed trajectories split over the CP ranks, observation tokens masked.
    from grpo_megatron.logging_utils.metrics import read_jsonl
    from tests.helpers.runs import finish, launch

    run = tmp_path / "run"
    small = [o for o in TOOL_SMALL if not o.startswith("algorithm.routing_replay")]  # r3 refuses cp > 1
    finish(
        launch(
            "train",
            [*small, "parallel.cp=2", "train.iterations=1", f"logging.run_dir={run}"],
            config=TOOL_YAML,
        )
    )
    last = read_jsonl(run / "metrics.jsonl")[-1]
    assert last["turns/mean"] > 1 and last["tool/calls"] > 0
    assert last["mismatch/logprob_abs_diff_max"] < 1e-5 and last["batch/padding_frac"] == 0.0
