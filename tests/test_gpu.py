"""GPU-only tests: a job on CUDA (nccl), the trainer offload from CUDA memory, and the bridge's
name mapping of TransformerEngine's layer spec. Skipped, with the reason, where there is no CUDA
device (or no TransformerEngine); bench/gpu_check.py runs them on the GPU machine.

Each case runs in a fresh process (tests/helpers/dist.py): other tests of this pytest process run
CPU jobs, whose megatron-core adjustments (megatron_compat, cause "cpu") must not reach a CUDA job.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.workers.bridge_workers import save_tiny_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_te = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None or not torch.cuda.is_available(),
    reason="needs TransformerEngine and a CUDA device",
)
GPU_JOB = ["parallel.backend=nccl"]
LOGIT_TOL = 1e-4  # fp32, as tests/test_bridge.py


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    return root, save_tiny_model("qwen3_moe", root)


def _roundtrip(moe_dir, overrides: list[str]) -> dict:
    hf_dir, refs = moe_dir
    (result,) = run_distributed(
        "tests.workers.bridge_workers:roundtrip",
        1,
        timeout_s=240,
        cases={"case": (str(hf_dir), overrides)},
        refs={"case": refs},
        bucket_bytes=1 << 16,
    )
    return result["case"]


@needs_cuda
def test_nccl_job_runs_on_cuda_with_only_the_capability_fixes(moe_dir) -> None:
    """parallel.backend=nccl: the model lives on cuda:0, HF weights load and export exactly, logits
    match transformers', and no CUDA-absent (cause "cpu") adjustment was applied."""
    from grpo_megatron.distributed.megatron_compat import FIXES

    r = _roundtrip(moe_dir, GPU_JOB)
    assert r["device"] == "cuda:0"
    cpu_fixes = {fix.name for fix in FIXES if fix.cause == "cpu"}
    assert not cpu_fixes & set(r["applied_fixes"]), r["applied_fixes"]
    if importlib.util.find_spec("transformer_engine") is None:  # the H200 of GUIDE section 8
        assert "moe_router_gemm_name" in r["applied_fixes"]
    assert not (r["missing"] or r["extra"] or r["shape_diff"] or r["not_exact"]), r
    assert r["logprob_diff"] <= LOGIT_TOL and r["logit_diff"] <= LOGIT_TOL, r


@needs_cuda
def test_offload_from_cuda_frees_device_memory_and_restores_exactly(moe_dir) -> None:
    hf_dir, _ = moe_dir
    cases = {"gpu_two_phase": (str(hf_dir), GPU_JOB, False, True)}
    (per_case,) = run_distributed("tests.workers.offload_workers:roundtrips", 1, timeout_s=240, cases=cases)
    res = per_case["gpu_two_phase"]
    assert res["memory_left"] is not None  # measured on the device
    assert res["still_allocated"] == [] and res["not_identical"] == [], res
    assert res["grads_identical"] and res["bytes_moved"] == res["bytes_freed"] > 0
    assert res["params_kept_in_phase1"] and res["logprob_change_after"] > 1e-3


@needs_te
def test_transformer_engine_spec_maps_names_exactly(moe_dir) -> None:
    """The bridge's names for TE's fused modules (layernorm inside linear_qkv / linear_fc1)."""
    r = _roundtrip(moe_dir, [*GPU_JOB, "model.transformer_impl=transformer_engine"])
    assert r["use_te"] and r["device"] == "cuda:0"
    assert "moe_router_gemm_name" not in r["applied_fixes"]
    assert not (r["missing"] or r["extra"] or r["shape_diff"] or r["not_exact"]), r
    assert r["logprob_diff"] <= LOGIT_TOL, r


@needs_cuda
def test_the_start_up_offload_leaves_no_pinned_host_memory_behind() -> None:
    """Issue 51 item 9: the start-up phase moves the trainer's state into pinned host buffers; once it is
    back and no later phase offloads (train.offload_trainer=false), no pinned memory stays cached."""
    from grpo_megatron.rollout.config import RolloutConfig
    from grpo_megatron.rollout.placement import decide_placement
    from grpo_megatron.training.offload import ColocatedMemory
    from grpo_megatron.training.policy import Policy

    model = torch.nn.Linear(1024, 1024, device="cuda")
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1024, device="cuda")).sum().backward()
    optimizer.step()
    placement = decide_placement(
        RolloutConfig(engine="sglang"),
        offload_trainer=False,
        max_staleness=0,
        world_size=1,
        gpus_per_node=1,
        tp=1,
        pp=1,
        cp=1,
        hf={},
    )

    class Engines:
        def release_memory(self, tags: object) -> None: ...

        def resume_memory(self, tags: object) -> None: ...

    pinned: list[int] = []
    policy = Policy(model=model, optimizer=optimizer, spec=None)  # type: ignore[arg-type]
    memory = ColocatedMemory(policy, None, placement.phases())
    memory.start_engines(
        lambda: pinned.append(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)) or Engines()
    )
    assert pinned[0] >= 3 * 1024 * 1024 * 4  # weights, gradients, two Adam moments were pinned meanwhile
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == 0
