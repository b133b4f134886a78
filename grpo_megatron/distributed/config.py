"""Parallel section of the job config: how the policy is sharded over the world.

Layout (megatron-core's): the dense part of the model sees world = tp * cp * dp * pp; the experts see
world = etp * ep * edp * pp, where edp (expert data parallel) = tp * cp * dp / (etp * ep). Model-dependent
checks (heads, experts, layers) live in grpo_megatron.config because they need config.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal


@dataclass
class ParallelConfig:
    """Parallel degrees and process-group settings; `resolve(world_size)` fills the derived ones."""

    tp: int = 1
    """Tensor parallel size: attention heads and MLP columns split over this many ranks."""
    pp: int = 1
    """Pipeline parallel size: layers split into this many consecutive stages."""
    ep: int = 1
    """Expert parallel size: routed experts split over this many ranks."""
    cp: int = 1
    """Context parallel size: each sequence split over this many ranks."""
    etp: int | None = None
    """Expert tensor parallel size: each expert's weights split over this many ranks; None = tp."""
    dp: int | None = None
    """Data parallel size; None = derived as world_size // (tp * pp * cp)."""
    sequence_parallel: bool | None = None
    """Shard activations outside attention/MLP over TP; None = on when tp > 1 (MoE with tp > 1 needs it)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend, and with it the job's device: gloo runs on CPU, nccl on
    cuda:<local rank>; auto = nccl when this process sees CUDA, else gloo."""
    timeout_minutes: int = 30
    """Collective timeout: when every rank is blocked in collectives (mismatched calls, a network
    fault), the job fails after this long instead of stalling forever."""
    progress_timeout_s: float = 300.0
    """A rank whose heartbeat (its progress points, or its main thread moving through Python code)
    is older than this while it is outside any collective is stuck: every rank exits, naming it and
    its phase (distributed/watchdog.py). Must exceed the longest single blocking call of a phase
    (a wait for a GPU kernel, a file read); 0 = off."""
    long_phase_timeout_s: float = 3600.0
    """The same bound for the phases that block in one call for long: loading the initial weights,
    starting the rollout engines (an SGLang engine of a large model loads for minutes), and every
    rank's wait for a rollout (an engine's rank blocks until its longest response is done; the
    others wait in a collective, under timeout_minutes)."""

    def validate(self) -> None:
        """Checks that need neither the world size nor the model."""
        errors = [
            f"parallel.{name}={value} must be >= 1"
            for name, value in (("tp", self.tp), ("pp", self.pp), ("ep", self.ep), ("cp", self.cp))
            if value < 1
        ]
        for name, value in (("etp", self.etp), ("dp", self.dp)):
            if value is not None and value < 1:
                errors.append(f"parallel.{name}={value} must be >= 1, or null to derive it")
        if self.timeout_minutes < 1:
            errors.append(f"parallel.timeout_minutes={self.timeout_minutes} must be >= 1")
        if self.long_phase_timeout_s < 0:
            errors.append(f"parallel.long_phase_timeout_s={self.long_phase_timeout_s} must be >= 0")
        if self.progress_timeout_s < 0:
            errors.append(f"parallel.progress_timeout_s={self.progress_timeout_s} must be >= 0 (0 = off)")
        if errors:
            raise ValueError("\n".join(errors))

    def layout_errors(self, world_size: int) -> list[str]:
        """Everything wrong with this layout on `world_size` ranks (empty when it fits)."""
        if world_size < 1:
            return [f"world size {world_size} must be >= 1"]
        tp, pp, cp = self.tp, self.pp, self.cp
        model_parallel = tp * pp * cp
        if model_parallel < 1:
            return []  # validate() reports the non-positive degrees
        if self.dp is None:
            if world_size % model_parallel:
                return [
                    f"parallel.tp*pp*cp={tp}*{pp}*{cp}={model_parallel} does not divide the world size "
                    f"{world_size}: choose degrees whose product divides {world_size}, "
                    "or launch a multiple of that many ranks"
                ]
            dp = world_size // model_parallel
        else:
            dp = self.dp
            if model_parallel * dp != world_size:
                return [
                    f"parallel.tp*pp*cp*dp={tp}*{pp}*{cp}*{dp}={model_parallel * dp} != world size "
                    f"{world_size}: set parallel.dp=null to derive it, or launch "
                    f"{model_parallel * dp} ranks"
                ]
        etp = tp if self.etp is None else self.etp
        dense_ranks_per_stage = tp * cp * dp
        if etp < 1 or self.ep < 1:
            return []
        if dense_ranks_per_stage % (etp * self.ep):
            fits = _divisors(dense_ranks_per_stage // etp) if dense_ranks_per_stage % etp == 0 else []
            fix = (
                f"choose parallel.ep in {{{', '.join(map(str, fits))}}}"
                if fits
                else f"choose parallel.etp dividing {dense_ranks_per_stage}"
            )
            return [
                f"parallel.etp*ep={etp}*{self.ep}={etp * self.ep} does not divide tp*cp*dp="
                f"{tp}*{cp}*{dp}={dense_ranks_per_stage} (the ranks of one pipeline stage, which the "
                f"experts re-partition as etp*ep*expert_dp): {fix}"
            ]
        return []

    def resolve(self, world_size: int) -> ParallelConfig:
        """A copy with dp, etp and sequence_parallel filled in; ValueError if the layout does not fit."""
        errors = self.layout_errors(world_size)
        if errors:
            raise ValueError("\n".join(errors))
        return dataclasses.replace(
            self,
            dp=world_size // (self.tp * self.pp * self.cp) if self.dp is None else self.dp,
            etp=self.tp if self.etp is None else self.etp,
            sequence_parallel=self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel,
        )

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size of a resolved config: tp * cp * dp / (etp * ep)."""
        if self.dp is None or self.etp is None:
            raise ValueError("parallel.expert_dp needs a resolved config: call resolve(world_size) first")
        return self.tp * self.cp * self.dp // (self.etp * self.ep)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
