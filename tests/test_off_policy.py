"""Off-policy corrections (algorithm/off_policy.py) against their formulas, their config checks, and
the loss weights the train phase picks from algorithm.tis / algorithm.off_policy."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_megatron.algorithm.config import AlgorithmConfig, OffPolicyConfig
from grpo_megatron.algorithm.off_policy import (
    OffPolicyStats,
    icepop_weights,
    mis_weights,
    seq_tis_weights,
    sequence_log_ratio,
)
from grpo_megatron.training.phases.train import off_policy_weights

# Two responses: 3 tokens and 2 tokens (one padding position).
LOG_R = torch.tensor([[0.1, -0.3, 0.5], [1.0, 0.2, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_sequence_ratio_is_the_product_or_the_geometric_mean_of_token_ratios():
    prod = sequence_log_ratio(LOG_R, MASK, geometric=False)
    geo = sequence_log_ratio(LOG_R, MASK, geometric=True)
    assert torch.allclose(prod, torch.tensor([0.3, 1.2]))
    assert torch.allclose(geo, torch.tensor([0.1, 0.6]))


def test_seq_tis_is_min_of_rho_and_cap_on_every_token():
    w = seq_tis_weights(LOG_R, MASK, cap=2.0, geometric=False)
    rho = [math.exp(0.3), math.exp(1.2)]
    want = torch.tensor([[min(rho[0], 2)] * 3, [min(rho[1], 2)] * 2 + [0.0]])
    assert torch.allclose(w, want)


def test_mis_drops_sequences_outside_the_band_and_keeps_rho_inside():
    w = mis_weights(LOG_R, MASK, low=0.5, high=2.0, geometric=False)
    want = torch.tensor([[math.exp(0.3)] * 3, [0.0, 0.0, 0.0]])  # rho_1 = e^1.2 = 3.3 > 2: dropped
    assert torch.allclose(w, want)
    w_geo = mis_weights(LOG_R, MASK, low=0.5, high=2.0, geometric=True)
    assert torch.allclose(w_geo[1, :2], torch.full((2,), math.exp(0.6)))  # e^0.6 = 1.8: kept


def test_icepop_masks_tokens_outside_the_band_and_weights_the_rest_by_their_ratio():
    w = icepop_weights(LOG_R, MASK, low=0.5, high=2.0)
    r = LOG_R.exp()
    keep = (r >= 0.5) & (r <= 2.0) & (MASK > 0)
    assert torch.allclose(w, r * keep)
    assert w[1, 0] == 0 and w[1, 2] == 0 and w[0, 1] > 0  # e^1 out of band; padding; e^-0.3 in band


def test_stats_give_ratio_extremes_and_the_masked_fraction():
    w = icepop_weights(LOG_R, MASK, low=0.5, high=2.0)
    s = OffPolicyStats.of(LOG_R, w, MASK)
    r = LOG_R.exp()[MASK > 0]
    assert math.isclose(float(s.ratio_max), float(r.max()), rel_tol=1e-6)
    assert math.isclose(float(s.ratio_min), float(r.min()), rel_tol=1e-6)
    assert math.isclose(float(s.ratio_mean), float(r.mean()), rel_tol=1e-6)
    assert math.isclose(float(s.masked_frac), 1 / 5, rel_tol=1e-6)  # one valid token of five is out of band


@pytest.mark.parametrize("correction", ["none", "seq_tis", "mis", "icepop"])
def test_on_policy_weights_are_one(correction):
    # max_staleness 0 without mismatch: pi_old_trainer == pi_rollout, every weight 1 (0 on padding).
    alg = AlgorithmConfig(off_policy=OffPolicyConfig(correction=correction))
    logp = torch.randn(2, 3)
    w = off_policy_weights(alg, logp, logp.clone(), MASK)
    assert w is None if correction == "none" else torch.equal(w, MASK)


def test_the_config_refuses_bad_bands_and_two_corrections_naming_the_field():
    with pytest.raises(ValueError, match="algorithm.off_policy.low"):
        AlgorithmConfig(off_policy=OffPolicyConfig(low=1.5)).validate()
    with pytest.raises(ValueError, match="algorithm.off_policy.cap"):
        AlgorithmConfig(off_policy=OffPolicyConfig(cap=0.5)).validate()
    alg = AlgorithmConfig(off_policy=OffPolicyConfig(correction="mis"))
    alg.tis.enabled = True
    with pytest.raises(ValueError, match="algorithm.tis.enabled"):
        alg.validate()
