"""grpo_megatron.distributed.megatron_compat: each fix applied by its cause (not by the machine),
still needed by megatron-core, and real megatron-core MoE training on CPU at every parallel layout
(through tests/helpers/dist.py).

The unit tests apply the fixes in this process (as every CPU test of the package does); where a
test needs megatron's behaviour without a fix it puts the original back with monkeypatch, which
restores our fix afterwards.
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from grpo_megatron.distributed import megatron_compat as compat
from grpo_megatron.distributed.megatron_compat import Capabilities
from tests.helpers.dist import REPO_ROOT, run_distributed

# Tests that show megatron (or torch) failing where CUDA is absent need a torch without CUDA; on a
# GPU machine the CPU fixes still apply to CPU jobs (and the tests of them that need no failure run).
needs_cuda_absent = pytest.mark.skipif(
    torch.cuda.is_available(), reason="shows the failure of a torch without CUDA; this torch has CUDA"
)

_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher"
_WORKERS = "tests.workers.compat_workers"


@pytest.fixture(scope="module", autouse=True)
def _applied() -> None:
    compat.apply_megatron_compat("cpu")


def _put_back_original(monkeypatch: pytest.MonkeyPatch, target: str) -> object:
    """Reinstate megatron's (or torch's) object at ``target`` for this test; returns it."""
    owner, attr = compat._resolve(target)
    original = compat._original(target)
    monkeypatch.setattr(owner, attr, original)
    return original


# ----------------------------------------------------------------------------------------------
# The module's contract


def test_apply_returns_every_fix_and_is_idempotent() -> None:
    names = [fix.name for fix in compat.FIXES]
    assert len(set(names)) == len(names)
    # A CPU job without TransformerEngine, with torch's Adam (this project's CPU machines): every fix.
    applied = [fix.name for fix in compat.fixes_for(Capabilities.detect("cpu"))]
    if not compat._transformer_engine_installed() and compat._megatron_uses_torch_adam():
        assert Capabilities.detect("cpu").causes() == {"cpu", "no_te", "torch_adam"} and applied == names
    assert compat.apply_megatron_compat("cpu") == applied
    assert compat.apply_megatron_compat("cpu") == applied
    assert set(applied) <= set(compat.applied_fixes())
    # Applying twice must not wrap a wrapper: each replacement still holds megatron's own object.
    for fix in compat.FIXES:
        for target in fix.where.split(", "):
            if compat._is_ours(compat._get_raw(target)):
                assert not compat._is_ours(compat._original(target)), target


def test_every_fix_is_documented_under_its_cause() -> None:
    doc = compat.__doc__
    headings = {cause: doc.index(f"Cause ``{cause}``") for cause in ("no_te", "torch_adam", "cpu")}
    sections = sorted(headings.values()) + [len(doc)]
    for fix in compat.FIXES:
        assert fix.what_breaks and fix.where and fix.fix, fix.name
        row = doc.find(f"| {fix.name} ")
        assert row >= 0, f"{fix.name} missing from the module docstring's tables"
        start = headings[fix.cause]
        assert start < row < sections[sections.index(start) + 1], f"{fix.name} not under {fix.cause}"


def test_module_docstring_tables_are_rendered_from_the_fix_records() -> None:
    """Each fix is described once, in its record: the docstring's tables are ``fix_tables()``."""
    assert set(compat.CAUSES) == {"no_te", "torch_adam", "cpu"}
    assert compat.fix_tables() in compat.__doc__, (
        "the module docstring's tables differ from the FIXES records: paste the output of "
        "`python -m grpo_megatron.distributed.megatron_compat` into it"
    )


