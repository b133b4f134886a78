"""The other GPUs of a colocated SGLang engine: each is a destination of the weight sync of its own.

An engine of ``rollout.sglang.tp`` GPUs is led from its first trainer rank (``rollout/sglang/engine.py``);
every other rank of the group holds an ``SGLangSyncMember``, which receives exactly what its SGLang TP
rank loads and hands it to the leader as one payload per round (``rollout/sglang/ipc.py``). On the first
GPU of each further node of a multi-node engine it also starts, watches, restarts (with its leader, at
the leader's fresh address) and stops that node's part of the engine (``NodePart``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from grpo_megatron.rollout.config import RolloutConfig
from grpo_megatron.rollout.engine import Bucket, EngineSpec, Manifest, WeightSink
from grpo_megatron.rollout.placement import RolloutPlacement, runtime_placement
from grpo_megatron.rollout.sglang.health import EngineProcesses
from grpo_megatron.rollout.sglang.ipc import EngineGroupFeed, SharedStaging, contribution
from grpo_megatron.rollout.sglang.launch import import_sglang, start_node_part, torch_dtype
from grpo_megatron.rollout.sglang.layout import ColocatedLayout, agree_engine_address, layout_of
from grpo_megatron.rollout.sglang.model_config import engine_fp8, read_hf_config, starts_on_dummy
from grpo_megatron.rollout.sglang.shards import rank_needs
from grpo_megatron.rollout.sglang.watch import stop_lost_part
from grpo_megatron.rollout.sglang.weights import (
    PairedLoads,
    bucket_errors,
    checkpoint_shapes,
    engine_tensors,
    manifest_errors,
    tied_output_head,
    with_output_head,
)

if TYPE_CHECKING:
    from grpo_megatron.distributed.bootstrap import ParallelState
    from grpo_megatron.rollout.sglang.shards import ExpertBlock


@dataclasses.dataclass
class NodePart:
    """Node ``layout.node_rank`` >= 1's part of a colocated SGLang engine across nodes, on that node's
    first GPU of the engine: SGLang's schedulers of the node's GPUs (``launch.start_node_part``), driven
    from the leader's Engine (requests, weight loads and memory release/resume reach them through
    SGLang's own TP group), so only started, watched (``health``), restarted and shut down here."""

    spec: EngineSpec
    layout: ColocatedLayout
    ep_size: int
    ps: ParallelState
    engine: Any = None
    health: EngineProcesses | None = None

    def start(self, address: str) -> None:
        """Start the part, meeting the other parts at ``address`` (SGLang's ``dist_init_addr``);
        recoverable with ``rollout.recovery.max_restarts`` > 0, as the leader's: a SIGQUIT from a
        scheduler that saw a peer die is noted, and the fleet restarts the engine whole."""
        on_disk = bool(checkpoint_shapes(self.spec.model.hf_path))
        self.engine, self.health = start_node_part(
            self.spec, self.layout, address, self.ep_size, self.ps, weights_on_disk=on_disk
        )

    def restart(self, address: str, life: int) -> None:
        """Stop what is left of the part (``watch.stop_lost_part``; its log's header names ``life``)
        and start it again at ``address``, the leader's fresh one: called while the leader restarts
        its own part."""
        assert self.health is not None
        stop_lost_part(self.engine, self.health, life)
        self.start(address)

    def shutdown(self) -> None:
        """Stop the part: its own processes only (``EngineProcesses.engine_only_shutdown``), not the
        rank's other children."""
        if self.engine is not None and self.health is not None:
            with self.health.engine_only_shutdown():
                self.engine.shutdown()
        self.engine = None


