"""The SGLang adapter without SGLang: it imports only when used, says how to install it, and its pure
parts (requests, outputs, bucket checks, weight-group layout, memory order, HTTP client) are right.
The data path through SGLang's own classes is tests/test_sglang_contract.py."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from grpo_megatron.config import load_config
from grpo_megatron.rollout.config import RolloutConfig, SGLangConfig
from grpo_megatron.rollout.engine import EngineLost, SamplingParams
from grpo_megatron.rollout.hf_routes import RouteLayout
from grpo_megatron.rollout.sglang.engine import SGLangEngine
from grpo_megatron.rollout.sglang.health import sigquit_while_starting
from grpo_megatron.rollout.sglang.launch import (
    INSTALL_HINT,
    EngineLaunch,
    SGLangUnavailableError,
    colocated_server_args,
    start_node_part,
)
from grpo_megatron.rollout.sglang.layout import (
    ColocatedLayout,
    colocated_group,
    colocated_layout,
    engine_address,
)
from grpo_megatron.rollout.sglang.nccl import (
    SGLangHttpClient,
    SGLangServerError,
    distributed_update_body,
    weight_group_layout,
)
from grpo_megatron.rollout.sglang.protocol import (
    completion_from_output,
    decode_routed_experts,
    generate_request,
    request_budgets,
    sample_seeds,
    sampling_params_dict,
    score_routes,
    teacher_forced_logprobs,
)
from grpo_megatron.rollout.sglang.weights import (
    aligned_order,
    bucket_errors,
    checkpoint_shapes,
)
from grpo_megatron.training.job import engine_spec
from tests.helpers.dist import REPO_ROOT
from tests.workers.bridge_workers import EXAMPLE, save_tiny_model

MOE_CONFIG = {"num_experts_per_tok": 2, "architectures": ["Qwen3MoeForCausalLM"]}
"""An MoE model's config.json, as far as the server arguments read it."""

# ----------------------------------------------------------------------------------------------------
# Lazy import and the install message


@pytest.mark.launches
def test_importing_the_module_does_not_import_sglang() -> None:
    code = "import sys, grpo_megatron.rollout.sglang.engine; print('sglang' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_constructing_without_sglang_says_how_to_install_it(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # unimportable here even where it is installed
    cfg = load_config(EXAMPLE, ["rollout.engine=sglang"])
    with pytest.raises(SGLangUnavailableError) as info:
        SGLangEngine(cfg.rollout, str(tmp_path))
    assert INSTALL_HINT in str(info.value)
    assert "pip install --no-deps -r requirements/gpu.txt" in str(info.value)
    assert "CUDA machine" in str(info.value)
    with pytest.raises(SGLangUnavailableError, match="rollout.engine=sglang needs SGLang"):
        SGLangEngine.from_config(engine_spec(cfg), ps=None)


def test_sglang_config_fields_are_validated() -> None:
    cfg = load_config(EXAMPLE, ["rollout.engine=sglang", "rollout.sglang.mode=disaggregated"])
    with pytest.raises(ValueError, match="sglang.mode=disaggregated needs rollout.sglang.server_urls"):
        cfg.rollout.validate()
    bad = RolloutConfig(
        sglang=SGLangConfig(
            tp=-1,
            ep=-2,
            server_urls=["node1:30000"],
            sync_master_port=0,
            server_args={"tp_size": 2, "ep_size": 2},
        )
    )
    with pytest.raises(ValueError) as info:
        bad.validate()
    for field in (
        "sglang.tp=-1",
        "sglang.ep=-2",
        "sglang.server_urls",
        "sglang.sync_master_port=0",
        "sets tp_size: set rollout.sglang.tp",
        "sets ep_size: set rollout.sglang.ep",
    ):
        assert field in str(info.value)
    good = load_config(
        EXAMPLE,
        [
            "rollout.engine=sglang",
            "rollout.sglang.mode=disaggregated",
            "rollout.sglang.server_urls=[http://a:30000,http://b:30000]",
            "rollout.sglang.tp=2",
        ],
    )
    good.rollout.validate()
    assert good.rollout.sglang.server_urls == ["http://a:30000", "http://b:30000"]


@pytest.mark.launches
def test_check_refuses_what_sglang_would_refuse_naming_the_field() -> None:
    """SGLang scores (the mismatch probe) at temperature 1 only: check says so before any rank starts."""
    import subprocess
    import sys

    demo = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_megatron",
            "check",
            str(demo),
            "rollout.engine=sglang",
            "rollout.temperature=0.7",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "rollout.temperature=0.7 with rollout.engine=sglang and rollout.probe_batch=4" in run.stderr
    assert "rollout.probe_batch=0" in run.stderr and "Traceback" not in run.stderr
    RolloutConfig(engine="sglang", temperature=0.7, probe_batch=0).validate()  # no probe, no rule


# ----------------------------------------------------------------------------------------------------
# Requests and outputs


def test_samples_of_a_prompt_get_distinct_seeds_and_a_seed_reproduces_them() -> None:
    import random

    rng = random.Random(0)
    seeded = sample_seeds(7, num_prompts=3, n=4, rng=rng)
    assert len(seeded) == 12 and len(set(seeded)) == 12
    assert seeded == sample_seeds(7, 3, 4, random.Random(99))  # the engine's rng plays no part
    assert sample_seeds(None, 3, 4, rng) != sample_seeds(None, 3, 4, rng)
    assert all(0 <= s < 2**63 for s in sample_seeds(2**70, 2, 2, rng))


def test_sampling_params_follow_the_interface() -> None:
    params = SamplingParams(
        n=4,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        max_new_tokens=16,
        stop_token_ids=(2, 7),
        stop_strings=("</answer>",),
    )
    sp = sampling_params_dict(params, seed=11)
    assert sp == {
        "max_new_tokens": 16,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "stop_token_ids": [2, 7],
        "stop": ["</answer>"],
        "no_stop_trim": True,
        "sampling_seed": 11,
    }
    assert "n" not in sp  # samples are separate requests (each with its own seed)
    assert sampling_params_dict(SamplingParams(greedy=True), seed=0)["top_k"] == 1


def test_each_request_gets_its_own_budget_within_the_context() -> None:
    # Multi-turn turns ask each episode for its own budget left (rollout/multiturn.py); SGLang refuses a
    # request whose input + max_new_tokens passes its context, so each row stays within it too.
    prompts = [[1] * 30, [1] * 5, [1] * 60, [1] * 64]
    params = SamplingParams(n=2, max_new_tokens=40, max_new_tokens_each=(27, 40, 40, 3))
    assert request_budgets(prompts, params, context=None) == [27, 40, 40, 3]
    # 60 + 40 > 64: cut to 4; a prompt that fills the context keeps its limit (SGLang names its length)
    assert request_budgets(prompts, params, context=64) == [27, 40, 4, 3]
    request = generate_request(prompts, params, random.Random(0), routes_enabled=False, context=64)
    assert [sp["max_new_tokens"] for sp in request.sampling_params] == [27, 27, 40, 40, 4, 4, 3, 3]
    uniform = SamplingParams(n=1, max_new_tokens=8)  # no per-prompt limits: every row max_new_tokens
    assert request_budgets(prompts, uniform, context=None) == [8] * 4
    assert SamplingParams(max_new_tokens=8, max_new_tokens_each=(3, 8)).sliced(1, 2).max_new_tokens_each == (
        8,
    )
    for bad in ((3,), (0, 8), (9, 1)):
        with pytest.raises(ValueError, match=r"max_new_tokens_each has \d limits for 2 prompts"):
            SamplingParams(max_new_tokens=8, max_new_tokens_each=bad).budgets(2)


def _routed(rows: int, layers: int, top_k: int) -> tuple[str, torch.Tensor]:
    ids_rlk = torch.arange(rows * layers * top_k, dtype=torch.int32).reshape(rows, layers, top_k) % 8
    encoded = base64.b64encode(ids_rlk.numpy().tobytes()).decode()
    return encoded, ids_rlk.transpose(0, 1)  # the Completion layout: [layers, rows, top_k]


