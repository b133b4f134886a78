"""KL estimators (Schulman's note) and the beta schedule."""

import math

import pytest
import torch

from grpo_megatron.algorithm.config import KLConfig
from grpo_megatron.algorithm.kl import kl_beta, kl_estimate


def test_hand_values():
    # pi = 0.25, pi_ref = 0.5: log r = log 2
    lp = torch.tensor([[math.log(0.25)]])
    ref = torch.tensor([[math.log(0.5)]])
    l2 = math.log(2.0)
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), torch.tensor([[-l2]]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), torch.tensor([[0.5 * l2 * l2]]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), torch.tensor([[2.0 - 1.0 - l2]]))
    # k1 sign: positive when the policy puts more mass than the reference on the sample
    assert kl_estimate(ref, lp, "k1").item() > 0


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_zero_at_equality(est):
    lp = torch.randn(3, 5)
    assert torch.equal(kl_estimate(lp, lp.clone(), est), torch.zeros(3, 5))


def test_k3_nonnegative_and_clamped():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(64, 64, generator=g) * 5
    ref = torch.randn(64, 64, generator=g) * 5
    k3 = kl_estimate(lp, ref, "k3", clamp=10.0)
    assert (k3 >= 0).all()
    assert k3.max() <= 10.0
    assert torch.isfinite(kl_estimate(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), "k3")).all()


def test_k1_k3_unbiased_monte_carlo():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g), 0)
    q = torch.softmax(torch.randn(6, generator=g), 0)
    exact = float((p * (p.log() - q.log())).sum())
    y = torch.multinomial(p, 200_000, replacement=True, generator=g)
    lp, lq = p.log()[y][None], q.log()[y][None]
    for est in ("k1", "k3"):
        assert abs(float(kl_estimate(lp, lq, est).mean()) - exact) < 0.01


def test_beta_constant_and_cosine():
    assert kl_beta(KLConfig(beta=0.04), 7, 100) == 0.04
    cfg = KLConfig(beta=0.1, schedule="cosine", beta_end=0.02, warmup_fraction=0.1)
    assert kl_beta(cfg, 0, 100) == 0.0
    assert kl_beta(cfg, 5, 100) == pytest.approx(0.05)
    assert kl_beta(cfg, 10, 100) == pytest.approx(0.1)
    assert kl_beta(cfg, 55, 100) == pytest.approx(0.06)
    assert kl_beta(cfg, 100, 100) == pytest.approx(0.02)
    no_warm = KLConfig(beta=0.1, schedule="cosine", beta_end=0.0)
    assert kl_beta(no_warm, 0, 10) == pytest.approx(0.1)


def test_beta_zero_disables_reference():
    assert not KLConfig(beta=0.0).enabled
    assert KLConfig(beta=0.01).enabled
