"""Memory planner and dry run: parameter counts against real megatron models, shard shapes and rank
mappings at several layouts (fake process group, meta device), the published model-state figure, and
the DeepSeek-V3 recipe dry-run at 256 and 1024 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_megatron.config import load_config, validate
from grpo_megatron.models.builder import build_gpt_model, padded_vocab_size
from grpo_megatron.planner import memory, model_states
from grpo_megatron.planner.dry_run import dry_run, fake_world, parallel_state_here, shape_errors
from tests.helpers.dist import REPO_ROOT
from tests.helpers.tiny_configs import TINY_CONFIGS, tiny_hf_config

RECIPES = REPO_ROOT / "examples" / "recipes"


def tiny_job(tmp_path: Path, model_type: str, overrides: list[str] = ()):  # type: ignore[assignment]
    """A job config for a tiny model of `model_type` (config.json written to tmp_path)."""
    model_dir = tmp_path / model_type
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(tiny_hf_config(model_type)))
    yaml = tmp_path / f"{model_type}.yaml"
    yaml.write_text(
        f"model:\n  hf_path: {model_type}\n  dtype: float32\n  make_vocab_size_divisible_by: 8\n"
        "  transformer_impl: local\ntrain:\n  prompts_per_iteration: 8\n"
    )
    return load_config(yaml, list(overrides))


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_param_count_equals_real_model(tmp_path: Path, model_type: str) -> None:
    """World size 1: a real CPU model from build_gpt_model has exactly the planner's tensors."""
    cfg = tiny_job(tmp_path, model_type)
    hf = cfg.model.load_hf_config()
    layout = model_states.Layout.from_config(cfg.parallel, 1)
    vp = padded_vocab_size(hf["vocab_size"], 8, 1)
    tensors = model_states.canonical_tensors(hf, padded_vocab=vp, te=False)
    dims = model_states.ModelDims.from_hf(hf)
    with fake_world(0, 1, layout):
        ps = parallel_state_here(0, layout, torch.device("cpu"))
        from grpo_megatron.distributed.megatron_compat import apply_megatron_compat, cpu_model_parallel_seed

        apply_megatron_compat("cpu")
        cpu_model_parallel_seed(0)
        model, _ = build_gpt_model(hf, cfg.model, ps)
        real = sum(p.numel() for p in model.parameters())
        assert next(model.parameters()).device.type == "cpu"
        assert shape_errors(model, ps, layout, model_states.rank_tensors(tensors, layout, dims, 0, 0)) == []
    assert model_states.rank_param_counts(tensors, layout, dims, 0).total == real
    assert model_states.total_params(hf, padded_vocab=vp) == real


