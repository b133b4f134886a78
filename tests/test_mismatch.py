"""Truncated importance sampling and mismatch metrics."""

import pytest
import torch

from grpo_megatron.algorithm.mismatch import mismatch_metrics, tis_weights


def test_tis_weights_truncated_and_masked():
    old_bt = torch.log(torch.tensor([[0.5, 0.9, 0.2], [0.3, 0.3, 0.3]]))
    rollout_bt = torch.log(torch.tensor([[0.5, 0.3, 0.4], [0.1, 0.6, 0.3]]))
    mask_bt = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w_bt, metrics = tis_weights(old_bt, rollout_bt, mask_bt, cap=2.0)
    # ratios 1, 3 -> 2 (capped), 0.5 | 3 -> 2 (capped), 0.5 | padding 0
    torch.testing.assert_close(w_bt, torch.tensor([[1.0, 2.0, 0.5], [2.0, 0.5, 0.0]]))
    assert metrics["tis/clip_frac"].item() == pytest.approx(2 / 5)
    assert metrics["tis/weight_mean"].item() == pytest.approx(6 / 5)


def test_tis_weights_are_constants_and_finite():
    old_bt = torch.zeros(1, 2, requires_grad=True)
    rollout_bt = torch.tensor([[-float("inf"), 0.0]])
    w_bt, _ = tis_weights(old_bt, rollout_bt, torch.ones(1, 2), cap=2.0)
    assert not w_bt.requires_grad
    assert torch.isfinite(w_bt).all() and w_bt[0, 0] == 2.0


def test_mismatch_metrics_values():
    trainer_bt = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout_bt = torch.tensor([[-1.0, -2.5, -100.0]])
    mask_bt = torch.tensor([[1.0, 1.0, 0.0]])
    m = mismatch_metrics(trainer_bt, rollout_bt, mask_bt)
    assert m.abs_diff_sum.item() == pytest.approx(0.5) and m.tokens.item() == 2  # mean 0.25
    assert m.abs_diff_max.item() == pytest.approx(0.5)  # the padding's 97 is masked


def test_identical_logprobs_give_zero_mismatch():
    lp = torch.randn(4, 6)
    m = mismatch_metrics(lp, lp.clone(), torch.ones(4, 6))
    assert m.abs_diff_sum.item() == 0.0 and m.abs_diff_max.item() == 0.0


def test_the_probe_runs_every_interval_and_at_the_last_iteration():
    from grpo_megatron.training.phases.sync import probe_due

    assert [it for it in range(1, 13) if probe_due(it, 5, 12)] == [5, 10, 12]
    assert [it for it in range(1, 4) if probe_due(it, 1, 3)] == [1, 2, 3]


def test_a_probe_beyond_rollout_probe_max_abs_stops_the_run_naming_the_field():
    from grpo_megatron.rollout.config import RolloutConfig
    from grpo_megatron.training.phases.sync import ProbeMismatchError, check_probe

    honest = {
        "mismatch/probe_abs_diff_max": 0.15,
        "mismatch/probe_abs_diff_mean": 0.01,
        "mismatch/probe_tokens": 40.0,
    }
    garbage = {**honest, "mismatch/probe_abs_diff_max": 7.3, "mismatch/probe_abs_diff_mean": 3.1}
    bound = RolloutConfig().probe_max_abs
    assert bound == 5.0  # the stated default
    check_probe(honest, bound, version=3)  # bf16 noise passes
    check_probe({}, bound, version=3)  # no probe this sync: nothing to judge
    check_probe(garbage, 0.0, version=3)  # 0 disables the bound
    refusal = r"up to 7\.3 nats \(mean 3\.1\) over 40 tokens, above rollout\.probe_max_abs=5"
    with pytest.raises(ProbeMismatchError, match=refusal):
        check_probe(garbage, bound, version=3)
    with pytest.raises(ValueError, match=r"rollout\.probe_max_abs=-1\.0 must be >= 0"):
        RolloutConfig(probe_max_abs=-1.0).validate()
    with pytest.raises(ValueError, match=r"rollout\.probe_max_abs=nan must be >= 0"):
        RolloutConfig(probe_max_abs=float("nan")).validate()
