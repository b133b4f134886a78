"""Which ``GroupSource`` a run takes its scored groups from (training/groups.py), built once from the job
with what a resumed checkpoint kept of it, and what a checkpoint keeps of it: the factory of the loop's
group sources, above every arrangement (``RolloutNow``, ``GroupProducer``: training/groups.py;
``PartialRollouts``: training/partial.py; ``ReplaySource``, ``DumpingSource``: training/rollout_dump.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_megatron.training.groups import (
    GroupProducer,
    GroupSource,
    RolloutNow,
    SourceParts,
    give_back_submitted,
)
from grpo_megatron.training.partial import PartialRollouts, file_trace
from grpo_megatron.training.rollout_dump import DumpingSource, ReplaySource, RolloutDump, run_identity

if TYPE_CHECKING:
    from grpo_megatron.data import PromptSampler
    from grpo_megatron.training.job import Job

ROUND_TRACE_ENV = "GRPO_ROUND_TRACE"
"""A file the continuous source appends each round's events to (benches: bench/partial_iterations.py)."""


def group_source(job: Job, sampler: PromptSampler, resumed: Mapping[str, Any] | None) -> GroupSource:
    """Where a run's scored groups come from, decided once: a dump (rollout.replay_dir: ``ReplaySource``,
    training/rollout_dump.py), else the engines (``engine_source``), their batches also written to a
    dump with rollout.dump_dir (``DumpingSource``)."""
    rollout = job.cfg.rollout
    if rollout.replay_dir or rollout.dump_dir:
        identity = run_identity(job.hf, job.tokenizer.get_vocab(), job.ps)
    if rollout.replay_dir:
        return ReplaySource(Path(rollout.replay_dir), identity, job.cfg.train.iterations)
    source = engine_source(job, sampler, resumed)
    if rollout.dump_dir:
        return DumpingSource(source, RolloutDump(Path(rollout.dump_dir), identity, job.ps), job.fleet)
    return source


def source_parts(job: Job, sampler: PromptSampler) -> SourceParts:
    """What the engines' sources act on, from the job."""
    cfg = job.cfg
    return SourceParts(
        job.rollout, job.scorer, job.train_records, sampler, cfg.train, cfg.algorithm.dynamic_sampling
    )


def engine_source(job: Job, sampler: PromptSampler, resumed: Mapping[str, Any] | None) -> GroupSource:
    """The engines' source, decided once (``JobConfig.producer_loop``), with what a resumed checkpoint
    kept of its source (``source_state``): an asynchronous run's submitted batches, or, resumed
    synchronously, their prompts given back to the sampler. ``GRPO_ROUND_TRACE`` (a file; benches):
    the continuous source records each of its rounds there (``partial.file_trace``)."""
    saved = (resumed or {}).get(SOURCE_STATE)
    parts = source_parts(job, sampler)
    if job.cfg.rollout.partial.enabled:  # continuous generation: a pool of partial rollouts
        traced = os.environ.get(ROUND_TRACE_ENV)
        partial = PartialRollouts(parts, trace=file_trace(traced) if traced else None)
        if saved and "partial_pool" in saved:
            partial.load_state_dict(saved)
        elif saved:  # an asynchronous run's checkpoint: its submitted prompts are drawn again
            give_back_submitted(sampler, saved)
        return partial
    if saved and "partial_pool" in saved and job.ps.rank == 0:
        print(
            "[train] resumed a partial-rollout run's checkpoint without rollout.partial.enabled: its groups "
            "in flight are dropped and their prompts not drawn again",
            flush=True,
        )
    if job.cfg.producer_loop:  # engines that generate while the trainer trains: rollouts submitted ahead
        producer = GroupProducer(parts)
        if saved is not None and "batches" in saved:
            producer.load_state_dict(saved)
        return producer
    if saved and (given_back := give_back_submitted(sampler, saved)) and job.ps.rank == 0:
        print(
            f"[train] resumed an asynchronous run's checkpoint synchronously: the prompts of its "
            f"{given_back} submitted batches are generated again, with the weights trained here",
            flush=True,
        )
    return RolloutNow(parts)


SOURCE_STATE = "producer"
"""The key of the group source's state in a checkpoint's ``trainer_state.pt`` (the name it was saved
under before this module)."""


def source_state(trainer_state: dict[str, Any], source: GroupSource) -> dict[str, Any]:
    """Collective: the checkpoint's trainer state, with what ``source`` keeps (the asynchronous
    producer's submitted batches)."""
    kept = source.state_dict()
    return trainer_state if kept is None else {**trainer_state, SOURCE_STATE: kept}
