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


# ----------------------------------------------------------------------------------------------------
# train.old_logprobs=engine: the surrogate's ratio already is pi_theta / pi_rollout (issue 36, item 10)

ENGINE_CASES = [
    ("algorithm.tis.enabled=true", "algorithm.tis.enabled"),
    ("algorithm.off_policy.correction=seq_tis", "algorithm.off_policy.correction=seq_tis"),
    ("algorithm.off_policy.correction=mis", "algorithm.off_policy.correction=mis"),
    ("algorithm.off_policy.correction=icepop", "algorithm.off_policy.correction=icepop"),
]


@pytest.mark.parametrize(("override", "named"), ENGINE_CASES)
def test_validation_refuses_a_correction_on_top_of_engine_old_logprobs_naming_the_fix(override, named):
    from grpo_megatron.config import ConfigError, load_config, validate
    from tests.helpers.tiny_configs import EXAMPLE

    with pytest.raises(ConfigError) as exc:
        validate(load_config(EXAMPLE, ["train.old_logprobs=engine", override]), world_size=1)
    (error,) = [e for e in exc.value.errors if "train.old_logprobs=engine" in e]
    assert named in error and "algorithm.tis.enabled=false" in error and "train.old_logprobs=trainer" in error
    validate(load_config(EXAMPLE, ["train.old_logprobs=trainer", override]), world_size=1)  # the fix: fine
    validate(load_config(EXAMPLE, ["train.old_logprobs=engine"]), world_size=1)  # and the other fix


def _engine_mode_batch():
    """Two responses (3 and 2 tokens) whose trainer logprobs lie above and below the engine's, one
    positive and one negative advantage; laid out and collated as the train phase does."""
    from grpo_megatron.training.batching import collate, make_samples

    rollout = [[-1.2, -0.4, -2.0], [-0.3, -1.5]]
    trainer = [[-0.6, -0.5, -1.1], [-0.9, -0.7]]  # per-token r = exp(trainer - rollout)
    samples = make_samples([[5, 6], [7, 8, 9]], [[1, 2, 3], [4, 5]], rollout, [-1.0, 0.5])
    mb = collate(samples, [0, 1], pad_id=0)
    logprobs_bs = torch.zeros(mb.labels_bs.shape)
    logprobs_bs[0, 1:4] = torch.tensor(trainer[0])
    logprobs_bs[1, 2:4] = torch.tensor(trainer[1])
    return mb, logprobs_bs.requires_grad_(True), rollout, trainer, [-1.0, 0.5]


def _reference_token_mean(rollout, trainer, advantages, eps=0.2):
    """-min(r A, clip(r, 1-eps, 1+eps) A) averaged over the response tokens, r = pi_theta / pi_rollout
    (PPO's surrogate with the engine as pi_old: nothing else weighs it), and d loss / d log pi_theta."""
    losses, grads = [], []
    for rs, ts, a in zip(rollout, trainer, advantages, strict=True):
        for lr, lt in zip(rs, ts, strict=True):
            r = math.exp(lt - lr)
            unclipped, clipped = r * a, min(max(r, 1 - eps), 1 + eps) * a
            losses.append(-min(unclipped, clipped))
            grads.append(-r * a if unclipped <= clipped else 0.0)  # the clipped branch has no gradient
    return sum(losses) / len(losses), [g / len(grads) for g in grads]


def test_engine_old_logprobs_loss_is_the_uncorrected_surrogate_and_tis_would_count_it_twice():
    from grpo_megatron.algorithm.config import TISConfig
    from grpo_megatron.algorithm.policy_loss import grpo_policy_loss
    from grpo_megatron.training.phases.train import GRPOLoss

    alg = AlgorithmConfig(loss_agg_mode="token-mean")
    mb, logprobs_bs, rollout, trainer, advantages = _engine_mode_batch()
    want_loss, want_grads = _reference_token_mean(rollout, trainer, advantages)
    loss, metrics = GRPOLoss(alg, 0.0, 8, old_from_engine=True).loss_fn(normalizer=5.0)(logprobs_bs, None, mb)
    loss.backward()
    assert math.isclose(float(loss.detach()), want_loss, rel_tol=1e-6), (float(loss.detach()), want_loss)
    got_grads = [float(g) for g in logprobs_bs.grad[mb.extras["mask_bs"] > 0]]
    assert got_grads == pytest.approx(want_grads, rel=1e-5, abs=1e-7)
    assert float(metrics["off_policy/weight_mean"]) == pytest.approx(5.0)  # every weight 1 (5 tokens' sum)

    # What the same inputs gave before the refusal: TIS weights min(pi_theta/pi_rollout, 2) from the
    # very ratio the surrogate already applies, so each token's gradient weight became r * min(r, 2).
    tis = AlgorithmConfig(loss_agg_mode="token-mean", tis=TISConfig(enabled=True, cap=2.0))
    mask_bs, rollout_bs = mb.extras["mask_bs"], mb.extras["rollout_logprobs_bs"]
    w_bs = off_policy_weights(tis, logprobs_bs.detach(), rollout_bs, mask_bs)
    twice, _ = grpo_policy_loss(
        logprobs_bs, rollout_bs, mb.extras["advantages_b"], mask_bs, tis, tis_weights_bt=w_bs, normalizer=5.0
    )
    print(
        f"token-mean loss, engine old logprobs: uncorrected {want_loss:.4f}, "
        f"TIS cap 2 on top {float(twice.detach()):.4f}"
    )
    assert abs(float(twice.detach()) - want_loss) > 0.05
    with pytest.raises(ValueError, match="counts the ratio twice"):
        GRPOLoss(tis, 0.0, 8, old_from_engine=True)


@pytest.mark.parametrize("correction", ["icepop", "mis"])
def test_rejected_tokens_stay_in_the_token_mean_denominator(correction):
    """Issue 51 item 9, the choice made: a token (IcePop) or response (MIS) the band rejects contributes
    no policy gradient but still counts in the token-mean normaliser, as in the papers' estimators
    (IcePop: 1 / sum_i |y_i| over every token, Ring-1T; Seq-MIS: the mean over every sampled response),
    not verl's rejection, which takes it out of the response mask and so renormalises over the
    survivors. Here: loss = sum over kept tokens of w * l / (all 5 response tokens)."""
    from grpo_megatron.algorithm.policy_loss import grpo_policy_loss

    alg = AlgorithmConfig(
        loss_agg_mode="token-mean", off_policy=OffPolicyConfig(correction=correction, low=0.5, high=2.0)
    )
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.5, 0.0]], requires_grad=True)
    rollout = logprobs.detach() - LOG_R  # pi_old (= sg pi: one update) / pi_rollout = e^LOG_R
    advantages = torch.tensor([1.0, -2.0])
    w = off_policy_weights(alg, logprobs.detach(), rollout, MASK)
    assert w is not None and bool(((w == 0) & (MASK > 0)).any())  # something is rejected
    loss, _ = grpo_policy_loss(logprobs, None, advantages, MASK, alg, tis_weights_bt=w)
    # one update: ratio 1, per-token loss -A_i; the denominator is every response token (5)
    want = -(w * advantages[:, None] * MASK).sum() / MASK.sum()
    assert torch.allclose(loss, want), (loss, want)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.allclose(grad, -(w * advantages[:, None]) / MASK.sum())  # rejected: 0; kept: not rescaled
