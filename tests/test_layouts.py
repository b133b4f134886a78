"""Logprobs, entropy and gradients at every parallel layout equal the single-process run (fp32).

Real megatron-core on gloo, launched through torch.distributed.run. Several layouts share one
launch to keep the suite fast.
"""

from __future__ import annotations

import pytest

from tests.helpers.dist import run_distributed

TOL = 1e-5


@pytest.fixture(scope="module")
def reference() -> dict:
    (ref,) = run_distributed("tests.workers.layout_workers:reference", 1, timeout_s=180)
    return ref


def _check(results: dict, layouts: dict[str, list[str]]) -> None:
    failures = []
    for name in layouts:
        r = results[name]
        for key in ("logprob_diff", "entropy_diff", "grad_diff"):
            if not r[key] <= TOL:
                failures.append(f"{name}: {key}={r[key]:.3g} > {TOL} (grad scale {r['grad_scale']:.3g})")
    assert not failures, "\n".join(failures)


TWO_RANKS = {
    "TP2 (sequence parallel)": ["parallel.tp=2"],
    "EP2 alltoall": ["parallel.ep=2", "model.moe_token_dispatcher=alltoall"],
    "EP2 allgather": ["parallel.ep=2", "model.moe_token_dispatcher=allgather"],
    "PP2": ["parallel.pp=2"],
    "TP2 ETP1 EP2 (experts whole, spread over the TP ranks)": [
        "parallel.tp=2",
        "parallel.etp=1",
        "parallel.ep=2",
    ],
    "DP2": [],
}


@pytest.mark.launches
def test_two_rank_layouts_match_single_process(reference: dict) -> None:
    per_rank = run_distributed(
        "tests.workers.layout_workers:layouts", 2, timeout_s=420, layouts=TWO_RANKS, reference=reference
    )
    for rank_results in per_rank:
        _check(rank_results, TWO_RANKS)


FOUR_RANKS = {
    "TP2xEP2": ["parallel.tp=2", "parallel.ep=2"],
    "PP2xEP2": ["parallel.pp=2", "parallel.ep=2"],
}


@pytest.mark.launches
def test_four_rank_layouts_match_single_process(reference: dict) -> None:
    per_rank = run_distributed(
        "tests.workers.layout_workers:layouts", 4, timeout_s=420, layouts=FOUR_RANKS, reference=reference
    )
    for rank_results in per_rank:
        _check(rank_results, FOUR_RANKS)


def test_transformer_engine_fused_norm_names_map_to_the_local_spec():
    # On GPUs the TE layer spec names a norm after the linear layer it is fused into; the bridge's
    # canonical names (and the adapters' rules) are the local spec's, so both specs share them.
    from grpo_megatron.bridge.layout import local_spec_name

    layer = "decoder.layers.3."
    assert (
        local_spec_name(layer + "self_attention.linear_qkv.layer_norm_weight")
        == layer + "input_layernorm.weight"
    )
    assert local_spec_name(layer + "mlp.linear_fc1.layer_norm_weight") == layer + "pre_mlp_layernorm.weight"
    assert (
        local_spec_name(layer + "self_attention.linear_kv_up_proj.layer_norm_weight")
        == layer + "self_attention.kv_layernorm.weight"
    )
    for unchanged in (
        layer + "self_attention.linear_qkv.weight",
        layer + "mlp.experts.local_experts.0.linear_fc1.weight",
    ):
        assert local_spec_name(unchanged) == unchanged
