"""What each GPU of a colocated SGLang engine loads, so the weight sync sends it exactly that (pure).

Facts from SGLang's source (read, not run here; sgl-project/sglang):

- ``update_weights_from_tensor`` takes one serialized payload per TP rank and each TP worker loads
  ``serialized_named_tensors[tp_rank]`` (``managers/tp_worker.py``): the payloads may differ.
- Dense (non-expert) weights: its linear, embedding and QKV/gate-up loaders take the full HF tensor
  and narrow it by TP rank themselves (``layers/linear.py``, ``vocab_parallel_embedding.py``), so
  every rank receives those in full.
- Experts with ``ep_size`` > 1 (``distributed/parallel_state.py:initialize_model_parallel``):
  ``moe_tp_size = tp_size // ep_size`` (MoE data parallelism at its default 1); the MoE EP groups
  of one engine are ``range(j, tp_size, moe_tp_size)`` for ``j < moe_tp_size``, so TP rank ``r`` is
  MoE EP rank ``r // moe_tp_size`` (and MoE TP rank ``r % moe_tp_size``).
- ``FusedMoE`` (``layers/moe/fused_moe_triton/layer.py``) owns ``num_experts // ep_size`` experts,
  the contiguous block ``[moe_ep_rank * n, (moe_ep_rank + 1) * n)``; its ``weight_loader`` maps a
  global expert id to a local one and returns without loading any other (-1). With MoE TP
  (``moe_tp_size`` > 1) it narrows each local expert's full tensor by MoE TP rank itself.
- Expert placement other than that trivial block (EPLB, redundant experts, a custom initial expert
  location) goes through ``logical_to_all_physical`` and can put an expert on several ranks: we
  refuse those server args rather than guess.

So a rank receives every dense tensor in full and, with ``ep_size`` > 1, only the experts of its
block (not sending the others is safe: its loader would skip them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from grpo_megatron.rollout.placement import routed_experts

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
"""A routed expert's HF name: ``...mlp.experts.E.*`` (Qwen-MoE, DeepSeek-V3) and
``...block_sparse_moe.experts.E.*`` (Mixtral); shared experts (``shared_expert(s).*``) do not match."""

_PLACEMENT_ARGS = ("enable_eplb", "ep_num_redundant_experts", "init_expert_location", "ep_dispatch_algorithm")
"""SGLang server args that move experts away from the contiguous block of each EP rank."""


def check_expert_placement(server_args: Mapping[str, Any]) -> None:
    """Refuse ``rollout.sglang.server_args`` that place experts other than in contiguous blocks per EP
    rank (the engine's EP itself is ``rollout/placement.py``'s decision)."""
    placed = [
        k
        for k in _PLACEMENT_ARGS
        if server_args.get(k) not in (None, False, 0, "trivial") and k in server_args
    ]
    if placed:
        raise ValueError(
            f"rollout.sglang.server_args sets {placed}: SGLang then places experts by its expert-location "
            "map (EPLB / redundant experts), which the weight sync does not follow (it sends each GPU the "
            "contiguous block of experts of its EP rank); remove them from rollout.sglang.server_args"
        )
    if int(server_args.get("moe_dp_size", 1) or 1) != 1:
        raise ValueError(
            "rollout.sglang.server_args sets moe_dp_size != 1: the weight sync maps TP ranks to MoE EP ranks "
            "for MoE data parallelism 1 only; remove moe_dp_size from rollout.sglang.server_args"
        )


def moe_ep_rank(tp_rank: int, tp_size: int, ep_size: int) -> int:
    """SGLang's MoE EP rank of engine TP rank ``tp_rank`` (MoE data parallelism 1): the EP groups are
    strided by ``moe_tp_size = tp_size // ep_size``, so it is ``tp_rank // moe_tp_size``."""
    return tp_rank // (tp_size // ep_size)


@dataclass(frozen=True)
class ExpertBlock:
    """Which HF tensors one engine rank receives: every non-expert tensor, and the routed experts
    ``first .. first + count - 1``. Picklable (every rank of the trainer learns every destination's
    needs in the plan's metadata exchange)."""

    first: int
    count: int

    def __call__(self, hf_name: str) -> bool:
        match = _EXPERT.search(hf_name)
        return match is None or self.first <= int(match.group(1)) < self.first + self.count


def rank_needs(hf: Mapping[str, Any], tp_size: int, ep_size: int, tp_rank: int) -> ExpertBlock | None:
    """What engine TP rank ``tp_rank`` of an engine of ``tp_size`` GPUs at ``ep_size`` loads: None
    (everything) without expert parallelism, else its block of ``experts / ep_size`` experts."""
    if ep_size <= 1:
        return None
    count = routed_experts(hf) // ep_size
    return ExpertBlock(moe_ep_rank(tp_rank, tp_size, ep_size) * count, count)
