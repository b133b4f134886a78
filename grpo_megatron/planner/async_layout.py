"""The asynchronous layout's expected step time (``grpo-megatron plan --phase-times ...``).

Synchronous and colocated, the W trainer GPUs also run the engines, one phase after the other:

    step_sync = rollout + reward + train + sync + other

Asynchronous (train.max_staleness >= 1), the engines get E GPUs of their own and generate the next
batch while the trainer trains; with rollout throughput proportional to GPUs, their rollout takes
rollout * W / E, and the step is the slower of the two sides plus the sync (taken between batches):

    step_async = max(rollout * W / E, reward + train + other) + sync

Asynchronous and colocated (SGLang engines on the trainer's own GPUs, rollout.sglang.mode=colocated),
the engines and the trainer are two processes on each GPU: their kernels take turns rather than
overlap, so generating while training gains little, and the step is planned as the synchronous one:

    step_time_sliced = rollout + reward + train + sync + other

Phase times come from a synchronous run (metrics.jsonl's ``time/<phase>``, or given by hand).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PHASES = ("rollout", "reward", "train", "sync")


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds per iteration of each phase of a synchronous run; ``other``: the rest (advantages, logprob
    passes, onload), on the trainer's side."""

    rollout: float
    reward: float
    train: float
    sync: float
    other: float = 0.0

    @classmethod
    def parse(cls, text: str) -> PhaseTimes:
        """From ``rollout=1.2,train=2.0,...`` (seconds; missing phases are 0)."""
        values: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in (*PHASES, "other"):
                raise ValueError(
                    f"--phase-times: {item!r} is not <phase>=<seconds> with a phase of {PHASES} or other"
                )
            values[name] = float(value)
        return cls(**{p: values.get(p, 0.0) for p in (*PHASES, "other")})

    @classmethod
    def from_metrics(cls, path: Path) -> PhaseTimes:
        """Mean ``time/<phase>`` over a metrics.jsonl's iterations after the first (its start-up costs)."""
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("iteration", 0) >= 2 and r.get("time/iteration") is not None]
        if not rows:
            raise ValueError(f"{path}: no iteration >= 2 with time/* metrics")

        def avg(key: str) -> float:
            return sum(float(r.get(f"time/{key}") or 0.0) for r in rows) / len(rows)

        known = {p: avg(p) for p in PHASES}
        total = sum(float(r["time/iteration"]) - float(r.get("time/eval") or 0.0) for r in rows) / len(rows)
        return cls(**known, other=max(total - sum(known.values()), 0.0))


@dataclass(frozen=True)
class AsyncEstimate:
    trainer_gpus: int
    engine_gpus: int
    step_sync_s: float
    step_async_s: float
    bound: str
    """Which side sets the asynchronous step: "rollout" or "trainer"."""


def estimate(times: PhaseTimes, trainer_gpus: int, engine_gpus: int) -> AsyncEstimate:
    """The two step times of the module docstring."""
    rollout = times.rollout * trainer_gpus / engine_gpus
    trainer = times.reward + times.train + times.other
    return AsyncEstimate(
        trainer_gpus,
        engine_gpus,
        step_sync_s=times.rollout + trainer + times.sync,
        step_async_s=max(rollout, trainer) + times.sync,
        bound="rollout" if rollout > trainer else "trainer",
    )


def time_sliced(times: PhaseTimes, gpus: int) -> AsyncEstimate:
    """Colocated engines (module docstring): the asynchronous step as the synchronous one."""
    step = times.rollout + times.reward + times.train + times.other + times.sync
    return AsyncEstimate(gpus, 0, step_sync_s=step, step_async_s=step, bound="time-sliced")


COLOCATED = (
    "the engines share the trainer's {gpus} GPUs (rollout.sglang.mode=colocated): two processes per GPU, "
    "time-sliced, so generating while training overlaps little; both keep their memory in every phase (the "
    "phases above add them up; the KV pool is sized at start-up, the trainer's state offloaded meanwhile). "
    "Engine GPUs of their own: rollout.sglang.mode=disaggregated"
)


def render(e: AsyncEstimate, max_staleness: int) -> str:
    if e.bound == "time-sliced":
        return "\n".join(
            [
                f"Asynchronous layout (train.max_staleness={max_staleness}): "
                + COLOCATED.format(gpus=e.trainer_gpus),
                f"  expected step: {e.step_async_s:.2f} s, as the synchronous colocated step (time-sliced)",
            ]
        )
    gpus = e.trainer_gpus + e.engine_gpus
    return "\n".join(
        [
            f"Asynchronous layout (train.max_staleness={max_staleness}): trainer GPUs {e.trainer_gpus} "
            f"(the parallel layout above), engine GPUs {e.engine_gpus} of their own, {gpus} in all",
            f"  expected step: synchronous colocated on {e.trainer_gpus} GPUs {e.step_sync_s:.2f} s; asynchronous "
            f"{e.step_async_s:.2f} s ({e.bound}-bound), {e.step_async_s / e.step_sync_s:.2f}x the time on "
            f"{gpus / e.trainer_gpus:.2f}x the GPUs",
        ]
    )
