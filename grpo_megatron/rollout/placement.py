"""Where the rollout engines run and what occupies a GPU in each phase: one decision, from the
config alone (pure Python, no torch).

Both sides call ``decide_placement``: the runtime (``rollout/fleet.py`` builds the engines it lists,
``rollout/sglang/`` starts SGLang with its width and expert parallelism, ``training/offload.py``
moves memory by its phase table) and ``grpo-megatron plan`` (``planner/``: the placement it prints
and every phase's memory). What it decides:

- **engines**: each engine's GPUs as global ranks (its first rank leads it) and so its nodes.
  ``embedded``: by ``rollout.placement`` (per_dp_rank: each rank with TP, CP and PP rank 0; per_node:
  each node's local rank 0; per_rank: every rank), one GPU each. ``sglang`` colocated: blocks of
  ``gpus_per_engine`` consecutive ranks, the width being ``rollout.sglang.tp`` when set, else by
  ``rollout.placement`` (per_node: a node's GPUs; per_dp_rank: one model replica, tp x pp x cp).
  ``sglang`` disaggregated: servers outside the job (no engine GPU here).
- **engine EP** (SGLang's ``ep_size``): ``rollout.sglang.ep`` when set, else for a MoE model the
  largest number dividing both the engine's width and the routed experts (the width, for the usual
  power-of-two counts; each engine GPU then loads and receives the dense weights + experts / EP), and
  1 for a dense one.
- **memory of each phase** (``PHASES``): which parts of the trainer's state (``TRAINER_PARTS``) and
  which engine memory tags (``ENGINE_TAGS``) are on the device. Colocated SGLang engines start while
  the trainer's state is in host memory and release their memory for training (and their KV cache
  for a checkpoint save) whatever ``train.offload_trainer`` says; ``train.offload_trainer`` also moves
  the trainer's state off the device while the engines generate.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_megatron.models.config import num_routed_experts

if TYPE_CHECKING:
    from grpo_megatron.distributed.bootstrap import ParallelState
    from grpo_megatron.rollout.config import RolloutConfig
    from grpo_megatron.rollout.engine import EngineSpec

TRAINER_PARTS: frozenset[str] = frozenset({"params", "grads", "optimizer"})
"""The trainer's state, as training/offload.py moves it."""
ENGINE_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph")
"""The engine's memory, as SGLang releases and resumes it (rollout/engine.py: ALL_MEMORY_TAGS)."""
PHASES: tuple[str, ...] = ("start-up", "rollout", "train", "sync", "probe", "save")
"""start-up: the engines start; rollout: they generate; train: the trainer's passes; sync: the
weights stream into the engines; probe: the mismatch probe (engines score, trainer forwards);
save: a checkpoint is written."""


@dataclass(frozen=True)
class Occupancy:
    """What is on an engine GPU during one phase."""

    trainer: frozenset[str]
    """Parts of the trainer's state on the device (``TRAINER_PARTS``)."""
    engine: frozenset[str]
    """Engine memory tags held (``ENGINE_TAGS``)."""