def test_an_sglang_output_becomes_a_completion() -> None:
    prompt_len = 3
    encoded, expected = _routed(rows=prompt_len + 2 - 1, layers=2, top_k=2)
    output = {
        "text": "ab",
        "output_ids": [11, 2],
        "meta_info": {
            "output_token_logprobs": [[-0.25, 11, None], [-1.5, 2, None]],  # JSON turns tuples into lists
            "finish_reason": {"type": "stop", "matched": 2},
            "routed_experts": encoded,
            "weight_version": "3",
        },
    }
    layout = RouteLayout(num_layers=2, moe_layers=(0, 1), top_k=2, num_experts=8)
    c = completion_from_output(output, prompt_len, layout)
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([11, 2], [-0.25, -1.5], "stop")
    assert c.routed_experts is not None and torch.equal(c.routed_experts.int(), expected)
    # A report over every layer keeps only the MoE ones (DeepSeek-V3's first dense layers).
    dense_first = RouteLayout(num_layers=2, moe_layers=(1,), top_k=2, num_experts=8)
    routed = completion_from_output(output, prompt_len, dense_first).routed_experts
    assert routed is not None and torch.equal(routed.int(), expected[1:])
    output["meta_info"] |= {"finish_reason": {"type": "length", "length": 2}, "routed_experts": None}
    assert completion_from_output(output, prompt_len).finish_reason == "length"
    with pytest.raises(RuntimeError, match="finish_reason"):
        completion_from_output(
            output | {"meta_info": output["meta_info"] | {"finish_reason": {"type": "abort"}}}, 3
        )
    with pytest.raises(RuntimeError, match="return_logprob"):
        completion_from_output({"output_ids": [11, 2], "meta_info": {"finish_reason": {"type": "length"}}}, 3)


def test_routed_experts_that_do_not_fit_the_tokens_are_refused() -> None:
    encoded, _ = _routed(rows=4, layers=1, top_k=3)
    assert decode_routed_experts(None, 4) is None
    with pytest.raises(ValueError, match="routed expert ids"):
        decode_routed_experts(encoded, 5)
    with pytest.raises(ValueError, match="routes of 1 layers"):
        decode_routed_experts(
            encoded, 4, RouteLayout(num_layers=3, moe_layers=(1, 2), top_k=3, num_experts=8)
        )


def test_a_scores_routes_keep_the_rows_a_forward_takes() -> None:
    """SGLang reports a scored sequence's routes over ``length`` rows or ``length - 1`` (whether its
    prefill-only request counts the token it samples): the first ``length - 1`` are kept; none, or a
    count that fits neither, is refused."""
    layout = RouteLayout(num_layers=2, moe_layers=(0, 1), top_k=2, num_experts=8)
    for rows in (5, 4):
        encoded, expected = _routed(rows=rows, layers=2, top_k=2)
        routes = score_routes({"meta_info": {"routed_experts": encoded}}, 5, layout)
        assert torch.equal(routes.int(), expected[:, :4])
    with pytest.raises(RuntimeError, match="no routed experts"):
        score_routes({"meta_info": {}}, 5, layout)
    encoded, _ = _routed(rows=7, layers=2, top_k=2)
    with pytest.raises(RuntimeError, match="28 routed expert ids for a scored 5-token sequence"):
        score_routes({"meta_info": {"routed_experts": encoded}}, 5, layout)


def test_teacher_forced_logprobs_take_the_response_part() -> None:
    output = {
        "meta_info": {
            "input_token_logprobs": [[None, 1, None], [-0.1, 4, None], [-0.2, 5, None], [-0.3, 6, None]]
        }
    }
    assert teacher_forced_logprobs(output, [1, 4, 5, 6], prompt_len=2) == [-0.2, -0.3]
    with pytest.raises(RuntimeError, match="logprob_start_len=0"):
        teacher_forced_logprobs(output, [1, 4, 5], prompt_len=2)


# ----------------------------------------------------------------------------------------------------
# Weight buckets and the weight group


def test_aligned_order_puts_wider_elements_first_and_keeps_order_within_a_width() -> None:
    bucket = [
        ("h", torch.zeros(3, dtype=torch.bfloat16)),
        ("f1", torch.zeros(1)),
        ("d", torch.zeros(1).double()),
        ("f2", torch.zeros(2)),
        ("b", torch.zeros(1, dtype=torch.uint8)),
    ]
    assert [n for n, _ in aligned_order(bucket)] == ["d", "f1", "f2", "h", "b"]
    offset = 0
    for _, t in aligned_order(bucket):
        assert offset % t.element_size() == 0
        offset += t.numel() * t.element_size()


def test_bucket_checks_against_the_checkpoint_name_every_problem(tmp_path: Path) -> None:
    save_tiny_model("qwen3_moe", tmp_path, seed=0)
    shapes = checkpoint_shapes(tmp_path)
    name = "model.layers.0.mlp.experts.1.gate_proj.weight"
    assert shapes[name] == (32, 64) and "model.embed_tokens.weight" in shapes
    good = [(name, torch.zeros(32, 64)), ("model.norm.weight", torch.zeros(64, dtype=torch.bfloat16))]
    assert bucket_errors(good, shapes, "ckpt") == []
    bad = [
        (name, torch.zeros(64, 32)),
        ("model.nope.weight", torch.zeros(1)),
        ("model.norm.weight", torch.zeros(64, dtype=torch.int64)),
    ]
    errors = bucket_errors(bad, shapes, "ckpt")
    assert len(errors) == 3
    assert f"{name}: shape (64, 32), ckpt has (32, 64)" in errors[0]
    assert "no such tensor in ckpt" in errors[1] and "not a floating-point" in errors[2]
    assert checkpoint_shapes(tmp_path / "missing") == {}