def test_causes_are_what_the_issue_saw_on_a_gpu() -> None:
    """A GPU job without TE and with torch's Adam (the H200 of GUIDE section 8) gets the router
    and distributed-optimizer fixes, and none of the CUDA-absent ones."""
    gpu_no_te = Capabilities(cpu=False, transformer_engine=False, fused_adam=False)
    names = {fix.name for fix in compat.fixes_for(gpu_no_te)}
    assert {
        "moe_router_gemm_name",
        "mla_te_flag",
        "distopt_fresh_state_dict",
        "distopt_unshared_step",
    } <= names
    assert not any(fix.cause == "cpu" for fix in compat.fixes_for(gpu_no_te))
    assert compat.fixes_for(Capabilities(cpu=False, transformer_engine=True, fused_adam=True)) == ()
    # What this process detects: the device is the job's, TE and Adam are the installation's.
    installed = (compat._transformer_engine_installed(), not compat._megatron_uses_torch_adam())
    for device, cpu in (("cuda:0", False), ("cuda", False), ("cpu", True)):
        assert Capabilities.detect(device) == Capabilities(cpu, *installed)


def _fresh_interpreter(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TORCH_COMPILE_DISABLE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.launches
def test_opt_in_and_applied_by_cause_not_by_device() -> None:
    """In fresh interpreters: importing patches nothing; "TE absent" alone (a CUDA job) applies the
    router fix and no CUDA-absent fix, and the router then runs (on CPU tensors, with torch's own
    CUDA functions untouched); the CPU path with TE reported present leaves the router alone."""
    if compat._transformer_engine_installed():
        pytest.skip("shows megatron's NameError without TransformerEngine; TE is installed here")
    _fresh_interpreter(
        """
        import torch
        from grpo_megatron.distributed import megatron_compat as compat
        from grpo_megatron.distributed.megatron_compat import Capabilities
        from megatron.core.transformer.moe import moe_utils
        real_current_device = torch.cuda.current_device
        assert compat.applied_fixes() == (), compat.applied_fixes()
        inp, weight = torch.randn(3, 8), torch.randn(4, 8)
        try:
            moe_utils.router_gating_linear(inp, weight, None, torch.float32)
            raise SystemExit("megatron no longer needs moe_router_gemm_name")
        except NameError:
            pass
        applied = compat.apply_megatron_compat(
            "cuda", capabilities=Capabilities(cpu=False, transformer_engine=False, fused_adam=True)
        )
        assert applied == [f.name for f in compat.FIXES if f.cause == "no_te"], applied
        assert "moe_router_gemm_name" in compat.applied_fixes()
        assert torch.cuda.current_device is real_current_device
        assert not any(f.is_applied() for f in compat.FIXES if f.cause != "no_te")
        torch.testing.assert_close(moe_utils.router_gating_linear(inp, weight, None, torch.float32), inp @ weight.T)
        """
    )
    _fresh_interpreter(
        """
        from grpo_megatron.distributed import megatron_compat as compat
        from grpo_megatron.distributed.megatron_compat import Capabilities
        applied = compat.apply_megatron_compat(
            "cpu", capabilities=Capabilities(cpu=True, transformer_engine=True, fused_adam=True)
        )
        assert applied == [f.name for f in compat.FIXES if f.cause == "cpu"], applied
        assert "moe_router_gemm_name" not in compat.applied_fixes()
        """
    )


@pytest.mark.launches
def test_torch_adam_fixes_are_applied_by_that_condition() -> None:
    """megatron's Adam here is torch's (no TE, no apex), on any device: a CUDA job gets the
    distributed-optimizer fixes; with a fused Adam reported, a CPU job gets none of them (the CPU
    one of the checkpoint path, the .cuda() gather, stays)."""
    from megatron.core import optimizer as megatron_optimizer

    if not compat._megatron_uses_torch_adam():
        pytest.skip("megatron's Adam is a fused one here (TE or apex)")
    assert megatron_optimizer.Adam is torch.optim.AdamW
    _fresh_interpreter(
        """
        import torch
        from grpo_megatron.distributed import megatron_compat as compat
        from grpo_megatron.distributed.megatron_compat import Capabilities
        applied = compat.apply_megatron_compat(
            "cuda", capabilities=Capabilities(cpu=False, transformer_engine=True, fused_adam=False)
        )
        assert applied == [f.name for f in compat.FIXES if f.cause == "torch_adam"], applied
        assert all(name.startswith("distopt_") for name in applied) and len(applied) == 4
        assert compat.applied_fixes() == tuple(applied)
        """
    )
    cpu_fused = Capabilities(cpu=True, transformer_engine=False, fused_adam=True)
    names = [fix.name for fix in compat.fixes_for(cpu_fused)]
    assert "distopt_dp_zero_on_cuda" in names
    assert not any(fix.cause == "torch_adam" for fix in compat.fixes_for(cpu_fused))


def test_unchecked_megatron_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "_installed_megatron_version", lambda: "0.15.0")
    with pytest.raises(
        RuntimeError, match=r"checked against megatron-core 0\.16\.1, but 0\.15\.0 is installed"
    ):
        compat.apply_megatron_compat("cpu")
    # A GPU job on a complete installation (TE, fused Adam) needs no fix, so any version runs.
    full = Capabilities(cpu=False, transformer_engine=True, fused_adam=True)
    assert compat.apply_megatron_compat("cuda", capabilities=full) == []