@dataclass(frozen=True)
class RolloutPlacement:
    """The decision; ``why`` says where each choice came from (printed by ``plan``)."""

    engine: str
    """rollout.engine: embedded or sglang."""
    mode: str
    """colocated (engines on the trainer's GPUs) or disaggregated (SGLang servers elsewhere)."""
    world_size: int
    gpus_per_node: int
    gpus_per_engine: int
    """GPUs one engine spans (SGLang's tp_size; 1 for an embedded engine; 0: disaggregated)."""
    engine_ep: int
    """Expert parallelism inside one engine (SGLang's ep_size; 1 for dense models and embedded)."""
    engines: tuple[tuple[int, ...], ...]
    """Each engine's GPUs as global ranks, in engine order; the first rank leads the engine."""
    offload_trainer: bool
    """train.offload_trainer: the trainer's state leaves the device while the engines generate."""
    swaps_engine_memory: bool
    """The engines release their memory for training (colocated SGLang, or any offloading job)."""
    why: dict[str, str] = field(default_factory=dict)

    @property
    def colocated_sglang(self) -> bool:
        return self.engine == "sglang" and self.mode == "colocated"

    def leaders(self) -> list[int]:
        return [members[0] for members in self.engines]

    def engine_of(self, rank: int) -> int | None:
        """Index of the engine using ``rank``'s GPU, or None."""
        for i, members in enumerate(self.engines):
            if rank in members:
                return i
        return None

    def nodes(self, index: int) -> tuple[int, ...]:
        """Nodes engine ``index`` spans (ranks laid out node-major)."""
        return tuple(sorted({r // self.gpus_per_node for r in self.engines[index]}))

    def phases(self) -> dict[str, Occupancy]:
        """What is on the device in each phase; ``training/offload.py:ColocatedMemory`` moves the
        memory to match, ``planner/memory.py`` adds it up."""
        everything = Occupancy(TRAINER_PARTS, frozenset(ENGINE_TAGS))
        if not self.swaps_engine_memory:
            held = dict.fromkeys(PHASES, everything)
            if self.colocated_sglang:
                # SGLang sizes its KV pool from the memory free as it starts: the trainer's state is out
                # then, as in a swapping layout, so the pool is the one `plan` counts (issue 51 item 3);
                # afterwards both stay, and `plan` adds both up in every phase.
                held["start-up"] = Occupancy(frozenset(), frozenset(ENGINE_TAGS))
            return held
        resident = frozenset() if self.offload_trainer else TRAINER_PARTS
        weights, tags = frozenset({"weights"}), frozenset(ENGINE_TAGS)
        rollout = Occupancy(resident, tags)
        return {
            "start-up": Occupancy(frozenset() if self.colocated_sglang else TRAINER_PARTS, tags),
            "rollout": rollout,
            "train": Occupancy(TRAINER_PARTS, frozenset()),
            "sync": Occupancy(frozenset({"params"}) | resident, weights),
            "probe": Occupancy(frozenset({"params"}) | resident, tags),
            # A checkpoint reads parameters and optimizer state, not gradients; an offloading job
            # brings back only those, beside the engines' weights. Otherwise the rollout phase's
            # memory (everything resident) is the save's: nothing moves.
            "save": Occupancy(frozenset({"params", "optimizer"}), weights)
            if self.offload_trainer
            else rollout,
        }


def width_choices(gpus_per_node: int, world_size: int) -> list[int]:
    """Engine widths a layout accepts: divisors of the GPUs per node, or whole nodes."""
    inside = [d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0 and world_size % d == 0]
    across = [m for m in range(2 * gpus_per_node, world_size + 1, gpus_per_node) if world_size % m == 0]
    return inside + across


def routed_experts(hf: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer of an HF config (0 for a dense model)."""
    return num_routed_experts(dict(hf))


def _sglang_width(
    rollout: RolloutConfig, world_size: int, gpus_per_node: int, replica: int
) -> tuple[int, str]:
    width, why = rollout.sglang_width(gpus_per_node, replica)
    if world_size % width or (gpus_per_node % width if width <= gpus_per_node else width % gpus_per_node):
        raise ValueError(
            f"SGLang engines of {width} GPUs ({why}) do not fit {world_size} ranks with {gpus_per_node} GPUs "
            f"per node: an engine spans a divisor of the GPUs per node, or whole nodes, and the engines must "
            f"tile the world size; set rollout.sglang.tp to one of {width_choices(gpus_per_node, world_size)}"
        )
    return width, why


def _sglang_ep(rollout: RolloutConfig, width: int, hf: Mapping[str, Any]) -> tuple[int, str]:
    experts = routed_experts(hf)
    if rollout.sglang.ep > 0:
        ep, why = rollout.sglang.ep, f"rollout.sglang.ep={rollout.sglang.ep}"
    elif experts:
        ep = math.gcd(width, experts)
        why = f"the default for a MoE model: the largest divisor of the engine's {width} GPUs and {experts} experts"
    else:
        return 1, "dense model"
    if width % ep:
        raise ValueError(
            f"engine EP {ep} ({why}) must divide the engine's {width} GPUs; set rollout.sglang.ep"
        )
    if ep > 1 and (not experts or experts % ep):
        raise ValueError(
            f"engine EP {ep} ({why}) must divide the model's {experts} routed experts; set rollout.sglang.ep "
            f"to a common divisor of {width} and {experts}"
        )
    return ep, why


def embedded_engines(
    placement: str, world_size: int, gpus_per_node: int, tp: int, pp: int, cp: int
) -> list[int]:
    """Ranks hosting an embedded engine. per_dp_rank: TP, CP and PP rank 0 under megatron's order
    tp-cp-ep-dp-pp (tp fastest, pp slowest), i.e. ``rank % tp == 0``, ``(rank // tp) % cp == 0`` and
    ``rank < world / pp``; per_node: local rank 0; per_rank: every rank."""
    if placement == "per_rank":
        return list(range(world_size))
    if placement == "per_node":
        return list(range(0, world_size, gpus_per_node))
    if placement == "per_dp_rank":
        return [r for r in range(world_size // pp) if r % tp == 0 and (r // tp) % cp == 0]
    raise ValueError(f"rollout.placement={placement!r}: choose per_dp_rank, per_node or per_rank")


def decide_placement(
    rollout: RolloutConfig,
    *,
    offload_trainer: bool,
    max_staleness: int,
    world_size: int,
    gpus_per_node: int,
    tp: int,
    pp: int,
    cp: int,
    hf: Mapping[str, Any],
) -> RolloutPlacement:
    """The rollout placement of a job of ``world_size`` ranks, ``gpus_per_node`` per node, trainer
    layout ``tp`` x ``pp`` x ``cp``, model ``hf``, ``max_staleness`` (train.max_staleness: above 0 the
    engines generate while the trainer trains, so nothing swaps). Raises ``ValueError`` naming the
    field to change."""
    gpus_per_node = min(gpus_per_node, world_size)
    why = {"offload": f"train.offload_trainer={str(offload_trainer).lower()}"}
    common: dict[str, Any] = {
        "world_size": world_size,
        "gpus_per_node": gpus_per_node,
        "offload_trainer": offload_trainer,
    }
    if rollout.engine == "embedded":
        ranks = embedded_engines(rollout.placement, world_size, gpus_per_node, tp, pp, cp)
        why["engines"] = f"rollout.placement={rollout.placement}"
        if rollout.true_on_policy:  # the policy engine: every rank takes part in every decode step
            ranks, why["engines"] = (
                list(range(world_size)),
                "rollout.true_on_policy: the policy on every rank",
            )
        return RolloutPlacement(
            "embedded",
            "colocated",
            gpus_per_engine=1,
            engine_ep=1,
            engines=tuple((r,) for r in ranks),
            swaps_engine_memory=offload_trainer,
            why=why,
            **common,
        )
    if rollout.engine != "sglang":
        raise ValueError(f"rollout.engine={rollout.engine!r}: choose embedded or sglang")
    if rollout.sglang.mode == "disaggregated":
        why["engines"] = (
            f"rollout.sglang.server_urls: {len(rollout.sglang.server_urls)} server(s), driven by rank 0"
        )
        return RolloutPlacement(
            "sglang",
            "disaggregated",
            gpus_per_engine=0,
            engine_ep=1,
            engines=(),
            swaps_engine_memory=offload_trainer,
            why=why,
            **common,
        )
    width, why["width"] = _sglang_width(rollout, world_size, gpus_per_node, tp * pp * cp)
    ep, why["ep"] = _sglang_ep(rollout, width, hf)
    engines = tuple(tuple(range(start, start + width)) for start in range(0, world_size, width))
    swaps = max_staleness == 0
    why["memory"] = (
        "colocated SGLang: engines start beside an offloaded trainer and release their memory for training"
        if swaps
        else f"train.max_staleness={max_staleness}: the engines generate while the trainer trains, so the "
        "engines' memory and the trainer's stay on the device in every phase (the engines start beside an "
        "offloaded trainer all the same: their KV pool is sized as planned)"
    )
    return RolloutPlacement(
        "sglang",
        "colocated",
        gpus_per_engine=width,
        engine_ep=ep,
        engines=engines,
        swaps_engine_memory=swaps,
        why=why,
        **common,
    )


def runtime_placement(spec: EngineSpec, ps: ParallelState, hf: Mapping[str, Any]) -> RolloutPlacement:
    """``decide_placement`` for a running job's engines: its parallel state, GPUs per node from the
    launcher's LOCAL_WORLD_SIZE (torchrun and launch/ set it; absent: one node)."""
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ps.world_size))
    return decide_placement(
        spec.rollout,
        offload_trainer=spec.offload_trainer,
        max_staleness=spec.max_staleness,
        world_size=ps.world_size,
        gpus_per_node=gpus_per_node,
        tp=ps.tp,
        pp=ps.pp,
        cp=ps.cp,
        hf=hf,
    )
