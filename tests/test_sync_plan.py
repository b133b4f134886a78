"""The weight-sync estimate of ``grpo-megatron plan`` (planner/sync.py) for the two large recipes,
with the default H100 link speeds (docs/planner.md): the figures the docs quote."""

from __future__ import annotations

from pathlib import Path

from grpo_megatron.config import load_config
from grpo_megatron.planner.memory import Layout
from grpo_megatron.planner.sync import Links, plan_sync

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"


def _estimates(recipe: str, nodes: int, gpus_per_engine: int) -> dict:
    cfg = load_config(RECIPES / f"{recipe}.yaml", [])
    world = nodes * 8
    layout = Layout.from_config(cfg.parallel, world)
    hf = cfg.model.load_hf_config()
    out = plan_sync(hf, layout, gpus_per_node=8, gpus_per_engine=gpus_per_engine, export_bytes=2, links=Links())
    return {e.delivery: e for e in out}


def test_sync_estimates_of_the_large_recipes() -> None:
    qwen = _estimates("qwen3_30b_a3b", nodes=1, gpus_per_engine=8)
    today = qwen["full tensors to each engine's first GPU"]
    assert 55e9 < today.model_bytes < 65e9 and today.seconds <= 1.0
    assert today.engine_gpu.received == today.model_bytes  # the first GPU gets every full tensor
    ds = _estimates("deepseek_v3_671b", nodes=128, gpus_per_engine=32)
    shard = ds["shard to shard"]
    assert shard.seconds <= 2.4 and shard.engine_gpu.received == shard.model_bytes / 32
    # Through one GPU per engine, 1.3 TB cannot move in seconds: the estimate says so.
    assert ds["full tensors to each engine's first GPU"].seconds > 20
