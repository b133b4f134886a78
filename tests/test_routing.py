"""MoE routing replay: the trainer replays the rollout engine's experts (R3) at EP2 and TP2xEP2 with
sequence parallelism, for Qwen3-MoE, Mixtral and DeepSeek-V3 (group-limited routing with its score
correction bias), and the routing metrics' pure functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_megatron.algorithm.routing_metrics import expert_counts, load_metrics, route_mismatches
from tests.helpers.dist import run_distributed
from tests.helpers.tiny_configs import tiny_hf_config


def _write_config(path: Path, config: dict) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _check_replay(res: dict) -> None:
    assert res["lengths"][0] > res["lengths"][1]  # two micro-batches, padded differently
    # The trainer's own experts equal the engine's for every compared token-layer (fp32) ...
    assert sum(res["r3_mismatches"]) == 0, res["r3_mismatches"]
    # ... every real token of every rank's batch was compared (each DP replica runs the batch) ...
    assert res["r3_compared"] == [float(res["tokens"] * res["dp"])] * len(res["r3_compared"])
    # ... the experts used are the engine's, token for token (load counts over all ranks) ...
    assert torch.equal(res["r3_counts"], res["engine_counts"] * res["dp"])
    # ... and the logprobs are the engine's.
    assert res["r3_vs_engine"] < 1e-5, res["r3_vs_engine"]
    # Other routes replayed in the reference are used there and change its logprobs, not the policy's.
    assert torch.equal(res["altered_counts"], res["altered_expected"] * res["dp"])
    assert res["altered_vs_engine"] > 1e-3
    assert res["own_vs_engine"] < 1e-5 and res["taps_disjoint"]
    # R2: the recorded own routes (whole sequences, every SP chunk) are the engine's here, and replay exactly.
    assert res["r2_routes_equal_engine"] and res["r2_vs_own"] == 0.0
    # Part replay (the mismatch probe's one forward): the first copy of a batch routes itself, the
    # second replays other routes; each copy gives its own pass's logprobs, and only the first copy
    # is compared with the given routes.
    assert res["replayed_vs_plain"] > 1e-4
    assert res["part_plain_vs_plain"] < 1e-6 and res["part_replay_vs_replayed"] < 1e-6, res
    assert res["part_compared"] == res["plain_compared"] and sum(m for m, _ in res["part_compared"]) > 0


@pytest.mark.launches
@pytest.mark.timeout(600)
def test_r3_replays_engine_routes_at_ep2_and_pp2(tmp_path):
    cases = {
        name: (_write_config(tmp_path / name, tiny_hf_config(name)), ["parallel.ep=2"])
        for name in ("qwen3_moe", "mixtral", "deepseek_v3")
    }
    cases["qwen3_moe_pp2"] = (cases["qwen3_moe"][0], ["parallel.pp=2"])
    results = run_distributed(
        "tests.workers.routing_workers:replay_cases", world_size=2, timeout_s=560, cases=cases
    )
    for case in cases:
        for res in (r[case] for r in results):
            assert (res["ep"], res["dp"]) == ((1, 1) if case.endswith("pp2") else (2, 2)), case
            _check_replay(res)
    # PP2: each stage routes (and records for R2) its own MoE layer only.
    assert [r["qwen3_moe_pp2"]["r2_local_layers"] for r in results] == [[0], [1]]


@pytest.mark.launches
@pytest.mark.timeout(600)
def test_r3_replays_engine_routes_at_tp2_ep2(tmp_path):
    hf_dir = _write_config(tmp_path / "qwen3_moe", tiny_hf_config("qwen3_moe"))
    cases = {"qwen3_moe": (hf_dir, ["parallel.tp=2", "parallel.ep=2"])}
    results = run_distributed(
        "tests.workers.routing_workers:replay_cases", world_size=4, timeout_s=560, cases=cases
    )
    for res in (r["qwen3_moe"] for r in results):
        assert (res["tp"], res["ep"], res["sp"]) == (2, 2, True)
        _check_replay(res)


def test_route_mismatches_compare_sets() -> None:
    own_tk = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3]])
    other_tk = torch.tensor([[1, 0], [2, 1], [1, 2], [3, 1]])
    valid_t = torch.tensor([True, True, True, False])
    assert int(route_mismatches(own_tk, other_tk, valid_t)) == 1  # order ignored, padding skipped


def test_load_metrics() -> None:
    routes_tk = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 3]])
    counts_e = expert_counts(routes_tk, torch.tensor([True, True, True, False]), num_experts=4)
    assert counts_e.tolist() == [3.0, 2.0, 1.0, 0.0]
    even_e = torch.full((4,), 5.0)
    m = load_metrics(torch.stack([counts_e, even_e, torch.zeros(4)]), per_layer=True)
    assert m["routing/load_max_over_mean/layer0"] == pytest.approx(3 / 1.5)
    assert m["routing/load_max_over_mean/layer1"] == 1.0 and m["routing/load_cv/layer1"] == 0.0
    assert "routing/load_cv/layer2" not in m  # a layer without tokens (another stage's) is left out
    assert m["routing/load_cv/layer0"] == pytest.approx(float(counts_e.std(correction=0)) / 1.5)
    assert m["routing/load_max_over_mean"] == pytest.approx((2.0 + 1.0) / 2)


@pytest.mark.launches
def test_full_recompute_routes_as_the_forward_did(tmp_path):
    # model.recompute=full re-runs each layer's forward in the backward pass, routers included: the
    # routers record each micro-batch once and the recompute routes as the forward did (the replayed
    # experts under replay), so the gradients equal those without recompute.
    hf_dir = _write_config(tmp_path / "qwen3_moe", tiny_hf_config("qwen3_moe"))
    (plain,) = run_distributed(
        "tests.workers.routing_workers:recompute_gradients",
        world_size=1,
        timeout_s=300,
        hf_dir=hf_dir,
        recompute="none",
    )
    (full,) = run_distributed(
        "tests.workers.routing_workers:recompute_gradients",
        world_size=1,
        timeout_s=300,
        hf_dir=hf_dir,
        recompute="full",
    )
    assert full["forwards"] == plain["forwards"] == {r: [2, 2] for r in (False, True)}
    for key in ("grads_replay=False", "grads_replay=True"):
        for name, grad in plain[key].items():
            assert torch.allclose(full[key][name], grad, atol=1e-6, rtol=1e-5), (key, name)
    # the replayed routes differ from the router's own: replay (in the recompute too) changed the gradients
    own, replayed = plain["grads_replay=False"], plain["grads_replay=True"]
    assert any(not torch.allclose(own[n], replayed[n], atol=1e-4) for n in own)
