"""The weight-sync estimate of ``grpo-megatron plan`` (planner/sync.py) for the two large recipes,
with the default H100 link speeds (docs/planner.md): the figures the docs quote."""

from __future__ import annotations

from pathlib import Path

from grpo_megatron.config import load_config
from grpo_megatron.planner.memory import Layout
from grpo_megatron.planner.sync import Links, SyncEstimate, plan_sync

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"


def _estimate(recipe: str, nodes: int, gpus_per_engine: int, engine_ep: int | None = None) -> SyncEstimate:
    cfg = load_config(RECIPES / f"{recipe}.yaml", [])
    world = nodes * 8
    layout = Layout.from_config(cfg.parallel, world)
    hf = cfg.model.load_hf_config()
    (out,) = plan_sync(
        hf,
        layout,
        gpus_per_node=8,
        gpus_per_engine=gpus_per_engine,
        export_bytes=2,
        links=Links(),
        engine_ep=engine_ep,
    )
    return out


def test_sync_estimates_of_the_large_recipes() -> None:
    qwen = _estimate("qwen3_30b_a3b", nodes=1, gpus_per_engine=8)
    assert 55e9 < qwen.model_bytes < 65e9 and qwen.seconds <= 1.0
    # Each engine GPU: the dense weights + an eighth of the experts (engine EP = its 8 GPUs).
    assert qwen.model_bytes / 8 < qwen.engine_gpu.received < qwen.model_bytes / 4
    ds = _estimate("deepseek_v3_671b", nodes=128, gpus_per_engine=32)
    assert ds.seconds <= 2.4 and ds.model_bytes / 32 < ds.engine_gpu.received < ds.model_bytes / 16
    # Without expert parallelism in the engine every GPU needs the whole 1.3 TB: far over the target.
    whole = _estimate("deepseek_v3_671b", nodes=128, gpus_per_engine=32, engine_ep=1)
    assert whole.engine_gpu.received == whole.model_bytes and whole.seconds > 10