def test_weight_group_layout_and_update_request_body() -> None:
    assert weight_group_layout([2, 4, 1]) == (8, [1, 3, 7])
    bucket = aligned_order([("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(5))])
    body = distributed_update_body(bucket, group_name="g", flush_cache=False, weight_version=None)
    assert body == {
        "names": ["b", "a"],
        "dtypes": ["float32", "bfloat16"],
        "shapes": [[5], [2, 3]],
        "group_name": "g",
        "flush_cache": False,
        "load_format": "flattened_bucket",
    }
    assert (
        distributed_update_body(bucket, group_name="g", flush_cache=True, weight_version="4")[
            "weight_version"
        ]
        == "4"
    )
    json.dumps(body)


def test_colocated_groups_and_engine_arguments() -> None:
    assert colocated_group(5, 4) == (4, [4, 5, 6, 7]) and colocated_group(0, 1) == (0, [0])
    rollout = RolloutConfig(
        sglang=SGLangConfig(tp=2, server_args={"attention_backend": "fa3", "log_level": "info"}),
        gpu_memory_utilization=0.4,
    )
    args = colocated_server_args(
        rollout, "/m", EngineLaunch("bfloat16", 5, base_gpu_id=2, ep_size=2), MOE_CONFIG
    )
    assert args["tp_size"] == 2 and args["ep_size"] == 2 and args["base_gpu_id"] == 2  # tp: rollout.sglang.tp
    assert args["mem_fraction_static"] == 0.4 and args["random_seed"] == 5 and args["dtype"] == "bfloat16"
    assert args["enable_memory_saver"] is True and args["enable_return_routed_experts"] is True
    assert args["attention_backend"] == "fa3" and args["log_level"] == "info"  # the user's args win
    dense = colocated_server_args(rollout, "/m", EngineLaunch("float32"), {"model_type": "qwen2"})
    assert dense["enable_return_routed_experts"] is False
    assert json.loads(dense["json_model_override_args"]) == {"architectures": ["Qwen2ForCausalLM"]}
    on_cpu = colocated_server_args(
        rollout, "/m", EngineLaunch(device="cpu"), MOE_CONFIG, weights_on_disk=False
    )
    assert (
        on_cpu["enable_memory_saver"] is False
        and on_cpu["device"] == "cpu"
        and on_cpu["load_format"] == "dummy"
    )


def test_an_engine_inside_a_node_is_led_by_its_first_rank_on_its_own_gpus() -> None:
    # world 16, 8 GPUs per node, TP 8: two engines, one per node; rank r is local GPU r % 8
    layouts = [colocated_layout(r, 16, 8, 8, r % 8) for r in range(16)]
    assert [lay.leader for lay in layouts] == [0] * 8 + [8] * 8
    assert layouts[9].members == tuple(range(8, 16)) and layouts[9].nnodes == 1 and not layouts[9].multi_node
    assert [r for r, lay in enumerate(layouts) if lay.starter] == [0, 8]
    assert layouts[8].base_gpu_id == 0 and layouts[8].node_rank == 0
    # TP 2: the leader's local rank is the engine's first GPU (as before multi-node engines existed)
    assert colocated_layout(5, 16, 2, 8, 5) == ColocatedLayout(4, (4, 5), 1, 0, False, 4)
    assert colocated_layout(12, 16, 2, 8, 4) == ColocatedLayout(12, (12, 13), 1, 0, True, 4)


def test_an_engine_across_nodes_has_a_starter_per_node_and_one_leader() -> None:
    # world 16, 8 GPUs per node, TP 16: one engine over both nodes
    layouts = [colocated_layout(r, 16, 16, 8, r % 8) for r in range(16)]
    assert {lay.leader for lay in layouts} == {0} and {lay.members for lay in layouts} == {tuple(range(16))}
    assert {lay.nnodes for lay in layouts} == {2} and all(lay.multi_node for lay in layouts)
    assert [lay.node_rank for lay in layouts] == [0] * 8 + [1] * 8
    assert [r for r, lay in enumerate(layouts) if lay.starter] == [0, 8]  # local rank 0 of each node
    assert {lay.base_gpu_id for lay in layouts} == {0}
    # the DeepSeek-V3 recipe's shape: 32-GPU engines over 4 nodes; rank 40 is node 1 of the second
    lay = colocated_layout(40, 1024, 32, 8, 0)
    assert (lay.leader, lay.nnodes, lay.node_rank, lay.starter) == (32, 4, 1, True)
    assert lay.members == tuple(range(32, 64))
    assert (
        not colocated_layout(63, 1024, 32, 8, 7).starter
        and colocated_layout(63, 1024, 32, 8, 7).node_rank == 3
    )


@pytest.mark.parametrize(
    ("tp", "world", "choices"),
    [
        (12, 16, "[1, 2, 4, 8, 16]"),
        (3, 16, "[1, 2, 4, 8, 16]"),
        (16, 24, "[1, 2, 4, 8, 24]"),
        (32, 48, "[1, 2, 4, 8, 16, 24, 48]"),
    ],
)
def test_an_engine_width_that_does_not_tile_the_nodes_is_refused_with_the_choices(
    tp: int, world: int, choices: str
) -> None:
    with pytest.raises(ValueError) as info:
        colocated_layout(0, world, tp, 8, 0)
    message = str(info.value)
    assert f"rollout.sglang.tp={tp}" in message and "8 GPUs per node (LOCAL_WORLD_SIZE)" in message
    assert f"set rollout.sglang.tp to one of {choices}" in message


def test_the_engine_address_is_its_first_node_and_the_nodes_must_be_whole_and_node_major() -> None:
    lay = colocated_layout(9, 16, 16, 8, 1)
    ranks = [("node-a", r % 8) for r in range(8)] + [("node-b", r % 8) for r in range(8)]
    assert engine_address(lay, ranks, 41234, 8) == "node-a:41234"
    bad_cases = {
        "interleaved ranks": [(f"node-{'ab'[r % 2]}", r // 2) for r in range(16)],
        "one host for both blocks": [("node-a", r % 8) for r in range(16)],
        "local ranks out of order": [("node-a", 7 - r) for r in range(8)] + ranks[8:],
    }
    for case, bad in bad_cases.items():
        with pytest.raises(ValueError) as info:
            engine_address(lay, bad, 41234, 8)
        message = str(info.value)
        assert "rollout.sglang.tp=16" in message and "ranks 0-7 on" in message, case
        assert "torchrun --nnodes N --nproc-per-node 8" in message and "at most 8" in message, case


def test_server_args_of_each_node_of_a_multi_node_engine() -> None:
    rollout = RolloutConfig(sglang=SGLangConfig(tp=16), gpu_memory_utilization=0.5)
    launch = EngineLaunch("bfloat16", 7, tp_size=16, ep_size=16, nnodes=2, dist_init_addr="node-a:41234")
    first = colocated_server_args(rollout, "/m", launch, MOE_CONFIG, node_rank=0)
    second = colocated_server_args(rollout, "/m", launch, MOE_CONFIG, node_rank=1)
    assert first["tp_size"] == 16 and first["nnodes"] == 2 and first["dist_init_addr"] == "node-a:41234"
    assert first["node_rank"] == 0 and second["node_rank"] == 1 and first["base_gpu_id"] == 0
    assert {k: v for k, v in first.items() if k != "node_rank"} == {
        k: v for k, v in second.items() if k != "node_rank"
    }
    assert first["enable_memory_saver"] is True and first["random_seed"] == 7 and first["ep_size"] == 16
    # inside a node nothing of SGLang's multi-node launch is passed (the arguments are as before)
    eight = RolloutConfig(sglang=SGLangConfig(tp=8))
    single = colocated_server_args(eight, "/m", EngineLaunch("bfloat16", 7), MOE_CONFIG)
    assert not {"nnodes", "node_rank", "dist_init_addr"} & set(single)
    # what the layout decides cannot be overridden across nodes
    clash = RolloutConfig(sglang=SGLangConfig(tp=16, server_args={"nnodes": 4, "base_gpu_id": 2}))
    with pytest.raises(ValueError, match=r"rollout.sglang.server_args sets \['base_gpu_id', 'nnodes'\]"):
        colocated_server_args(clash, "/m", launch, MOE_CONFIG, node_rank=1)


def test_from_config_takes_an_engine_across_nodes_and_refuses_one_that_does_not_tile_them(
    monkeypatch,
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    ps = SimpleNamespace(rank=8, world_size=16, device="cpu", tp=1, pp=1, cp=1)
    cfg = load_config(EXAMPLE, ["rollout.engine=sglang", "rollout.sglang.tp=12"])
    with pytest.raises(
        ValueError, match=r"engines of 12 GPUs \(rollout.sglang.tp=12\) do not fit 16 ranks with 8 GPUs"
    ):
        SGLangEngine.from_config(engine_spec(cfg), ps)
    # 16 over two nodes of 8 is a valid layout: rank 8 is not its leader (rank 0 drives the engine)
    cfg = load_config(EXAMPLE, ["rollout.engine=sglang", "rollout.sglang.tp=16"])
    assert SGLangEngine.from_config(engine_spec(cfg), ps) is None


def test_engines_of_several_gpus_with_restarts_are_led_from_their_first_rank(monkeypatch) -> None:
    """Issue 41: rollout.recovery.max_restarts > 0 takes an engine of several GPUs as it takes one without
    (its other ranks get None: they hold members, which restart with it); an engine across nodes is no
    longer refused (tests/test_sglang_train.py restarts one over two nodes with the real engine)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    ps = SimpleNamespace(rank=1, world_size=16, device="cpu", tp=1, pp=1, cp=1)
    restarts = ["rollout.engine=sglang", "rollout.recovery.max_restarts=2", "rollout.sglang.ep=1"]
    for tp in (8, 16):
        spec = engine_spec(load_config(EXAMPLE, [*restarts, f"rollout.sglang.tp={tp}"]))
        assert SGLangEngine.from_config(spec, ps) is None


def test_the_fault_injection_signals_the_last_tp_ranks_scheduler() -> None:
    from grpo_megatron.rollout.sglang.engine import _tp_rank

    titles = [
        "sglang::scheduler",
        "sglang::scheduler_TP0",
        "sglang::scheduler_TP1",
        "sglang::scheduler_DP0_TP3_EP1",
        "sglang::detokenizer",
    ]
    assert [_tp_rank(t) for t in titles] == [0, 0, 1, 3, 0]


def test_a_lost_engine_of_several_gpus_is_resynced_on_every_gpu_and_restarts_report_wall_seconds() -> None:
    """The engine recovery for an engine of several GPUs (rollout/recovery.py), built over fakes of the
    engine contract (``WeightSink``) and of the ranks' agreement: the ranks a restart resyncs (every rank
    of each lost engine), a further node's part restarted at its leader's fresh address, and
    ``engine/restart_s`` as the wall seconds of each restart event (two engines restarted together
    once, a restart found inside another one's resync within it), ``engine/restarts`` the engines."""
    from grpo_megatron.rollout.engine import EngineParts, WeightSink
    from grpo_megatron.rollout.recovery import EngineRecovery

    class Member(
        WeightSink
    ):  # SGLangSyncMember's side: restarted with its leader, at the leader's fresh address
        def __init__(self) -> None:
            self.restarted: list[str | None] = []

        def restart(self, address: str | None = None) -> None:
            self.restarted.append(address)

        def check_manifest(self, manifest, version):  # noqa: ANN001, ANN202
            return []

        def update_weights(self, bucket, *, version, last):  # noqa: ANN001, ANN202
            return None

        def shutdown(self) -> None:
            return None

    # Rank 1 of 5: a member of the engine led from rank 0 (its further node's part, say); the engines of
    # ranks 0 and 2 are lost together, and rank 2's again inside their resync (a weight-sync death).
    # The agreement answers for every rank: a restart asks for the leaders' fresh addresses (rank 0's), then
    # for errors (none).
    calls: list[object] = []

    def gather(obj):  # noqa: ANN001, ANN202
        calls.append(obj)
        return ["node-a:41234", obj, None, None, None] if len(calls) % 2 else [None] * 5

    synced: list[tuple[int, list[int]]] = []

    def resync(version: int, ranks: list[int]) -> None:
        synced.append((version, list(ranks)))
        if sum(isinstance(v, int) for v, _ in synced) == 1:
            time.sleep(0.2)
            recovery.restart_engines([2], version, resync=True)

    member = Member()
    parts = EngineParts(member=member)

    @contextlib.contextmanager
    def starting():  # noqa: ANN202 - the job's ColocatedMemory.restart_visit: trainer out, then back
        synced.append(("trainer out", []))  # type: ignore[arg-type]
        yield
        synced.append(("trainer back", []))  # type: ignore[arg-type]

    recovery = EngineRecovery(
        5, 1, [0, 2, 4], {0: (0, 1), 2: (2, 3), 4: (4,)}, parts, gather, resync, starting=starting
    )
    assert recovery.ranks_of([4, 6]) == [4, 6]
    assert [recovery.leader_of(rank) for rank in (0, 1, 3, 4, 6)] == [
        0,
        0,
        2,
        4,
        6,
    ]  # a loss counts for its engine
    assert recovery.metrics() == {}
    seconds = recovery.restart_engines([0, 2], 7, resync=True)
    # Issue 51 item 2: the part restarts with the trainer's state out (as at the first start), which is
    # back before the resync; the nested restart (engine 2's, on other ranks) leaves rank 1's trainer be.
    assert synced == [("trainer out", []), ("trainer back", []), (7, [0, 1, 2, 3]), (7, [2, 3])]
    assert member.restarted == ["node-a:41234"]
    assert member.life == 0  # the fake counts nothing; SGLangSyncMember.restart counts its lives
    assert recovery.restarts == 3 and recovery.seconds == [seconds] and seconds >= 0.2
    assert recovery.metrics() == {"engine/restarts": 3.0, "engine/restart_s": seconds}
    assert recovery.metrics() == {}
    # past the bound: every rank raises naming the lost engine (rank 1's loss counts for engine 0)
    lost = EngineLost(1, "node-b", "process sglang::scheduler_TP1 (pid 7) is gone", "its last line", "/log")
    recovery.max_restarts = 3
    recovery.gather = lambda report: [(None, None), report, (None, None), (None, None), (None, None)]
    with pytest.raises(
        RuntimeError,
        match=r"rollout generate: 1 engine\(s\) lost, past rollout.recovery.max_restarts=3 "
        r"\(3 restart\(s\) so far\).*\n  engine 0 \(rank 1 on node-b\) was lost",
    ):
        recovery.recover(None, lost, "rollout generate", version=7)
    zero = EngineRecovery(3, 1, [0, 2, 4], {0: (0, 1)}, parts, recovery.gather)  # no resync: bound 0
    with pytest.raises(
        RuntimeError, match=r"engine 0 \(rank 1 on node-b\) was lost: process sglang::scheduler_TP1"
    ):
        zero.recover(None, lost, "rollout generate", version=7)


def _sigterm_ignored(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGTERM (its ``SigIgn`` mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


@pytest.mark.launches
def test_a_further_node_starts_its_part_like_the_leader_without_blocking(monkeypatch, tmp_path: Path) -> None:
    """``start_node_part`` against SGLang's real entry point name (``sglang.Engine``), whose multi-node
    constructor cannot run here (see bench/gpu_check.sh): the arguments it is given, the environment
    SGLang reads on node_rank >= 1 to return instead of blocking, and the leader's protections
    (``start_colocated``), seen in a process the constructor spawns as SGLang spawns its schedulers:
    SIGTERM ignored there, its output in the rank's engine log, recorded for the health checks, and
    the trainer's SIGTERM handler back in place afterwards."""
    import sglang

    save_tiny_model("qwen3_moe", tmp_path, seed=0)
    started: list[dict] = []
    children: list[subprocess.Popen] = []

    class Recorder:
        def __init__(self, **kwargs) -> None:
            script = "import time; print('scheduler of node 1 up', flush=True); time.sleep(60)"
            children.append(subprocess.Popen([sys.executable, "-c", script]))
            started.append({**kwargs, "env": os.environ.get("SGLANG_BLOCK_NONZERO_RANK_CHILDREN")})

        def shutdown(self) -> None:
            children[-1].kill()

    def trainer_sigterm(signum, frame) -> None:  # stands for distributed/preemption.py's handler
        return None

    monkeypatch.setattr(sglang, "Engine", Recorder)
    monkeypatch.delenv("SGLANG_BLOCK_NONZERO_RANK_CHILDREN", raising=False)
    saved = signal.signal(signal.SIGTERM, trainer_sigterm), signal.getsignal(signal.SIGQUIT)
    cfg = load_config(EXAMPLE, ["rollout.engine=sglang", "rollout.sglang.tp=16", f"model.hf_path={tmp_path}"])
    spec = dataclasses.replace(engine_spec(cfg), log_dir=tmp_path / "logs")
    ps = SimpleNamespace(rank=8, device="cuda:0")  # a GPU node's arguments (nothing here touches CUDA)
    layout = colocated_layout(8, 16, 16, 8, 0)
    try:
        _, health = start_node_part(spec, layout, "node-a:41234", 2, ps, weights_on_disk=True)  # type: ignore[arg-type]
        proc = children[-1]
        ignored = _sigterm_ignored(proc.pid)
        handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGQUIT)
        time.sleep(0.5)
        proc.kill()
        proc.wait()
        replayed = load_config(
            EXAMPLE,
            [
                "rollout.engine=sglang",
                "rollout.sglang.tp=16",
                f"model.hf_path={tmp_path}",
                "algorithm.routing_replay=r3",
            ],
        )
        again = dataclasses.replace(engine_spec(replayed), log_dir=tmp_path / "logs")
        start_node_part(again, layout, "node-a:41234", 2, ps, weights_on_disk=True)  # type: ignore[arg-type]
    finally:
        for child in children:
            child.kill()
            child.wait()
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGQUIT, saved[1])
    args = started[0]
    assert args["env"] == "0" and args["nnodes"] == 2 and args["node_rank"] == 1 and args["tp_size"] == 16
    assert args["ep_size"] == 2  # the placement's engine EP, as on the leader's node
    assert args["dist_init_addr"] == "node-a:41234" and args["base_gpu_id"] == 0
    assert args["random_seed"] == cfg.train.seed  # the leader's (rank 0's) seed on every node
    assert args["enable_return_routed_experts"] is False  # an MoE model, but routing replay is off
    assert started[-1]["enable_return_routed_experts"] is True
    # the leader's protections, from the same start (launch.py:start_colocated)
    assert (
        args["custom_sigquit_handler"] is sigquit_while_starting
    )  # a scheduler failing at start names the engine
    assert ignored, "the node part's scheduler does not ignore SIGTERM: a preemption would kill it mid-save"
    assert (
        handlers[0] is trainer_sigterm and handlers[1] is not saved[1]
    )  # SIGTERM back; SIGQUIT names the engine
    assert [p.pid for p in health.procs] == [children[0].pid] and health.rank == 8
    assert health.log_path.parent == tmp_path / "logs" and health.log_path.name.startswith("engine-rank8-")
    assert "scheduler of node 1 up" in health.log_path.read_text()
    with pytest.raises(EngineLost, match=r"the SGLang engine of rank 8 on .* was lost: process .* is gone"):
        health.check()  # the member checks it before each weight load (member.py)


class RequestRecorder:
    """What an SGLang server is sent: every generate request's options, answered with one token per row
    (and, when asked, its routes in SGLang's encoding: base64 int32 ``[rows, layers, top_k]``)."""

    def __init__(self, layout: RouteLayout) -> None:
        self.layout = layout
        self.requests: list[dict] = []

    def generate(self, input_ids, sampling_params, **options):
        self.requests.append(options)
        out = []
        for ids in input_ids:
            meta = {"output_token_logprobs": [(-0.5, 5, None)], "finish_reason": {"type": "length"}}
            if options.get("logprob_start_len") == 0:  # a score: every input token's logprob
                meta["input_token_logprobs"] = [
                    (None if i == 0 else -0.1, t, None) for i, t in enumerate(ids)
                ]
            if options.get("return_routed_experts"):
                # row r of layer l: expert (r + l) mod 8, so a test can see which rows were kept
                rows = torch.arange(len(ids), dtype=torch.int32)[:, None, None]
                layers = torch.arange(self.layout.num_layers, dtype=torch.int32)[None, :, None]
                routes = ((rows + layers) % 8).expand(-1, -1, self.layout.top_k).contiguous()
                meta["routed_experts"] = base64.b64encode(routes.numpy().tobytes()).decode()
            out.append({"output_ids": [5], "meta_info": meta})
        return out


def test_sglang_is_asked_for_routed_experts_only_by_the_rollouts_that_replay_them(tmp_path: Path) -> None:
    """Issue 36 item 6: routes cost SGLang about 2 KB per token through its detokenizer. They are
    decided once (``engine_spec``: algorithm.routing_replay=r3): only then is an MoE engine started able
    to report them, and only the training rollouts' requests (``SamplingParams.routes``, set by
    ``training/groups.py:training_params`` from ``RolloutFleet.routes``) ask, for every input position
    (the replay covers the prompt too); evaluation's requests never do."""
    from grpo_megatron.training.phases.rollout import Rollout

    save_tiny_model("qwen3_moe", tmp_path, seed=0)
    hf = json.loads((tmp_path / "config.json").read_text())
    off = load_config(EXAMPLE, ["rollout.engine=sglang", f"model.hf_path={tmp_path}"])
    r3 = load_config(
        EXAMPLE, ["rollout.engine=sglang", f"model.hf_path={tmp_path}", "algorithm.routing_replay=r3"]
    )
    for cfg, replayed in ((off, False), (r3, True)):
        assert engine_spec(cfg).record_routes is replayed
        args = colocated_server_args(
            cfg.rollout, "/m", EngineLaunch(routes=engine_spec(cfg).record_routes), hf
        )
        assert args["enable_return_routed_experts"] is replayed
    layout = RouteLayout.from_hf(hf)
    assert layout is not None
    rollout = Rollout(None, r3.rollout, eos_id=2)  # type: ignore[arg-type]  # params only
    prompts = [[1, 5, 9], [1, 7]]
    for started_with_routes in (True, False):
        recorder = RequestRecorder(layout)
        engine = SGLangEngine(
            r3.rollout,
            str(tmp_path),
            EngineLaunch(device="cpu", routes=started_with_routes),
            servers=[recorder],
        )
        train = engine.generate(prompts, rollout.params(n=2, seed=1, routes=True))
        evaluation = engine.generate(prompts, rollout.params(n=1, seed=1, greedy=True))
        sampled_eval = engine.generate(prompts, rollout.params(n=2, seed=2))
        asked, *unasked = recorder.requests
        assert asked.get("return_routed_experts", False) is started_with_routes
        assert "routed_experts_start_len" not in asked  # 0: every input position, prompt included
        assert all("return_routed_experts" not in r for r in unasked) and all(
            r["return_logprob"] for r in unasked
        )
        routed = [c.routed_experts for g in train for c in g]
        if started_with_routes:
            assert all(
                r is not None and r.shape == (len(layout.moe_layers), 3, layout.top_k) for r in routed[:2]
            )
        else:
            assert routed == [None] * 4
        assert all(c.routed_experts is None for g in evaluation + sampled_eval for c in g)
        # The mismatch probe's score asks too (an H100 run of gpu_check's r3 stage, 2026-12-05, found
        # its replayed probe empty): rows [0, len - 1) of every MoE layer, the rows a forward takes.
        recorder.requests.clear()
        sequences = [[1, 5, 9, 4], [1, 7, 3]]
        scored, score_routes = engine.score_with_routes(sequences, [2, 1], temperature=1.0)
        assert scored == [[-0.1, -0.1], [-0.1, -0.1]] and engine.score(sequences, [2, 1], 1.0) == scored
        (asked_score, plain_score) = recorder.requests
        assert asked_score.get("return_routed_experts", False) is started_with_routes
        assert "return_routed_experts" not in plain_score
        if started_with_routes:
            assert score_routes is not None
            for seq, r in zip(sequences, score_routes, strict=True):
                moe = torch.tensor(layout.moe_layers)[:, None]
                rows = torch.arange(len(seq) - 1)[None, :]
                assert r.shape == (len(layout.moe_layers), len(seq) - 1, layout.top_k)
                assert torch.equal(r[..., 0].long(), (rows + moe) % 8)
        else:
            assert score_routes is None


# ----------------------------------------------------------------------------------------------------
# HTTP client against a loopback server that answers like SGLang's


class _FakeServer(BaseHTTPRequestHandler):
    requests: list = []
    healthy = True

    def _answer(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.requests.append(("GET", self.path, None))
        if self.path == "/health_generate":
            self._answer(200 if self.healthy else 503, {})
        elif self.path == "/get_server_info":
            self._answer(200, {"tp_size": 2})
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(("POST", self.path, body))
        if self.path == "/generate":
            self._answer(200, [{"output_ids": [3], "meta_info": {}} for _ in body["input_ids"]])
        elif self.path == "/init_weights_update_group":
            self._answer(
                400, {"success": False, "message": "Failed to initialize custom process group: timeout."}
            )
        else:
            self._answer(200, {"success": True, "message": "ok"})

    def log_message(self, *args) -> None:
        return None


@pytest.fixture
def fake_server():
    _FakeServer.requests, _FakeServer.healthy = [], True
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FakeServer
    server.shutdown()
    server.server_close()


def test_http_client_calls_sglangs_endpoints_and_reports_failures(fake_server) -> None:
    url, handler = fake_server
    client = SGLangHttpClient(url + "/", timeout_s=10)
    assert client.healthy() and client.tp_size() == 2
    out = client.generate(
        input_ids=[[1, 2], [3]], sampling_params=[{"max_new_tokens": 1}] * 2, return_logprob=True
    )
    assert len(out) == 2
    client.release_memory_occupation(["weights"])
    client.resume_memory_occupation(None)
    client.update_weights_from_distributed(names=["a"], dtypes=["float32"], shapes=[[1]], group_name="g")
    with pytest.raises(SGLangServerError, match="init_weights_update_group answered 400.*timeout"):
        client.init_weights_update_group(
            master_address="h", master_port=1, rank_offset=1, world_size=2, group_name="g"
        )
    posted = [(path, body) for method, path, body in handler.requests if method == "POST"]
    generate_body = {
        "input_ids": [[1, 2], [3]],
        "sampling_params": [{"max_new_tokens": 1}] * 2,
        "return_logprob": True,
    }
    assert posted[0] == ("/generate", generate_body)
    assert posted[1:4] == [
        ("/release_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": None}),
        (
            "/update_weights_from_distributed",
            {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"},
        ),
    ]
    handler.healthy = False
    assert not client.healthy()
    with pytest.raises(SGLangServerError, match="unreachable"):
        SGLangHttpClient("http://127.0.0.1:9", timeout_s=2).tp_size()


def test_each_engine_gpu_needs_dense_tensors_and_the_experts_of_its_ep_block() -> None:
    from grpo_megatron.rollout.sglang.shards import check_expert_placement, moe_ep_rank, rank_needs

    hf = {"num_experts": 8, "num_experts_per_tok": 2}
    # SGLang strides its MoE EP groups by moe_tp = tp / ep: TP rank r is EP rank r // moe_tp.
    assert [moe_ep_rank(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]
    assert [moe_ep_rank(r, 4, 4) for r in range(4)] == [0, 1, 2, 3]
    assert rank_needs(hf, 4, 1, 3) is None  # no EP inside the engine: everything, everywhere
    needs = rank_needs(hf, 4, 2, 2)  # EP rank 1 of 2: experts 4..7
    assert needs is not None
    assert needs("model.layers.0.self_attn.q_proj.weight") and needs("model.embed_tokens.weight")
    assert needs("model.layers.0.mlp.gate.weight")  # the router is dense
    assert needs("model.layers.1.mlp.experts.4.gate_proj.weight") and needs(
        "model.layers.1.mlp.experts.7.down_proj.weight"
    )
    assert not needs("model.layers.1.mlp.experts.3.up_proj.weight")
    assert needs("model.layers.1.mlp.shared_experts.gate_proj.weight")  # DeepSeek's shared experts: dense
    assert not rank_needs({"num_local_experts": 8}, 2, 2, 0)(
        "model.layers.0.block_sparse_moe.experts.5.w1.weight"
    )
    import pickle

    assert pickle.loads(pickle.dumps(needs)) == needs  # travels in the plan's metadata exchange
    # The EP is rollout/placement.py's (tests/test_placement.py); expert placements we cannot follow
    # are refused by name.
    check_expert_placement({"attention_backend": "fa3", "enable_eplb": False})
    for args, match in (
        ({"enable_eplb": True}, "enable_eplb"),
        ({"ep_num_redundant_experts": 8}, "ep_num_redundant_experts"),
        ({"moe_dp_size": 2}, "moe_dp_size"),
    ):
        with pytest.raises(ValueError, match=match) as err:
            check_expert_placement(args)
        assert "rollout.sglang.server_args" in str(err.value)


def test_sync_groups_are_the_distinct_multi_gpu_engines_in_one_order() -> None:
    from grpo_megatron.rollout.weight_sync import sync_groups

    assert sync_groups([(0, 1), (0, 1), (2, 3), (2, 3), ()]) == [(0, 1), (2, 3)]
    assert sync_groups([(), ()]) == []


_SIGQUIT_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from grpo_megatron.rollout.sglang.health import EngineProcesses
health = EngineProcesses(0, Path(sys.argv[1]))
signal.signal(signal.SIGQUIT, health.on_sigquit())
if sys.argv[2] == "recoverable":  # rollout.recovery.max_restarts > 0: what waits is cancelled, the rank lives
    health.recoverable, health.on_lost = True, lambda: print("cancelled", flush=True)
if sys.argv[2] == "stopping":
    with health.engine_only_shutdown():
        os.kill(os.getpid(), signal.SIGQUIT)
        time.sleep(0.2)
os.kill(os.getpid(), signal.SIGQUIT)  # after the engine's shutdown: still one of its schedulers
time.sleep(0.2)
print("survived")
try:  # with every process alive (SGLang's scheduler watchdog: a forward without progress), recoverable: lost
    health.check()
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_sigterm_ignored_while_engine_processes_start_then_the_handler_is_back(tmp_path: Path) -> None:
    """What the engine's processes and torch's shared-memory manager are started under: SIGTERM
    ignored (they keep it through exec), the process's own handler back after; off the main thread
    nothing changes. Standard output goes to the log meanwhile."""
    import signal

    from grpo_megatron.rollout.sglang.health import output_to, sigterm_ignored

    def handler(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with sigterm_ignored() as ignored:
            assert ignored and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
            child = subprocess.run(["grep", "SigIgn", "/proc/self/status"], capture_output=True, text=True)
        assert signal.getsignal(signal.SIGTERM) is handler
        assert int(child.stdout.split()[1], 16) & (1 << (signal.SIGTERM - 1))  # the child ignores it
        seen: list[object] = []

        def off_main() -> None:
            with sigterm_ignored() as ignored_there:
                seen.append((ignored_there, signal.getsignal(signal.SIGTERM)))

        thread = threading.Thread(target=off_main)
        thread.start()
        thread.join()
        assert seen == [(False, handler)]
    finally:
        signal.signal(signal.SIGTERM, previous)
    with output_to(tmp_path / "logs" / "engine.log"):
        subprocess.run(["echo", "from the engine"], check=True)
    assert (tmp_path / "logs" / "engine.log").read_text() == "from the engine\n"


@pytest.mark.launches
@pytest.mark.parametrize("mode", ["running", "stopping", "recoverable"])
def test_sigquit_ends_the_rank_unless_it_is_shutting_the_engine_down(tmp_path: Path, mode: str) -> None:
    """A scheduler's SIGQUIT ends the rank with EXIT_ENGINE_DIED while the engine runs; once the rank
    shuts the engine down (a TP2 engine's schedulers are killed one after the other, and the last
    one sends SIGQUIT from its broken collective) it is expected and the rank goes on. With
    rollout.recovery.max_restarts > 0 (issue 41) it only cancels what waits on the engine."""
    from grpo_megatron.rollout.sglang.health import EXIT_ENGINE_DIED

    (tmp_path / "engine.log").write_text("scheduler line\n")
    proc = subprocess.run(
        [sys.executable, "-c", _SIGQUIT_SCRIPT, str(tmp_path / "engine.log"), mode],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    if mode == "running":
        assert proc.returncode == EXIT_ENGINE_DIED and "scheduler line" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr
        assert ("cancelled" in proc.stdout) == (mode == "recoverable")
        assert ("EngineLost" in proc.stdout and "watchdog_timeout" in proc.stdout) == (mode == "recoverable")


@pytest.mark.launches
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_generation_waiting_on_a_dead_or_stopped_scheduler_ends_in_engine_lost(
    tmp_path: Path, fault: str
) -> None:
    """Issue 41: SGLang's tokenizer manager awaits a lost scheduler's answer with no deadline. The wait
    for the generation (ServerGuard, every WATCH_S) finds the process dead, or stopped past the health
    deadline, cancels the tasks on the engine's event loop (the generation thread's run_until_complete
    ends) and raises EngineLost naming the process and the log. A real process and a real loop."""
    import asyncio

    import psutil

    from grpo_megatron.rollout.engine import EngineLost
    from grpo_megatron.rollout.sglang.health import EngineProcesses
    from grpo_megatron.rollout.sglang.watch import ServerGuard, cancel_requests

    (tmp_path / "engine.log").write_text("scheduler line\n")
    health = EngineProcesses(0, tmp_path / "engine.log")
    scheduler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    health.procs, health.names = [psutil.Process(scheduler.pid)], {scheduler.pid: "sched"}
    health.recoverable = True

    def watch() -> None:  # SGLangEngine._watch with a 0.3 s deadline
        health.check()
        why = health.stopped(0.3)
        if why is not None:
            raise health.lost(why)

    server = SimpleNamespace(loop=asyncio.new_event_loop())
    guard = ServerGuard([server], watch=watch, cancel=cancel_requests)
    try:
        future = guard.start(lambda servers: servers[0].loop.run_until_complete(asyncio.Event().wait()))
        os.kill(scheduler.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineLost, match="process sched") as lost:
            guard.result(future)
        assert time.monotonic() - start < 5 and future.done()  # the generation thread ended
        assert ("stopped (state T)" in str(lost.value)) == (fault == "stop")
        assert "scheduler line" in str(lost.value)  # the log's tail
    finally:
        scheduler.kill()
        scheduler.wait()
        guard.abandon()
        server.loop.close()


@pytest.mark.parametrize("answer_s", [0.2, None])
def test_a_scheduler_that_leaves_a_state_request_unanswered_past_the_deadline_is_lost(
    answer_s: float | None,
) -> None:
    """Issue 41: a scheduler alive but hung. While a generation is awaited, the guard's SchedulerProbe
    sends a state request on the engine's loop (TokenizerManager.get_internal_state) every eighth of the
    deadline; answered (here within 0.2 s), a generation longer than the deadline is no loss; never
    answered, the wait raises the health's failure past the deadline and cancels the generation."""
    import asyncio

    from grpo_megatron.rollout.engine import EngineLost
    from grpo_megatron.rollout.sglang.watch import SchedulerProbe, ServerGuard, cancel_requests, close_loop

    class Manager:
        asked = 0

        async def get_internal_state(self) -> list[dict[str, int]]:
            Manager.asked += 1
            await asyncio.sleep(3600 if answer_s is None else answer_s)
            return [{}]

    def lost(why: str) -> EngineLost:
        return EngineLost(0, "host", why, "  tail", "log", what="SGLang engine")

    server = SimpleNamespace(loop=asyncio.new_event_loop(), tokenizer_manager=Manager())
    guard = ServerGuard(
        [server], watch=lambda: None, cancel=cancel_requests, probe=lambda: SchedulerProbe(1.0, lost)
    )
    try:
        future = guard.start(lambda servers: servers[0].loop.run_until_complete(asyncio.sleep(2.5)) or "done")
        start = time.monotonic()
        if answer_s is not None:
            assert guard.result(future) == "done" and Manager.asked >= 3
        else:
            with pytest.raises(
                EngineLost,
                match=r"left a state request unanswered for 1.\d s, past "
                r"rollout.recovery.health_timeout_s=1 \(hung\)",
            ):
                guard.result(future)
            assert 1.0 <= time.monotonic() - start < 2.5 and future.done() and Manager.asked == 1
    finally:
        guard.abandon()
        close_loop(server)  # a request left pending when the wait ended: cancelled with the loop


def test_abandon_stops_the_loop_under_a_generation_its_cancel_did_not_end_and_joins_the_thread(
    monkeypatch,
) -> None:
    """ServerGuard.abandon (a lost engine's restart): a generation thread still on the engine's event loop
    after its requests were cancelled has the loop stopped under it; the thread is joined and the loop
    can be closed (close_loop), nothing left behind."""
    import asyncio

    from grpo_megatron.rollout.sglang import watch
    from grpo_megatron.rollout.sglang.watch import ServerGuard, close_loop

    monkeypatch.setattr(watch, "ABORT_S", 0.5)
    server = SimpleNamespace(loop=asyncio.new_event_loop())
    guard = ServerGuard(
        [server], watch=lambda: None, cancel=lambda servers: None
    )  # a cancel that ends nothing
    future = guard.start(lambda servers: servers[0].loop.run_until_complete(asyncio.Event().wait()))
    while not server.loop.is_running():
        time.sleep(0.01)
    start = time.monotonic()
    assert guard.abandon() == [server]
    assert time.monotonic() - start < 3 and future.done() and isinstance(future.exception(), RuntimeError)
    assert not [t for t in threading.enumerate() if t.name.startswith("sglang-generate")]
    close_loop(server)
    assert server.loop.is_closed()


_START_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from grpo_megatron.rollout.sglang.health import EngineProcesses, EngineStartError, sigquit_while_starting
health = EngineProcesses(0, Path(sys.argv[1]))
signal.signal(signal.SIGQUIT, sigquit_while_starting)  # what SGLang installs from custom_sigquit_handler
try:
    with health.start():
        print("scheduler: Traceback ... AssertionError: save kv cache", flush=True)  # into the log
        if sys.argv[2] == "sigquit":
            os.kill(os.getpid(), signal.SIGQUIT)
            time.sleep(5)
        raise RuntimeError("Rank 0 scheduler died during initialization (exit code: 1)")
except EngineStartError as exc:
    print(f"raised: {exc}", file=sys.stderr)
    os.kill(os.getpid(), signal.SIGQUIT)  # a late SIGQUIT, after the start: nothing more happens
    time.sleep(0.2)
    sys.exit(3)
"""


@pytest.mark.launches
@pytest.mark.parametrize("first", ["sigquit", "exception"])
def test_an_engine_that_fails_while_it_starts_is_named_on_the_console(tmp_path: Path, first: str) -> None:
    """While an engine starts, the rank's output goes to the engine's log; a failure then must still
    reach the console naming the engine, rank, host and log tail, whichever comes first: the
    scheduler's SIGQUIT (``sigquit_while_starting``: exit EXIT_ENGINE_DIED) or SGLang's exception
    (``EngineStartError``)."""
    import socket

    from grpo_megatron.rollout.sglang.health import EXIT_ENGINE_DIED

    log = tmp_path / "engine.log"
    proc = subprocess.run(
        [sys.executable, "-c", _START_SCRIPT, str(log), first],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert proc.returncode == (EXIT_ENGINE_DIED if first == "sigquit" else 3), proc.stderr
    assert f"SGLang engine of rank 0 on {socket.gethostname()} failed to start" in proc.stderr, proc.stderr
    assert str(log) in proc.stderr and "save kv cache" in proc.stderr, proc.stderr  # the log and its tail
    if first == "exception":
        assert "scheduler died during initialization" in proc.stderr


# ----------------------------------------------------------------------------------------------------
# Quantized checkpoints and DeepSeek-V3 configs written by transformers (issue 36 items 2 and 11)


def test_a_quantized_deepseek_engine_starts_unquantized_on_dummy_weights_from_a_config_sglang_reads(
    tmp_path: Path,
) -> None:
    from grpo_megatron.rollout.sglang.model_config import engine_config, engine_model_path
    from tests.helpers.fp8_deepseek import save_fp8_deepseek
    from tests.helpers.tiny_configs import tiny_hf_config

    path = save_fp8_deepseek(tmp_path / "fp8")
    hf = json.loads((path / "config.json").read_text())
    assert not {"moe_layer_freq", "topk_method", "scoring_func"} & set(hf)  # as transformers writes it
    config, changes = engine_config(hf)
    assert "quantization_config" not in config and len(changes) == 5
    assert (config["moe_layer_freq"], config["topk_method"], config["scoring_func"]) == (
        1,
        "noaux_tc",
        "sigmoid",
    )
    rope = config.get("rope_parameters") or config["rope_scaling"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 1.0  # the plain rotary embedding, as a scaling
    args = colocated_server_args(RolloutConfig(engine="sglang"), str(path), EngineLaunch(device="cpu"), hf)
    assert args["load_format"] == "dummy"  # the float8 files are never read; the first sync fills the weights
    folder, _ = engine_model_path(str(path), hf, tmp_path / "logs", 3)
    assert Path(folder).parent == tmp_path / "logs" and Path(folder).name.startswith("engine-model-rank3-")
    assert json.loads((Path(folder) / "config.json").read_text()) == config
    assert (Path(folder) / "tokenizer.json").resolve() == (path / "tokenizer.json").resolve()
    for plain in (tiny_hf_config("qwen3_moe"), {**config}):  # nothing to change: the checkpoint's folder
        assert engine_config(plain)[1] == []
        assert engine_model_path("/m", plain, None, 0)[0] == "/m"


def test_the_manifest_check_refuses_a_wrong_dtype_or_shape_naming_the_tensor_before_any_byte_moves(
    tmp_path: Path,
) -> None:
    """The engine's view (checkpoint shapes without the quantization's scales, the engine's dtype)
    against the sync's manifest, on the leader (``SGLangEngine.check_manifest``) as on a member."""
    from grpo_megatron.rollout.sglang.member import SGLangSyncMember
    from grpo_megatron.rollout.sglang.weights import engine_tensors, manifest_errors
    from tests.helpers.fp8_deepseek import save_fp8_deepseek

    path = save_fp8_deepseek(tmp_path)
    hf = json.loads((path / "config.json").read_text())
    held = engine_tensors(checkpoint_shapes(path), hf, torch.bfloat16, dummy=True)
    assert "model.layers.0.self_attn.q_b_proj.weight_scale_inv" in checkpoint_shapes(path)
    assert not any(n.endswith("_scale_inv") for n in held.shapes)
    good = [(n, s, torch.bfloat16) for n, s in sorted(held.shapes.items())]
    assert manifest_errors(good, held, None, "ckpt") == []
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"  # SGLang holds it in float32: any float loads exactly
    assert (
        manifest_errors([(n, s, torch.float32 if n == bias else d) for n, s, d in good], held, None, "ckpt")
        == []
    )
    q, o = "model.layers.0.self_attn.q_b_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    bad = [(n, (3, 3) if n == o else s, torch.float8_e4m3fn if n == q else d) for n, s, d in good]
    assert manifest_errors(bad, held, None, "ckpt") == [
        f"{q}: dtype torch.float8_e4m3fn, the engine holds it as torch.bfloat16 (the sync would cast it)",
        f"{o}: shape (3, 3), ckpt has {held.shapes[o]}",
    ]
    short = [m for m in good if m[0] != q]
    assert manifest_errors(short, held, None, "ckpt") == [
        f"1 tensors of ckpt are never sent and the engine started on dummy weights, e.g. {[q]}"
    ]
    assert manifest_errors(short, held, lambda n: n != q, "ckpt") == []  # another GPU's share
    engine = SGLangEngine(RolloutConfig(engine="sglang"), str(path), EngineLaunch(device="cpu"), servers=[])
    assert engine.check_manifest(good, 1) == []
    (refusal,) = engine.check_manifest(bad, 2)
    assert refusal.startswith("weight sync of version 2 refused by the SGLang engine (2 problems)")
    assert q in refusal and o in refusal and engine.weight_version == -1
    member = SGLangSyncMember(RolloutConfig(engine="sglang"), str(path), (0, 1), 1, "cpu")
    assert member.check_manifest(good, 1) == []
    (refusal,) = member.check_manifest(bad, 2)
    assert (
        refusal.startswith("weight sync of version 2 refused by SGLang TP rank 1 (2 problems)")
        and q in refusal
    )
    servers = SGLangConfig(mode="disaggregated", server_urls=["http://h:1"])
    disaggregated = RolloutConfig(engine="sglang", sglang=servers)
    engine = SGLangEngine(disaggregated, str(path), EngineLaunch(device="cpu"), servers=[])
    (refusal,) = engine.check_manifest(good, 1)
    assert "quantized" in refusal and "--load-format dummy" in refusal


def test_disaggregated_servers_are_told_the_version_with_the_streams_empty_last_bucket(fake_server) -> None:
    """The fleet's stream sends every data bucket with last=False and closes with an empty last one:
    that is where the servers learn the version (``/update_weight_version``), not on a data bucket."""
    from grpo_megatron.rollout.sglang.nccl import NcclBroadcastTransport

    url, handler = fake_server
    transport = NcclBroadcastTransport(RolloutConfig(engine="sglang"), object, "cpu", None)
    transport.send([SGLangHttpClient(url, timeout_s=10)], [], last=True, version=3)
    posted = [(path, body) for method, path, body in handler.requests if method == "POST"]
    version = {"new_version": "3", "abort_all_requests": False}
    assert posted == [("/flush_cache", {}), ("/update_weight_version", version)]


def test_deepseeks_fused_a_projections_reach_sglang_in_one_load_call_whatever_the_buckets() -> None:
    """SGLang's DeepSeek loader fuses q_a_proj and kv_a_proj_with_mqa only when both come in one call:
    the one of a pair that a bucket boundary separates is held and sent with its partner."""
    from grpo_megatron.rollout.sglang.weights import PairedLoads

    q, kv = "model.layers.3.self_attn.q_a_proj.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"
    pairs, buffer = PairedLoads(), torch.ones(2, 2)
    first = pairs.arrange([("a", torch.zeros(1)), (q, buffer)], version=1, last=False)
    buffer.zero_()  # the sender reuses its buffer after the call: what was held is a copy
    assert [n for n, _ in first] == ["a"]
    second = pairs.arrange([(kv, torch.zeros(3, 2)), ("b", torch.zeros(1))], version=1, last=False)
    assert [n for n, _ in second] == [q, kv, "b"] and bool(second[0][1].eq(1).all())
    assert [n for n, _ in pairs.arrange([(q, buffer), (kv, buffer)], version=2, last=False)] == [q, kv]
    pairs.arrange([(q, buffer)], version=3, last=False)
    with pytest.raises(
        ValueError, match=r"ended without the partners of \['model\.layers\.3\.self_attn\.q_a_proj"
    ):
        pairs.arrange([], version=3, last=True)
    pairs.arrange([(q, buffer)], version=4, last=False)  # abandoned: the next version starts clean
    assert pairs.arrange([], version=5, last=True) == []


def test_kept_prefixes_flush_where_the_oldest_cached_kv_would_lag_more_than_max_staleness(
    fake_server,
) -> None:
    """rollout.partial.keep_kv: a load keeps the prefix cache while every KV in it lags the new version
    by at most train.max_staleness (the first load always flushes: the cache's versions are unknown);
    off, every load flushes. The disaggregated stream's closing bucket then skips ``/flush_cache``."""
    from grpo_megatron.rollout.sglang.nccl import NcclBroadcastTransport
    from grpo_megatron.rollout.sglang.weights import KeptPrefixes

    kept, off = KeptPrefixes(True, 2), KeptPrefixes(False, 2)
    flushes = []
    for version in range(1, 8):
        flushes.append(kept.due(version))
        if flushes[-1]:
            kept.flushed(version)
    assert flushes == [True, False, False, True, False, False, True]
    assert all(off.due(v) for v in range(1, 8)) and not off.older_than(5)
    assert kept.older_than(8) and not kept.older_than(7)
    url, handler = fake_server
    transport = NcclBroadcastTransport(RolloutConfig(engine="sglang"), object, "cpu", None)
    transport.send([SGLangHttpClient(url, timeout_s=10)], [], last=True, version=3, flush=False)
    posted = [path for method, path, _ in handler.requests if method == "POST"]
    assert posted == ["/update_weight_version"]


SCHEDULER_TRACEBACK = """[2026-12-05 10:01:02] Scheduler hit an exception: Traceback (most recent call last):
  File "/x/sglang/srt/layers/layernorm.py", line 1094, in forward_cpu
    return torch.ops.sgl_kernel.rmsnorm_cpu(x, self.weight.data, self.variance_epsilon)
NotImplementedError: "rmsnorm_kernel" not implemented for 'Float'

[2026-12-05 10:01:02] Received sigquit from a child process. It usually means the child failed.
"""


@pytest.mark.launches
def test_an_engine_death_names_its_reason_even_before_any_process_exited(tmp_path) -> None:
    """Issue 50 item 3: a scheduler that fails sends SGLang's SIGQUIT before it exits, so the report
    made in the SIGQUIT handler found no dead process and read "died: ." with an empty reason. The
    reason now says so and quotes the exception's last line from the engine's log; once a process
    has exited, how it ended comes first."""
    from grpo_megatron.rollout.engine import last_error_line
    from grpo_megatron.rollout.sglang.health import EngineProcesses

    log = tmp_path / "engine-rank0.log"
    log.write_text(SCHEDULER_TRACEBACK)
    health = EngineProcesses(0, log)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        health.procs = [psutil.Process(child.pid)]
        alive = health.report()
        child.kill()
        child.wait()
        gone = health.report()
    finally:
        child.kill()
    error = "NotImplementedError: \"rmsnorm_kernel\" not implemented for 'Float'"
    assert last_error_line(log) == error
    assert (
        f"died: SGLang sent SIGQUIT (a process of the engine failed); its log's last error: {error}." in alive
    )
    assert (
        f"died: process of the engine (pid {child.pid}) " in gone
        and f"; its log's last error: {error}." in gone
    )
    assert "died: ." not in alive + gone
    log.write_text("[2026-12-05] starting\nall well\n")
    assert health.cause([]) == "SGLang sent SIGQUIT (a process of the engine failed)"


def test_the_engines_processes_start_without_expandable_segments(monkeypatch) -> None:
    """Issue 51 item 9: expandable segments in the trainer's PYTORCH_CUDA_ALLOC_CONF would reach the
    engine's processes, where SGLang's memory saver cannot release what such segments allocate; the
    engine's environment drops that option (the others pass on, the trainer keeps its own)."""
    import torch

    from grpo_megatron.rollout.sglang.launch import engine_allocator_settings, engine_environment

    assert engine_allocator_settings({}) == {}
    assert engine_allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}
    assert engine_allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == {
        "PYTORCH_CUDA_ALLOC_CONF": None
    }
    options = "max_split_size_mb:128, expandable_segments:True,garbage_collection_threshold:0.6"
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": options}
    assert engine_allocator_settings(both) == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,garbage_collection_threshold:0.6",
        "PYTORCH_ALLOC_CONF": None,
    }
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    env = engine_environment(torch.device("cuda", 0))
    assert (
        env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
        and env["TORCHELASTIC_USE_AGENT_STORE"] is None
    )
