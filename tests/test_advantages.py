"""Group advantages: worked GRPO example, all-equal groups, Dr.GRPO, RLOO."""

import math

import pytest
import torch

from grpo_megatron.algorithm.advantages import advantages_from_config, group_advantages, token_advantages
from grpo_megatron.algorithm.config import AlgorithmConfig


def test_worked_grpo_example():
    # Group 1: rewards (1, 0, 0, 1): mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3).
    # Group 2: (1, 0, 0, 0): mean 0.25, std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5.
    rewards_b = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    adv_b = group_advantages(rewards_b, group_size=4, eps=0.0)
    a = 0.5 / math.sqrt(1 / 3)
    expected = torch.tensor([a, -a, -a, a, 0.75 / 0.5, -0.25 / 0.5, -0.25 / 0.5, -0.25 / 0.5])
    torch.testing.assert_close(adv_b, expected)
    # each group's advantages sum to zero
    torch.testing.assert_close(adv_b.view(2, 4).sum(1), torch.zeros(2), atol=1e-6, rtol=0)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -3.7])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("norm", [True, False])
def test_all_equal_group_is_exactly_zero(value, estimator, norm):
    rewards_b = torch.tensor([value] * 5 + [1.0, 0.0, 1.0, 0.0, 0.0])
    adv_b = group_advantages(rewards_b, 5, estimator=estimator, norm_by_std=norm)
    assert torch.isfinite(adv_b).all()
    assert torch.equal(adv_b[:5], torch.zeros(5))
    assert adv_b[5:].abs().sum() > 0


def test_group_size_one_is_zero_not_nan():
    adv_b = group_advantages(torch.tensor([1.0, 0.0, 2.0]), 1)
    assert torch.equal(adv_b, torch.zeros(3))


def test_dr_grpo_no_std():
    adv_b = group_advantages(torch.tensor([2.0, 0.0, 1.0, 1.0]), 4, norm_by_std=False)
    torch.testing.assert_close(adv_b, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_rloo_leave_one_out():
    # r = (3, 0, 0): baselines (0, 1.5, 1.5) -> A = (3, -1.5, -1.5) = G/(G-1) * (r - mean)
    adv_b = group_advantages(torch.tensor([3.0, 0.0, 0.0]), 3, estimator="rloo", norm_by_std=False)
    torch.testing.assert_close(adv_b, torch.tensor([3.0, -1.5, -1.5]))


def test_bad_group_size():
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.zeros(4), 3)


def test_token_advantages_masked():
    mask_bt = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = token_advantages(torch.tensor([2.0, -1.0]), mask_bt)
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))


def test_advantages_from_config():
    rewards_b = torch.tensor([2.0, 0.0, 1.0, 1.0])
    dr_grpo = AlgorithmConfig(norm_adv_by_std=False)
    torch.testing.assert_close(
        advantages_from_config(rewards_b, 4, dr_grpo), torch.tensor([1.0, -1.0, 0.0, 0.0])
    )
    rloo = AlgorithmConfig(advantage_estimator="rloo", norm_adv_by_std=False)
    torch.testing.assert_close(
        advantages_from_config(rewards_b, 4, rloo), torch.tensor([4 / 3, -4 / 3, 0.0, 0.0])
    )
