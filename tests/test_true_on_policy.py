"""Issue 53: ``rollout.true_on_policy``. The engine's behaviour logprob of every sampled token equals,
bit for bit, the trainer's logprob of it at the same weights (bf16, MoE), for Qwen3-MoE, DeepSeek-V3
and Mixtral, at one process, TP2 and EP2, across weight changes; a job trains with the importance
ratio exactly 1 and every mismatch metric exactly 0. Compared with ``==`` (not a tolerance)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from grpo_megatron.config import load_config
from grpo_megatron.config.job import ConfigError
from grpo_megatron.config.validation import validate
from grpo_megatron.models.batch_invariant import (
    ITEM_TILE,
    ROW_TILE,
    BatchInvariantMode,
    aligned_attention,
    key_width,
    tiled_items_bmm,
    tiled_rows_mm,
)
from tests.helpers.dist import run_distributed
from tests.helpers.runs import DEMO, SMALL, finish, launch

MOVING = ["reward.components=[{name: len, function: length, kwargs: {target_chars: 6}}]", "train.lr=1e-3"]
"""A reward with variance from the first iteration (a length bonus): every update moves the weights."""
SWITCH = ["rollout.true_on_policy=true", "model.dtype=bfloat16"]


def test_products_under_the_mode_do_not_depend_on_the_batch() -> None:
    """Each row of ``F.linear``, ``@`` and ``torch.mm`` under ``BatchInvariantMode`` equals that row
    computed alone, bitwise (fp32: the plain ops differ here between one row and many)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 96, generator=gen), torch.randn(80, 96, generator=gen)
    with BatchInvariantMode():
        batched = [F.linear(x, w), x @ w.t(), torch.mm(x, w.t()), torch.matmul(x[None], w.t())[0]]
        alone = [torch.cat([F.linear(x[i : i + 1], w) for i in range(0, 300, 37)])]
    picked = torch.cat([batched[0][i : i + 1] for i in range(0, 300, 37)])
    assert torch.equal(picked, alone[0])
    assert all(torch.equal(batched[0], b) for b in batched[1:])
    assert torch.equal(tiled_rows_mm(x[:5], w.t()), tiled_rows_mm(x, w.t())[:5])
    assert key_width(22) == 32 and key_width(16) == 16 and ROW_TILE == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_of_a_token_does_not_depend_on_its_segments_length_or_neighbours(dtype) -> None:
    """``aligned_attention`` of 150 packed segments (grouped-query, 8 heads over 2): each segment's
    prefixes attended alone equal the packed result at those positions, bitwise (a decode step's
    prefix against the trainer's whole response beside others); a batched product's item equals it
    computed in another batch at another place."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 33, (150,), generator=gen).tolist()
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    q, k, v = (torch.randn(bounds[-1], h, 32, generator=gen).to(dtype) for h in (8, 2, 2))
    packed = aligned_attention(q, k, v, bounds, scale=0.17, key_length=32)
    for i in range(0, 150, 7):
        start, end = bounds[i], bounds[i + 1]
        for n in {1, (end - start + 1) // 2, end - start}:
            s = slice(start, start + n)
            alone = aligned_attention(q[s], k[s], v[s], [0, n], scale=0.17, key_length=32)
            assert torch.equal(alone, packed[s]), (i, n)
    a, b = torch.randn(40, 64, 32, generator=gen), torch.randn(40, 32, 32, generator=gen)
    assert torch.equal(tiled_items_bmm(a, b, ITEM_TILE)[3:4], tiled_items_bmm(a[3:4], b[3:4], ITEM_TILE))
    assert torch.equal(tiled_items_bmm(a, b, ITEM_TILE)[37], tiled_items_bmm(a[30:], b[30:], ITEM_TILE)[7])


@pytest.mark.launches
def test_the_policy_engine_samples_the_trainers_logprobs_bitwise_in_one_process() -> None:
    """Three architectures at one process, each at random weights and one step away from them; the
    control (the trainer's pass in the plain numerics: SDPA, plain products) differs on most tokens."""
    runs = {
        "control": ("qwen3_moe", [], False),
        **{t: (t, [], True) for t in ("qwen3_moe", "deepseek_v3", "mixtral")},
    }
    (got,) = run_distributed(
        "tests.workers.true_on_policy_workers:compare_all", world_size=1, timeout_s=400, runs=runs
    )
    for name in ("qwen3_moe", "deepseek_v3", "mixtral"):
        assert got[name]["tokens"] > 100 and got[name]["mismatches"] == [0, 0], (name, got[name])
    assert min(got["control"]["mismatches"]) > 10 and got["control"]["max_abs"] > 1e-3, got["control"]


@pytest.mark.launches
def test_the_policy_engine_samples_the_trainers_logprobs_bitwise_at_tp2_and_ep2() -> None:
    """DeepSeek-V3 (MLA, group routing, a shared expert) and Mixtral at TP2 (sequence parallel, the
    vocabulary split) and EP2 (two data-parallel replicas generating their own prompts in lockstep
    through the MoE all-to-all); Qwen3-MoE at both in the job tests below; Mixtral at TP2 once more
    with top-k and top-p sampling at temperature 0.8."""
    runs: dict[str, tuple] = {
        f"{t}/{lay}": (t, [f"parallel.{lay[:2]}=2"], True)
        for t in ("deepseek_v3", "mixtral")
        for lay in ("tp2", "ep2")
    }
    # truncated sampling (issue 53 item 4): the trainer's pass takes the same top-k / top-p, across TP
    runs["mixtral/tp2/truncated"] = (
        "mixtral",
        ["parallel.tp=2"],
        True,
        {"top_k": 8, "top_p": 0.9, "temperature": 0.8},
    )
    ranks = run_distributed(
        "tests.workers.true_on_policy_workers:compare_all", world_size=2, timeout_s=500, runs=runs
    )
    for got in ranks:
        for name, run in got.items():
            assert run["tokens"] > 100 and run["mismatches"] == [0, 0], (name, run)


def _job_metrics(tmp_path, overrides: list[str]) -> list[dict]:
    finish(
        launch("train", [*SMALL, *SWITCH, *MOVING, f"logging.run_dir={tmp_path}", *overrides]), timeout_s=500
    )
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]


