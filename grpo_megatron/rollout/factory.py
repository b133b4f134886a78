"""Which engine a rank builds: by ``rollout.engine`` and where ``rollout/placement.py`` puts the engines,
this rank's ``RolloutEngine`` (an embedded engine, in this process or a process of its own, or an
SGLang engine's leader) or, on another GPU of an engine led from another rank, what loads that GPU's
share of the weights (``SGLangSyncMember``). The fleet (``rollout/fleet.py``) calls both on every rank
while it is built; each engine module is imported only when it is chosen."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from grpo_megatron.rollout.engine import EngineSpec, RolloutEngine, WeightSink
from grpo_megatron.rollout.placement import RolloutPlacement, runtime_placement

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from grpo_megatron.distributed.bootstrap import ParallelState

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype``'s torch dtype: the engines' weights and the weight sync's export."""


def make_engine(
    spec: EngineSpec,
    hf: Mapping[str, Any],
    ps: ParallelState,
    tokenizer: PreTrainedTokenizerBase | None = None,
    placement: RolloutPlacement | None = None,
) -> RolloutEngine | None:
    """This rank's engine where ``placement`` puts it (rollout/placement.py; None: decided here from
    the spec), or None if it hosts none."""
    rollout = spec.rollout
    placement = placement or runtime_placement(spec, ps, hf)
    if rollout.engine == "sglang":
        try:
            from grpo_megatron.rollout.sglang import engine as sglang_engine
        except ImportError as exc:
            raise RuntimeError(
                f"rollout.engine=sglang: the SGLang adapter grpo_megatron.rollout.sglang.engine cannot be "
                f"imported ({exc}); use rollout.engine=embedded, or install SGLang on a CUDA machine "
                "(pip install --no-deps -r requirements/gpu.txt: docs/getting-started/gpu.md)"
            ) from exc
        return sglang_engine.SGLangEngine.from_config(spec, ps, placement)
    if ps.rank not in placement.leaders():
        return None
    if rollout.embedded_process:
        from grpo_megatron.rollout.engine_process import EngineProcess

        return EngineProcess(
            hf,
            dtype=DTYPES[spec.model.dtype],
            max_batch_rows=rollout.embedded_max_batch_rows,
            threads=rollout.embedded_process_threads,
            record_routes=spec.record_routes,
            rank=ps.rank,
            health_timeout_s=rollout.recovery.health_timeout_s,
            log_path=spec.log_dir / f"engine-process-rank{ps.rank}.log" if spec.log_dir else None,
        )
    from grpo_megatron.rollout.embedded import EmbeddedEngine

    device = ps.device if rollout.engine_device == "auto" else torch.device("cpu")
    return EmbeddedEngine(
        hf,
        device=device,
        dtype=DTYPES[spec.model.dtype],
        tokenizer=tokenizer,
        max_batch_rows=rollout.embedded_max_batch_rows,
        record_routes=spec.record_routes,
    )


def make_sync_member(spec: EngineSpec, ps: ParallelState, placement: RolloutPlacement) -> WeightSink | None:
    """What loads this rank's share of the weights when an engine on another rank (a colocated
    SGLang engine's leader) uses this rank's GPU too; None elsewhere."""
    if not placement.colocated_sglang or placement.gpus_per_engine == 1:
        return None
    from grpo_megatron.rollout.sglang.member import SGLangSyncMember

    return SGLangSyncMember.from_config(spec, ps, placement)