class SGLangSyncMember(WeightSink):
    """The weight sync on a GPU of a colocated SGLang engine other than its leader's (SGLang TP rank
    ``tp_rank`` runs on it): it receives exactly what that rank loads (``weight_needs``), makes each
    round's bucket one payload on this GPU and hands it to the leader, which loads every GPU's
    payload in one ``update_weights_from_tensor`` call (``rollout/sglang/ipc.py``). It generates
    nothing (generation goes through the leader). A ``WeightSink`` (``rollout/engine.py``), whose loss
    contract (``check_alive``, ``restart``) concerns the node part it holds, if any.

    On the first GPU of a further node of an engine that spans several nodes it also holds ``node``,
    that node's part of the engine (``NodePart``)."""

    def __init__(
        self,
        rollout: RolloutConfig,
        model_path: str,
        members: Sequence[int],
        tp_rank: int,
        device: torch.device | str,
        node: NodePart | None = None,
        ep_size: int = 1,
        dtype: str = "bfloat16",
    ):
        _, flattened_cls, serializer = import_sglang()
        self.rollout = rollout
        self.model_path = str(model_path)
        self.sync_group_ranks = tuple(members)
        self.tp_rank = tp_rank
        self.device = device
        self.node = node
        self._classes = (flattened_cls, serializer)
        self._hf_config = read_hf_config(model_path)
        self.tied_head = tied_output_head(self._hf_config)
        self.tp_size = len(self.sync_group_ranks)
        self.ep_size = ep_size  # rollout/placement.py's engine EP
        self._expected_shapes = checkpoint_shapes(model_path)
        fp8 = rollout.weight_dtype == "fp8"
        dummy = starts_on_dummy(self._hf_config, bool(self._expected_shapes), fp8)  # as its leader's
        self.held = engine_tensors(
            self._expected_shapes,
            self._hf_config,
            torch_dtype(dtype),
            dummy=dummy,
            fp8=engine_fp8(fp8, self._hf_config),
        )
        self._accepted: Manifest | None = None
        self._pairs = PairedLoads()
        self.feed = EngineGroupFeed(members)
        self.staging = SharedStaging()
        """This GPU's reused shared-memory buffer on CPU, as the leader's (``ipc.SharedStaging``: safe
        because ``feed.contribute`` returns only after the leader's load of the round is done)."""

    @classmethod
    def from_config(
        cls, spec: EngineSpec, ps: ParallelState, placement: RolloutPlacement | None = None
    ) -> SGLangSyncMember | None:
        """This rank's member, when a colocated engine led from another rank uses its GPU; on a
        multi-node engine (collective: every non-leader rank calls it once while the fleet is built),
        the first rank of each further node also starts that node's part of the engine."""
        rollout = spec.rollout
        placement = placement or runtime_placement(spec, ps, read_hf_config(spec.model.hf_path))
        layout, gpus_per_node, local_rank = layout_of(placement, ps)
        if ps.rank == layout.leader:
            return None
        node = None
        if layout.multi_node:
            address = agree_engine_address(layout, gpus_per_node, local_rank)
            if layout.starter:
                node = NodePart(spec, layout, placement.engine_ep, ps)
                node.start(address)
        return cls(
            rollout,
            spec.model.hf_path,
            layout.members,
            ps.rank - layout.leader,
            ps.device,
            node,
            ep_size=placement.engine_ep,
            dtype=spec.model.dtype,
        )

    @property
    def health(self) -> EngineProcesses | None:
        """This node's part's processes (``NodePart``), watched as the leader's are; None without one."""
        return self.node.health if self.node is not None else None

    def check_alive(self) -> None:
        """Raise ``EngineLost`` if this node's part of the engine lost a process or has one stopped
        (``EngineProcesses.check_now``); nothing on other members. The fleet's recovery asks when some
        engine was lost (``EngineRecovery.recover``), so that a further node's loss is named with its
        own log."""
        if self.health is not None:
            self.health.check_now()

    def restart(self, address: str | None = None) -> None:
        """The engine this GPU belongs to restarts in place (``EngineRecovery.restart_engines``): on a
        further node's first GPU of an engine across nodes, that node's part restarts at ``address``
        (the leader's ``SGLangEngine.restart_address``) while the leader restarts its own; and, as on
        every member, what was staged of an abandoned version is dropped (``abort_update``)."""
        self._pairs = PairedLoads()
        self.life += 1
        if self.node is not None:
            if address is None:
                raise RuntimeError(
                    f"SGLang TP rank {self.tp_rank}'s node part needs its leader's fresh address"
                )
            self.node.restart(address, self.life)

    def stop_watching(self) -> None:
        if self.health is not None:
            self.health.stopping = True

    def shutdown(self) -> None:
        """Stop this node's part of the engine, if this rank started one (``NodePart.shutdown``)."""
        if self.node is not None:
            self.node.shutdown()
            self.node = None

    def weight_needs(self) -> ExpertBlock | None:
        return rank_needs(self._hf_config, self.tp_size, self.ep_size, self.tp_rank)

    def bind_sync_group(self, group: Any) -> None:
        self.feed.group = group

    def check_manifest(self, manifest: Manifest, version: int) -> list[str]:
        """This GPU's share of the sync against what its SGLang TP rank holds, as the leader's
        (``SGLangEngine.check_manifest``)."""
        if manifest is self._accepted:
            return []
        errors = manifest_errors(
            manifest, self.held, self.weight_needs(), f"the checkpoint at {self.model_path}"
        )
        if errors:
            return [
                f"weight sync of version {version} refused by SGLang TP rank {self.tp_rank} ({len(errors)} "
                "problems): " + "; ".join(errors[:10])
            ]
        self._accepted = manifest
        return []

    def load_target(self, name: str) -> torch.Tensor | None:
        return None  # SGLang's loader copies from the payload

    def abort_update(self, version: int) -> None:
        """A version abandoned (rejected elsewhere, or its engine lost and restarted: the fleet
        resends it from its first bucket): drop the tensors held for a partner that has not come.
        Nothing else here depends on the engine's life: the accepted manifest judges this GPU's
        checkpoint shapes, the feed only the group, the staging buffer is written afresh each round."""
        self._pairs = PairedLoads()

    def update_weights(self, bucket: Bucket, *, version: int, last: bool) -> None:
        try:
            if self.health is not None:  # this node's part of the engine died: named, with its log
                self.health.check()
            errors = bucket_errors(bucket, self._expected_shapes, f"the checkpoint at {self.model_path}")
            if errors:
                raise ValueError(f"weight sync of version {version}: {'; '.join(errors[:5])}")
            arranged = self._pairs.arrange(
                bucket, version=version, last=last
            )  # as SGLangEngine.update_weights
            mine = contribution(
                with_output_head(arranged, self.tied_head), self._classes, self.device, self.staging
            )
        except Exception as exc:  # handed to the leader like a payload: every GPU fails this round together
            self.feed.contribute((None, False, f"{type(exc).__name__}: {exc}"))
            raise
        self.feed.contribute(mine)
        if last:
            self.weight_version = version