@pytest.mark.launches
@pytest.mark.parametrize(
    ("layout", "iterations"),
    [(["parallel.ep=2"], 3), (["parallel.ep=1", "parallel.tp=2"], 3)],
    ids=["ep2", "tp2"],
)
def test_a_job_trains_with_behaviour_logprobs_equal_to_the_trainers(tmp_path, layout, iterations) -> None:
    """The demo's Qwen3-MoE in bf16 on 2 ranks, from random weights with a reward that moves them every
    iteration: every behaviour logprob equals the trainer's first pass bitwise (the largest difference
    is 0.0, not small), so the off-policy ratio is exactly 1, and the mismatch probe is 0 too."""
    records = _job_metrics(tmp_path, [*layout, f"train.iterations={iterations}", "rollout.probe_interval=1"])
    assert len(records) == iterations
    for r in records:
        assert r["mismatch/logprob_abs_diff_max"] == 0.0 and r["mismatch/logprob_abs_diff"] == 0.0, r
        assert r["off_policy/ratio_min"] == r["off_policy/ratio_max"] == 1.0, r
        assert r["mismatch/probe_abs_diff_max"] == 0.0, r
        assert r["grad_norm"] > 0, r  # the weights moved: the next iteration samples other weights


def test_check_refuses_what_the_policy_engine_cannot_serve() -> None:
    def errors(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            validate(load_config(DEMO, ["rollout.true_on_policy=true", *overrides]), 2)
        return str(info.value)

    assert "set rollout.engine=embedded" in errors("rollout.engine=sglang")
    assert "set rollout.embedded_process=false" in errors(
        "rollout.embedded_process=true", "train.max_staleness=1", "algorithm.off_policy.correction=icepop"
    )
    assert "set train.max_staleness=0" in errors(
        "rollout.embedded_process=true", "train.max_staleness=1", "algorithm.off_policy.correction=icepop"
    )
    assert "set parallel.tp to 1 or 2" in errors("parallel.tp=4", "parallel.ep=1")
    assert "set model.transformer_impl=local" in errors("model.transformer_impl=transformer_engine")
    validate(load_config(DEMO, ["rollout.true_on_policy=true"]), 2)