def test_checked_version_is_the_installed_one() -> None:
    assert compat._installed_megatron_version() in compat.CHECKED_MEGATRON_VERSIONS


def test_replaced_functions_are_not_still_held_elsewhere() -> None:
    """A megatron module that imported a function we replace by name keeps the original: every
    loaded megatron.core module must hold our replacement or nothing."""
    import megatron.core.models.gpt  # noqa: F401  (load what the package uses)
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401

    originals = {}
    for fix in compat.FIXES:
        for target in fix.where.split(", "):
            if not target.startswith("megatron") or "." in target.partition(":")[2]:
                continue
            original = compat._original(target)
            # Our RNG tracker subclasses megatron's: modules holding the base for isinstance
            # checks (transformer.cuda_graphs) still see our tracker as one.
            if isinstance(original, type) and issubclass(compat._get_raw(target), original):
                continue
            originals[id(original)] = target
    stale = [
        f"{module_name}.{attr} (replaced at {originals[id(value)]})"
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("megatron.core") and isinstance(module, types.ModuleType)
        for attr, value in list(vars(module).items())
        if id(value) in originals and callable(value)
    ]
    assert not stale, stale


def test_cuda_to_cpu_mode() -> None:
    with compat._CudaToCpuMode():
        made = torch.zeros(2, device="cuda")
        assert made.device.type == "cpu"
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
        assert made.cuda() is made
        assert made.type() == "torch.cuda.FloatTensor"
        assert made.to(torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert made.type() == "torch.FloatTensor"


# ----------------------------------------------------------------------------------------------
# One test per fix: megatron (or torch) still breaks without it, and works with it


@needs_cuda_absent
def test_cuda_current_device() -> None:
    import megatron.core.tensor_parallel.layers as layers

    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        compat._original("torch.cuda:current_device")()
    assert "torch.cuda.current_device()" in inspect.getsource(layers)
    assert torch.cuda.current_device() == torch.device("cpu")


@needs_cuda_absent
def test_cuda_synchronize() -> None:
    import megatron.core.pipeline_parallel.p2p_communication as p2p

    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        compat._original("torch.cuda:synchronize")()
    assert "torch.cuda.synchronize()" in inspect.getsource(p2p)
    assert torch.cuda.synchronize() is None


@needs_cuda_absent
def test_rng_tracker_cpu_states(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_tracker = compat._original("megatron.core.tensor_parallel.random:CudaRNGStatesTracker")
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        megatron_tracker().add("model-parallel-rng", 1)

    # Seeds as megatron's own model_parallel_cuda_manual_seed sets them (run with our tracker).
    ranks = {"tp_rank": 1, "ep_rank": 1, "etp_rank": 0}
    compat.cpu_model_parallel_seed(7, pp_rank=0, **ranks)
    ours = {k: v.clone() for k, v in megatron_random.get_cuda_rng_tracker().get_states().items()}
    megatron_random.model_parallel_cuda_manual_seed(7, force_reset_rng=True, **ranks)
    theirs = megatron_random.get_cuda_rng_tracker().get_states()
    assert sorted(ours) == sorted(theirs) and len(ours) == 3
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)

    # fork: draws continue the named stream and leave the default one untouched.
    compat.cpu_model_parallel_seed(7, pp_rank=1, **ranks)
    tracker = megatron_random.get_cuda_rng_tracker()
    default_before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(8)
    with tracker.fork():
        second = torch.rand(8)
        dropped = torch.nn.functional.dropout(torch.ones(64), p=0.5)
    assert torch.equal(torch.get_rng_state(), default_before)
    assert 0 < int((dropped == 0).sum()) < 64
    # The tensor-parallel stream of pipeline stage 1, TP rank 1, continued across forks.
    stream = torch.Generator().manual_seed(7 + 100 + 2718 + 1)
    assert torch.equal(first, torch.rand(8, generator=stream))
    assert torch.equal(second, torch.rand(8, generator=stream))

    monkeypatch.setattr(megatron_random, "CudaRNGStatesTracker", megatron_tracker)
    with pytest.raises(RuntimeError, match="apply_megatron_compat"):
        compat.cpu_model_parallel_seed(7, pp_rank=0, **ranks)


@needs_cuda_absent
def test_recompute_cpu_rng() -> None:
    """Megatron's own checkpoint (activation recomputation) runs forward and backward on CPU, and the
    recomputed forward replays the same dropout mask (the CPU generator state is restored)."""
    from megatron.core.tensor_parallel import random as megatron_random

    original = compat._original("megatron.core.tensor_parallel.random:_get_cuda_rng_state")
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        original()
    compat.cpu_model_parallel_seed(3, pp_rank=0, tp_rank=0, ep_rank=0, etp_rank=0)
    x = torch.ones(64, requires_grad=True)
    y = megatron_random.checkpoint(lambda t: torch.nn.functional.dropout(t, p=0.5) * 2, False, x)
    y.sum().backward()
    assert torch.equal(x.grad, (y.detach() != 0).float() * 4)  # the mask of the forward, recomputed


def test_moe_router_gemm_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.transformer.moe import moe_utils

    inp, weight = torch.randn(3, 8), torch.randn(4, 8)
    if moe_utils.HAVE_TE:
        pytest.skip("TransformerEngine binds te_general_gemm itself")
    monkeypatch.delattr(moe_utils, "te_general_gemm")
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    monkeypatch.undo()
    torch.testing.assert_close(
        moe_utils.router_gating_linear(inp, weight, None, torch.float32), inp @ weight.T
    )


@pytest.mark.launches
def test_mla_te_flag() -> None:
    """Without TransformerEngine megatron still believes MLA has TE; the fix clears the flag
    (tests/test_models.py builds and trains DeepSeek-V3's MLA with it)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine installed: the flag is right")
    code = (
        "import megatron.core.transformer.multi_latent_attention as mla; before = mla.HAVE_TE\n"
        "from grpo_megatron.distributed.megatron_compat import apply_megatron_compat; apply_megatron_compat('cpu')\n"
        "print(before, mla.HAVE_TE)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


def _bare_alltoall_dispatcher(cls: type) -> object:
    """The attributes _maybe_dtoh_and_synchronize reads, as __init__ sets them for a CPU run."""
    dispatcher = object.__new__(cls)
    dispatcher.drop_and_pad = False
    dispatcher.cuda_dtoh_point = "before_permutation_1"
    dispatcher.cuda_sync_point = "before_permutation_1"
    dispatcher.num_local_experts = 2
    dispatcher.config = types.SimpleNamespace(moe_permute_fusion=False)
    dispatcher.input_splits = torch.tensor([3, 5])
    dispatcher.output_splits = torch.tensor([4, 4])
    dispatcher.output_splits_tp = None
    dispatcher.num_out_tokens = torch.tensor(8)
    dispatcher.num_global_tokens_per_local_expert = torch.ones(2, 2)
    return dispatcher


@needs_cuda_absent
def test_moe_alltoall_dtoh(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    assert compat._original(f"{_DISPATCHER}.cuda_dtoh_stream") is None
    assert "torch.cuda.Stream()" in inspect.getsource(MoEAlltoAllTokenDispatcher.__init__)
    tokens_per_expert = torch.tensor([4, 4])

    _put_back_original(monkeypatch, f"{_DISPATCHER}._maybe_dtoh_and_synchronize")
    dispatcher = _bare_alltoall_dispatcher(MoEAlltoAllTokenDispatcher)
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        dispatcher._maybe_dtoh_and_synchronize("before_permutation_1", tokens_per_expert)
    monkeypatch.undo()

    dispatcher = _bare_alltoall_dispatcher(MoEAlltoAllTokenDispatcher)
    assert (
        dispatcher._maybe_dtoh_and_synchronize("before_permutation_1", tokens_per_expert) is tokens_per_expert
    )
    assert dispatcher.input_splits.tolist() == [3, 5] and not torch.is_tensor(dispatcher.input_splits)
    assert not torch.is_tensor(dispatcher.output_splits) and dispatcher.output_splits_tp is None


def test_torch_norm_sequence_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def config(sequence_parallel: bool) -> TransformerConfig:
        return TransformerConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            tensor_model_parallel_size=2,
            sequence_parallel=sequence_parallel,
            normalization="RMSNorm",
        )

    _put_back_original(monkeypatch, "megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__")
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(config=config(True), hidden_size=8)
    monkeypatch.undo()

    sp_norm = WrappedTorchNorm(config=config(True), hidden_size=8)
    assert isinstance(sp_norm, torch.nn.RMSNorm)
    assert all(getattr(p, "sequence_parallel", False) for p in sp_norm.parameters())
    plain = WrappedTorchNorm(config=config(False), hidden_size=8)
    assert not any(hasattr(p, "sequence_parallel") for p in plain.parameters())


@needs_cuda_absent
def test_causal_mask_on_cuda() -> None:
    from megatron.core.fusions import fused_softmax

    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        compat._original("megatron.core.fusions.fused_softmax:get_default_causal_mask")(4)
    expected = torch.ones(4, 4).triu(1).bool()
    assert torch.equal(fused_softmax.get_default_causal_mask(4), expected)
    assert fused_softmax.get_sliding_window_causal_mask(4, 4, (2, 0)).device.type == "cpu"


def test_tied_embeddings_and_schedules_still_use_cuda() -> None:
    """Behaviour is covered by the PP2 (tied embeddings) layout below; here: megatron's code still
    does what the fixes work around."""
    source = inspect.getsource(
        compat._original(
            "megatron.core.models.common.language_module.language_module:"
            "LanguageModule.setup_embeddings_and_output_layer"
        )
    )
    assert ".cuda()" in source
    for fn in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        source = inspect.getsource(compat._original(f"megatron.core.pipeline_parallel.schedules:{fn}"))
        assert 'device="cuda"' in source, fn


@needs_cuda_absent
def test_optimizer_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer

    param = torch.nn.Parameter(torch.zeros(3))
    _put_back_original(monkeypatch, "megatron.core.optimizer.optimizer:FP32Optimizer.__init__")
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        FP32Optimizer(torch.optim.Adam([param]), OptimizerConfig(lr=1e-3), None)
    monkeypatch.undo()
    assert (
        FP32Optimizer(torch.optim.Adam([param]), OptimizerConfig(lr=1e-3), None).get_loss_scale().device.type
        == "cpu"
    )

    build_groups = (
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups"
    )
    assert "'torch.cuda.FloatTensor'" in inspect.getsource(compat._original(build_groups).__func__)
    assert "'torch.cuda.FloatTensor'" in inspect.getsource(
        compat._original("megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32")
    )
    assert "device='cuda'" in inspect.getsource(
        compat._original("megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.__init__")
    )


# ----------------------------------------------------------------------------------------------
# The harness


@pytest.mark.launches
def test_harness_passes_kwargs_and_returns_in_rank_order() -> None:
    results = run_distributed(f"{_WORKERS}:echo", 2, timeout_s=60, value={"x": torch.arange(3)})
    assert [r["rank"] for r in results] == [0, 1]
    assert all(torch.equal(r["value"]["x"], torch.arange(3)) for r in results)


@pytest.mark.launches
def test_harness_names_the_failing_rank() -> None:
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\][\s\S]*deliberate failure on rank 1"):
        run_distributed(f"{_WORKERS}:fail_on_rank", 2, timeout_s=60, rank_to_fail=1)


@pytest.mark.launches
def test_harness_fails_a_hang() -> None:
    with pytest.raises(AssertionError, match="timed out after 5 s"):
        run_distributed(f"{_WORKERS}:hang", 2, timeout_s=5)


# ----------------------------------------------------------------------------------------------
# Real megatron-core training at each layout (gloo, fp32, local MoE spec)

TWO_RANK_LAYOUTS = ["tp2_sp", "ep2_alltoall", "ep2_allgather", "pp2", "dp2_distopt", "tp2_etp2"]
FOUR_RANK_LAYOUTS = ["tp2_ep2", "tp2_etp1_ep2"]


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    return run_distributed(
        f"{_WORKERS}:train_layouts", 2, timeout_s=180, names=TWO_RANK_LAYOUTS, check_collectives=True
    )


@pytest.fixture(scope="module")
def four_rank_results() -> list[dict]:
    return run_distributed(f"{_WORKERS}:train_layouts", 4, timeout_s=240, names=FOUR_RANK_LAYOUTS)


def _check_layout(results: list[dict], name: str) -> None:
    from tests.workers.compat_workers import LAYOUTS

    layout = LAYOUTS[name]
    per_rank = [r[name] for r in results]
    expected = [f.name for f in compat.fixes_for(Capabilities.detect("cpu"))]
    assert all(r["applied"] == expected for r in results)
    last = [r for r in per_rank if r["last_stage"]]
    assert len(last) == len(results) // layout.pp
    # Every rank here sees the same batch and the same weights: one loss, one grad norm.
    assert all(math.isfinite(r["loss"]) for r in last)
    assert all(r["loss"] == last[0]["loss"] for r in last), [r["loss"] for r in last]
    assert all(r["grad_norm"] == per_rank[0]["grad_norm"] and math.isfinite(r["grad_norm"]) for r in per_rank)
    assert all(r["update_ok"] for r in per_rank)
    if layout.pp == 1:
        assert all(math.isfinite(r["direct_loss"]) for r in per_rank)
    # RNG streams: forks restore the default stream; the tensor-parallel stream differs across
    # TP ranks (ranks 0 and 1 are TP peers when tp=2, DP peers when dp=2).
    assert all(r["fork_restores_default"] for r in per_rank)
    same_tp_stream = torch.equal(per_rank[0]["rand_tp"], per_rank[1]["rand_tp"])
    assert same_tp_stream == (layout.tp == 1 and layout.pp == 1)
    assert torch.equal(per_rank[0]["rand_dp"], per_rank[1]["rand_dp"]) == (layout.pp == 1)


@pytest.mark.launches
@pytest.mark.parametrize("name", TWO_RANK_LAYOUTS)
def test_two_rank_layout_trains(two_rank_results: list[dict], name: str) -> None:
    _check_layout(two_rank_results, name)


@pytest.mark.launches
@pytest.mark.parametrize("name", FOUR_RANK_LAYOUTS)
def test_four_rank_layout_trains(four_rank_results: list[dict], name: str) -> None:
    _check_layout(four_rank_results, name)


@pytest.mark.launches
def test_gloo_uneven_all_gather(two_rank_results: list[dict]) -> None:
    """gloo still rejects megatron's uneven all-gather (else the fix is dead weight), still accepts
    its uneven reduce-scatter (else it needs a fix too), and ours gathers the right rows."""
    expected_gather = torch.cat([torch.full((r + 1, 3), float(r + 1)) for r in range(2)])
    for rank, result in enumerate(two_rank_results):
        collectives = result["collectives"]
        assert "invalid tensor size" in collectives["megatron_gather_error"]
        assert collectives["megatron_scatter_error"] == ""
        assert torch.equal(collectives["gather"], expected_gather)
        assert torch.equal(collectives["scatter"], torch.full((rank + 1, 3), 3.0))


# ----------------------------------------------------------------------------------------------
# Distributed-optimizer checkpoints: megatron still needs each fix (resume equality itself is
# tested in tests/test_checkpoint.py)


@pytest.fixture(scope="module")
def distopt_results() -> list[dict]:
    return run_distributed(f"{_WORKERS}:distopt_checkpoint_fixes", 2, timeout_s=180)


@pytest.mark.launches
def test_distopt_fresh_state_dict(distopt_results: list[dict]) -> None:
    for result in distopt_results:
        assert result["fresh_original"].startswith("AssertionError"), result["fresh_original"]
        assert result["fresh_steps"] and set(result["fresh_steps"]) == {0}


@pytest.mark.launches
def test_distopt_dp_zero_on_cuda(distopt_results: list[dict]) -> None:
    for result in distopt_results:
        assert "not compiled with CUDA" in result["dp_zero_original"], result["dp_zero_original"]
        assert result["dp_zero_fixed"] == ""


@pytest.mark.launches
def test_distopt_unshared_step(distopt_results: list[dict]) -> None:
    for result in distopt_results:
        assert result["states"] > 1
        assert result["step_objects_original"] == 1  # megatron: one tensor shared by every parameter
        assert result["step_objects_fixed"] == result["states"]
        assert result["step_values_fixed"] == [2.0]


@pytest.mark.launches
def test_distopt_keep_restored_step(distopt_results: list[dict]) -> None:
    for result in distopt_results:
        assert result["set_original"] == "KeyError: 'step'"
        assert result["set_fixed"] == ""
        assert result["step_after_set"] == 2.0  # a fresh optimizer's 0 does not overwrite it


@pytest.mark.launches
def test_distopt_dp_reshardable_no_grad(distopt_results: list[dict]) -> None:
    for result in distopt_results:
        assert "view of a leaf Variable" in result["dp_reshardable_original"], result[
            "dp_reshardable_original"
        ]
        assert result["dp_reshardable_fixed"] == ""


_FUSER_CHILD = """
import sys
import torch
from grpo_megatron.distributed.megatron_jit import skip_fuser_when_compile_disabled
armed = skip_fuser_when_compile_disabled()
import megatron.core.models.gpt
import megatron.core.jit as jit
from megatron.core.fusions.fused_bias_gelu import bias_gelu
print(armed, "torch._inductor.compile_fx" in sys.modules, jit.jit_fuser is torch.compile,
      hasattr(bias_gelu, "_torchdynamo_orig_callable"))
"""


@pytest.mark.launches
def test_megatrons_fusers_are_plain_functions_where_compile_is_disabled() -> None:
    """With TORCH_COMPILE_DISABLE=1 (launch/, the examples, the tests) the CLI's switch makes
    megatron-core's jit_fuser its own no-op decorator as megatron.core.jit loads: no torch._inductor
    import (about 3 s of each process's start) and the fused functions plain: what the disabled compile
    ran anyway (it runs them eagerly). Where compile is on, nothing changes."""
    runs = {}
    for flag in ("1", "0"):
        proc = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", _FUSER_CHILD],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "TORCH_COMPILE_DISABLE": flag, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[flag] = proc.stdout.split()
    assert runs["1"] == ["True", "False", "False", "False"], runs
    assert runs["0"] == ["False", "True", "True", "True"], runs
