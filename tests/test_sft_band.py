"""The banded cold start's bookkeeping (training/sft.py BandKeeper) and its config checks: which
evaluation's weights are exported, when the run stops, and when it replays a jump past the band."""

from __future__ import annotations

import pytest

from grpo_megatron.training.config import SFTConfig
from grpo_megatron.training.sft import BandKeeper, DevEval


def feed(keeper: BandKeeper, accuracies: list[tuple[int, float]]) -> list[str]:
    return [keeper.observe(DevEval(step, acc))[0] for step, acc in accuracies]


def test_keeps_the_in_band_evaluation_closest_to_the_centre_and_stops_at_the_centre():
    keeper = BandKeeper(0.2, 0.3)
    assert feed(keeper, [(0, 0.0), (25, 0.21), (50, 0.24), (75, 0.31)]) == ["continue"] * 3 + ["stop"]
    assert keeper.kept == DevEval(50, 0.24)
    assert "closest to the centre" in keeper.reason()


def test_an_in_band_evaluation_at_or_above_the_centre_stops_and_is_kept():
    keeper = BandKeeper(0.2, 0.3)
    assert feed(keeper, [(0, 0.0), (25, 0.27)]) == ["continue", "stop"]
    assert keeper.kept == DevEval(25, 0.27)


def test_a_jump_past_the_band_replays_once_from_the_last_evaluation_below_it():
    keeper = BandKeeper(0.2, 0.3)
    assert feed(keeper, [(0, 0.0), (25, 0.05), (50, 0.42)]) == ["continue", "continue", "replay"]
    assert keeper.below == DevEval(25, 0.05)
    # the replay evaluates every step: 26..50
    assert feed(keeper, [(26, 0.08), (27, 0.19), (28, 0.23), (29, 0.35)]) == ["continue"] * 3 + ["stop"]
    assert keeper.kept == DevEval(28, 0.23)


def test_a_jump_the_replay_cannot_split_keeps_the_evaluation_closest_to_the_band():
    keeper = BandKeeper(0.2, 0.3)
    assert feed(keeper, [(0, 0.0), (25, 0.18), (50, 0.5)]) == ["continue", "continue", "replay"]
    assert feed(keeper, [(26, 0.18), (27, 0.45)]) == ["continue", "stop"]
    assert keeper.kept.accuracy == 0.18
    assert "no evaluation landed in the band" in keeper.reason()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"target_accuracy_band": (0.3, 0.2)}, "sft.target_accuracy_band=[0.3, 0.2] must be [low, high]"),
        ({"target_accuracy_band": (0.2, 1.5)}, "0 <= low < high <= 1"),
        ({"target_accuracy_band": (0.2,)}, "must be [low, high]"),
        ({"target_accuracy_band": (0.2, 0.3), "stop_accuracy": 0.25}, "are exclusive"),
    ],
)
def test_band_is_validated(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SFTConfig(**fields).validate()
    SFTConfig(target_accuracy_band=(0.2, 0.3)).validate()


def test_without_an_in_band_evaluation_the_latest_of_equally_close_ones_is_kept():
    keeper = BandKeeper(0.2, 0.3)
    assert feed(keeper, [(0, 0.0), (2, 0.0), (4, 0.0)]) == ["continue"] * 3  # then sft.max_steps ends it
    assert keeper.kept == DevEval(4, 0.0)