LAYOUTS = {  # world size, overrides
    "tp2": (2, ["parallel.tp=2"]),
    "ep2": (2, ["parallel.ep=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2_ep2": (4, ["parallel.tp=2", "parallel.ep=2"]),
    "tp2_etp1_ep2_pp2": (8, ["parallel.tp=2", "parallel.etp=1", "parallel.ep=2", "parallel.pp=2"]),
}


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_dry_run_layouts_per_rank(tmp_path: Path, model_type: str) -> None:
    """Every layout, every rank initialised and built (meta): megatron's own parallel state and
    shard shapes equal the planner's per-rank table, and per-rank bytes are consistent."""
    for name, (world, overrides) in LAYOUTS.items():
        if TINY_CONFIGS[model_type].get("num_key_value_heads", 4) < 2 and "tp2" in name:
            continue
        dense = not any(k in TINY_CONFIGS[model_type] for k in ("num_experts", "n_routed_experts", "num_local_experts"))
        if dense and "ep2" in name:
            continue
        cfg = tiny_job(tmp_path, model_type, overrides)
        validate(cfg, world)
        hf = cfg.model.load_hf_config()
        report = dry_run(cfg, hf, world, every_rank=True)
        assert report.ok, (name, report.errors)
        assert len(report.param_bytes_by_rank) == world
        assert sum(len(c.built_ranks) for c in report.classes) == world
        vp = padded_vocab_size(hf["vocab_size"], 8, cfg.parallel.tp)
        per_stage_total = sum(c.params for c in report.classes)
        layout = report.layout
        # One copy of each stage split over TP (dense) and EP x ETP (experts) adds up to the model.
        dims = model_states.ModelDims.from_hf(hf)
        tensors = model_states.canonical_tensors(hf, padded_vocab=vp, pp=layout.pp, te=False)
        whole = sum(
            t.numel // ((layout.etp * layout.ep) if t.is_expert else (layout.tp if t.partition_dim is not None else 1))
            for t in tensors
        )
        assert per_stage_total == whole, name
        assert dims.num_layers % layout.pp == 0


def test_shape_check_catches_a_wrong_table(tmp_path: Path) -> None:
    cfg = tiny_job(tmp_path, "qwen3_moe", ["parallel.tp=2"])
    hf = cfg.model.load_hf_config()
    layout = model_states.Layout.from_config(cfg.parallel, 2)
    vp = padded_vocab_size(hf["vocab_size"], 8, 2)
    tensors = model_states.canonical_tensors(hf, padded_vocab=vp, te=False)
    dims = model_states.ModelDims.from_hf(hf)
    from grpo_megatron.planner.dry_run import build_meta_model

    with fake_world(1, 2, layout):
        ps = parallel_state_here(1, layout, torch.device("meta"))
        model = build_meta_model(hf, cfg, ps, 0)
        expected = model_states.rank_tensors(tensors, layout, dims, 0, ps.ep_rank)
        assert shape_errors(model, ps, layout, expected) == []
        spec, shape = expected[3]
        broken = [*expected[:3], (spec, (shape[0] + 1, *shape[1:])), *expected[4:-1]]
        errors = shape_errors(model, ps, layout, broken)
    assert any(spec.name in e and "shard" in e for e in errors)
    assert any("not in the planner's table" in e for e in errors)


def test_model_states_match_zero_paper() -> None:
    """ZeRO (Rajbhandari et al. 2020, Figure 1): a 7.5B-parameter model with mixed-precision Adam
    takes 120 GB per GPU of model states (16 bytes/parameter), 31.4 GB with the optimizer state
    sharded over 64 data-parallel GPUs (P_os). Qwen2.5-Math-7B (7.6B) with ZeRO's fp16 gradients
    (grad_bytes=2) must come within 10% of both."""
    path = RECIPES / "r1_zero_qwen25_math_7b.yaml"
    hf = json.loads((RECIPES / "r1_zero_qwen25_math_7b" / "config.json").read_text())
    for distributed, published_gb in ((False, 120.0), (True, 31.4)):
        cfg = load_config(path, ["parallel.tp=1", f"parallel.use_distributed_optimizer={str(distributed).lower()}",
                                 "rollout.engine=embedded"])
        validate(cfg, 64)
        plan = memory.plan_memory(cfg, hf, 64, memory.PlanOptions(grad_bytes=2))
        states = sum(x.gib for x in plan.train if x.name in ("parameters", "gradients", "optimizer state"))
        ours_gb = states * memory.GIB / 1e9
        assert abs(ours_gb - published_gb) / published_gb < 0.10, (distributed, ours_gb)
        # and megatron-core's documented bf16/fp32-grad accounting: 18 or 6 + 12/d bytes/param
        ours = memory.plan_memory(cfg, hf, 64, memory.PlanOptions())
        per_param = sum(x.gib for x in ours.train if x.name in ("parameters", "gradients", "optimizer state"))
        per_param *= memory.GIB / ours.params_rank.total
        assert per_param == pytest.approx(6 + 12 / 64 if distributed else 18)


def test_recompute_and_suggestions(tmp_path: Path) -> None:
    path = RECIPES / "deepseek_v3_671b.yaml"
    hf = json.loads((RECIPES / "deepseek_v3_671b" / "config.json").read_text())
    opts = memory.PlanOptions()  # the recipe says sglang_tp 32, sglang_ep 32, offload_trainer
    acts = {}
    for mode in ("none", "selective", "full"):
        cfg = load_config(path, [f"model.recompute={mode}"])
        acts[mode] = next(x.gib for x in memory.plan_memory(cfg, hf, 1024, opts).train if x.name == "activations")
    assert acts["full"] < acts["selective"] <= acts["none"]
    cfg = load_config(path)
    plan = memory.plan_memory(cfg, hf, 256, opts)  # a quarter of the GPUs: does not fit
    assert not plan.fits
    suggestions = memory.suggest(cfg, hf, 256, opts, plan)
    assert any(s.endswith("(fits)") for s in suggestions), suggestions


@pytest.mark.parametrize("world", [256, 1024])
def test_deepseek_v3_dry_run_at_scale(world: int) -> None:
    """The DeepSeek-V3 recipe at 256 and 1024 ranks: real megatron groups, meta-device models."""
    cfg = load_config(RECIPES / "deepseek_v3_671b.yaml")
    validate(cfg, world)
    hf = cfg.model.load_hf_config()
    report = dry_run(cfg, hf, world)
    assert report.ok, report.errors[:5]
    assert len(report.param_bytes_by_rank) == world
    assert min(report.param_bytes_by_rank) > 0
    assert any("256 experts exactly once" in c for c in report.checks)


def test_async_layout_step_time_is_the_slower_side_plus_the_sync():
    from grpo_megatron.planner import async_layout

    times = async_layout.PhaseTimes.parse("rollout=2,reward=0.5,train=1.5,sync=0.25")
    same = async_layout.estimate(times, trainer_gpus=8, engine_gpus=8)
    assert same.step_sync_s == 4.25 and same.step_async_s == 2.25  # rollout 2 s = trainer 2 s
    fewer = async_layout.estimate(times, trainer_gpus=8, engine_gpus=4)  # rollout takes 2 * 8 / 4 = 4 s
    assert fewer.step_async_s == 4.25 and fewer.bound == "rollout"
    more = async_layout.estimate(times, trainer_gpus=8, engine_gpus=16)  # rollout 1 s < trainer 2 s
    assert more.step_async_s == 2.25 and more.bound == "trainer"
    with pytest.raises(ValueError, match="phase-times"):
        async_layout.PhaseTimes.parse("decode=1")
