"""The GRPO loop's checkpointed state (training/grpo.py ``LoopState``): the on-disk dict is unchanged,
and checkpoints written before the class (and before ``best``) still resume."""

from __future__ import annotations

import io

import torch

from grpo_megatron.training.grpo import LoopState


def _round_trip(saved: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_loop_state_saves_the_dict_the_loop_always_saved() -> None:
    state = LoopState(7, {"epoch": 1, "position": 3}, {"eval/accuracy": 0.5}, (5, 0.625))
    assert state.to_dict() == {
        "iteration": 7,
        "sampler": {"epoch": 1, "position": 3},
        "eval": {"eval/accuracy": 0.5},
        "best": (5, 0.625),
    }
    assert LoopState.from_dict(_round_trip(state.to_dict())) == state


def test_loop_state_reads_checkpoints_from_before_best() -> None:
    old = _round_trip({"iteration": 3, "sampler": {"epoch": 0, "position": 48}, "eval": {}})
    assert LoopState.from_dict(old) == LoopState(3, {"epoch": 0, "position": 48}, {}, None)
