"""Policy loss: hand-computed values, clip-higher, dual clip, aggregation modes, micro-batch
additivity, and autograd against the analytic policy gradient of a toy categorical policy."""

import math

import pytest
import torch

from grpo_megatron.algorithm.config import AlgorithmConfig, KLConfig
from grpo_megatron.algorithm.policy_loss import (
    aggregate_loss,
    clipped_surrogate,
    grpo_policy_loss,
    importance_ratio,
    loss_normalizer,
)

# Hand example: two responses, 3 and 2 tokens, A = (+1, -1), ratios per token below.
RATIOS = [[1.0, 1.5, 0.5], [1.0, 0.5, 1.5]]
MASK = [[1, 1, 1], [1, 1, 0]]


def _hand_inputs():
    old_bt = torch.full((2, 3), -1.0)
    lp_bt = old_bt + torch.tensor(RATIOS).log()
    return lp_bt, old_bt, torch.tensor([1.0, -1.0]), torch.tensor(MASK, dtype=torch.bool)


# Per-token losses with clip_low 0.2, clip_high 0.28:
#   A=+1: -min(r, clip(r)) -> r=1: -1, r=1.5: -1.28, r=0.5: -0.5
#   A=-1:  max(r, clip(r)) -> r=1:  1, r=0.5:  0.8
@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (-1 - 1.28 - 0.5 + 1 + 0.8) / 5),
        ("seq-mean-token-mean", ((-1 - 1.28 - 0.5) / 3 + (1 + 0.8) / 2) / 2),
        ("seq-mean-token-sum-norm", ((-1 - 1.28 - 0.5) / 4 + (1 + 0.8) / 4) / 2),
    ],
)
def test_hand_computed_loss_each_mode(mode, expected):
    lp_bt, old_bt, adv_b, mask_bt = _hand_inputs()
    cfg = AlgorithmConfig(clip_low=0.2, clip_high=0.28, loss_agg_mode=mode, loss_norm_len=4)
    loss, metrics = grpo_policy_loss(lp_bt, old_bt, adv_b, mask_bt, cfg)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["clip_frac/high"].item() == pytest.approx(0.2)  # token (0, 1)
    assert metrics["clip_frac/low"].item() == pytest.approx(0.2)  # token (1, 1)
    assert metrics["ratio/max"].item() == pytest.approx(1.5)  # the padded 1.5 is ignored in seq 1
    assert metrics["num_tokens"].item() == 5
    assert not any(v.requires_grad for v in metrics.values())


def test_clip_higher_asymmetry():
    ratio_bt = torch.tensor([[1.25, 0.75]])
    pos_bt = torch.ones(1, 2)
    sym, _ = clipped_surrogate(ratio_bt, pos_bt, clip_low=0.2, clip_high=0.2)
    dapo, _ = clipped_surrogate(ratio_bt, pos_bt, clip_low=0.2, clip_high=0.28)
    # A > 0, r = 1.25: clipped at 1.2 symmetrically, free under clip-higher
    assert sym[0, 0].item() == pytest.approx(-1.2)
    assert dapo[0, 0].item() == pytest.approx(-1.25)
    # the low side is unchanged by clip_high: A < 0, r = 0.75 -> max(0.75, 0.8) = 0.8 in both
    neg_bt = -pos_bt
    sym, m_sym = clipped_surrogate(ratio_bt, neg_bt, clip_low=0.2, clip_high=0.2)
    dapo, m_dapo = clipped_surrogate(ratio_bt, neg_bt, clip_low=0.2, clip_high=0.28)
    assert sym[0, 1].item() == pytest.approx(0.8) and dapo[0, 1].item() == pytest.approx(0.8)
    assert m_sym["clipped_low_bt"][0, 1] and m_dapo["clipped_low_bt"][0, 1]


def test_dual_clip():
    ratio_bt = torch.tensor([[5.0, 5.0]])
    adv_bt = torch.tensor([[-1.0, 1.0]])
    plain, _ = clipped_surrogate(ratio_bt, adv_bt, clip_low=0.2, clip_high=0.2)
    dual, masks = clipped_surrogate(ratio_bt, adv_bt, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert plain[0, 0].item() == pytest.approx(5.0)
    assert dual[0, 0].item() == pytest.approx(3.0)  # bounded at -c * A
    assert dual[0, 1].item() == pytest.approx(-1.2)  # positive advantages are untouched
    assert masks["dual_clipped_bt"].tolist() == [[True, False]]


def test_kl_term_added_with_beta():
    lp_bt, old_bt, adv_b, mask_bt = _hand_inputs()
    ref_bt = lp_bt.detach() - math.log(2.0)  # r = pi_ref / pi = 1/2 everywhere
    cfg = AlgorithmConfig(loss_agg_mode="token-mean", kl=KLConfig(beta=0.1, estimator="k3"))
    base, _ = grpo_policy_loss(lp_bt, old_bt, adv_b, mask_bt, cfg)
    loss, metrics = grpo_policy_loss(lp_bt, old_bt, adv_b, mask_bt, cfg, ref_logprobs_bt=ref_bt, kl_beta=0.1)
    k3 = 0.5 - 1 + math.log(2.0)
    assert metrics["kl"].item() == pytest.approx(k3, abs=1e-6)
    assert loss.item() == pytest.approx(base.item() + 0.1 * k3, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs_bt"):
        grpo_policy_loss(lp_bt, old_bt, adv_b, mask_bt, cfg, kl_beta=0.1)


def test_tis_weights_scale_pg_term():
    lp_bt, old_bt, adv_b, mask_bt = _hand_inputs()
    cfg = AlgorithmConfig(loss_agg_mode="token-mean", clip_high=0.28)
    base, _ = grpo_policy_loss(lp_bt, old_bt, adv_b, mask_bt, cfg)
    loss, _ = grpo_policy_loss(lp_bt, old_bt, adv_b, mask_bt, cfg, tis_weights_bt=torch.full((2, 3), 0.5))
    assert loss.item() == pytest.approx(0.5 * base.item())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batches_sum_to_full_batch(mode, level):
    g = torch.Generator().manual_seed(1)
    B, T = 6, 7
    theta_bt = torch.randn(B, T, generator=g).requires_grad_(True)
    old_bt = theta_bt.detach() + 0.3 * torch.randn(B, T, generator=g)
    ref_bt = theta_bt.detach() + 0.3 * torch.randn(B, T, generator=g)
    adv_b = torch.randn(B, generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 2])
    mask_bt = torch.arange(T)[None] < lengths[:, None]
    cfg = AlgorithmConfig(loss_agg_mode=mode, loss_norm_len=T, ratio_level=level, kl=KLConfig(beta=0.05))
    full, _ = grpo_policy_loss(theta_bt, old_bt, adv_b, mask_bt, cfg, ref_logprobs_bt=ref_bt, kl_beta=0.05)
    (full_grad,) = torch.autograd.grad(full, theta_bt)
    norm = loss_normalizer(mode, mask_bt)
    assert norm == loss_normalizer(mode, mask_bt[:2]) + loss_normalizer(mode, mask_bt[2:])
    total = 0.0
    for sl in (slice(0, 2), slice(2, 6)):
        part, _ = grpo_policy_loss(
            theta_bt[sl],
            old_bt[sl],
            adv_b[sl],
            mask_bt[sl],
            cfg,
            ref_logprobs_bt=ref_bt[sl],
            kl_beta=0.05,
            normalizer=norm,
        )
        total = total + part
    (split_grad,) = torch.autograd.grad(total, theta_bt)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(split_grad, full_grad)


def test_aggregate_requires_norm_len():
    with pytest.raises(ValueError, match="loss_norm_len"):
        aggregate_loss(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm")


# ---- gradients on a toy categorical policy -------------------------------------------------
# pi(y) = softmax(theta)_y over V classes, the same distribution at every position. For a
# per-token loss l(log pi(y)), d l / d theta = (d l / d log pi(y)) * (onehot(y) - pi).

V = 5


def _toy(seed: int, B: int = 6, T: int = 5):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=g)
    probs = torch.softmax(theta, 0)
    y_bt = torch.multinomial(probs, B * T, replacement=True, generator=g).view(B, T)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask_bt = (torch.arange(T)[None] < lengths[:, None]).float()
    adv_b = torch.randn(B, generator=g)
    return theta, y_bt, mask_bt, adv_b, g


def _logprobs(theta, y_bt):
    return torch.log_softmax(theta, 0)[y_bt]


def _analytic_grad(dl_dlogp_bt, y_bt, theta):
    probs = torch.softmax(theta, 0)
    onehot_btv = torch.nn.functional.one_hot(y_bt, V).float()
    return (dl_dlogp_bt[..., None] * (onehot_btv - probs)).sum(dim=(0, 1))


def test_on_policy_gradient_matches_policy_gradient_theorem():
    theta, y_bt, mask_bt, adv_b, _ = _toy(0)
    theta = theta.requires_grad_(True)
    cfg = AlgorithmConfig(loss_agg_mode="token-mean")
    loss, _ = grpo_policy_loss(_logprobs(theta, y_bt), None, adv_b, mask_bt, cfg)
    (grad,) = torch.autograd.grad(loss, theta)
    # on policy: grad = -(1/N) sum_t A_t grad log pi(y_t)
    expected = _analytic_grad(-adv_b[:, None] * mask_bt / mask_bt.sum(), y_bt, theta.detach())
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_off_policy_clipped_gradient_with_kl(mode):
    theta, y_bt, mask_bt, adv_b, g = _toy(1, B=8, T=6)
    theta_old = theta + 0.4 * torch.randn(V, generator=g)
    theta_ref = theta + 0.4 * torch.randn(V, generator=g)
    theta = theta.requires_grad_(True)
    beta, eps_lo, eps_hi = 0.1, 0.1, 0.15
    cfg = AlgorithmConfig(
        clip_low=eps_lo,
        clip_high=eps_hi,
        loss_agg_mode=mode,
        loss_norm_len=6,
        kl=KLConfig(beta=beta, estimator="k3"),
    )
    lp_bt = _logprobs(theta, y_bt)
    old_bt, ref_bt = _logprobs(theta_old, y_bt), _logprobs(theta_ref, y_bt)
    loss, metrics = grpo_policy_loss(lp_bt, old_bt, adv_b, mask_bt, cfg, ref_logprobs_bt=ref_bt, kl_beta=beta)
    (grad,) = torch.autograd.grad(loss, theta)

    lp = lp_bt.detach()
    ratio_bt = torch.exp(lp - old_bt)
    a_bt = adv_b[:, None].expand_as(ratio_bt)
    clipped = ((a_bt > 0) & (ratio_bt > 1 + eps_hi)) | ((a_bt < 0) & (ratio_bt < 1 - eps_lo))
    assert clipped[mask_bt > 0].any() and (~clipped[mask_bt > 0]).any()  # both cases exercised
    d_pg_bt = torch.where(clipped, torch.zeros_like(ratio_bt), -a_bt * ratio_bt)
    d_kl_bt = beta * (1.0 - torch.exp(ref_bt - lp))  # d/dlogpi of (r - 1 - log r), r = pi_ref/pi
    if mode == "token-mean":
        weight_bt = mask_bt / mask_bt.sum()
    elif mode == "seq-mean-token-mean":
        weight_bt = mask_bt / mask_bt.sum(1, keepdim=True) / mask_bt.shape[0]
    else:
        weight_bt = mask_bt / 6 / mask_bt.shape[0]
    expected = _analytic_grad((d_pg_bt + d_kl_bt) * weight_bt, y_bt, theta.detach())
    torch.testing.assert_close(grad, expected)
    assert metrics["clip_frac"].item() == pytest.approx(float(clipped[mask_bt > 0].float().mean()))


def test_gspo_matches_sequence_level_objective():
    theta, y_bt, mask_bt, adv_b, g = _toy(2, B=8, T=6)
    theta_old = theta + 0.2 * torch.randn(V, generator=g)
    eps = 0.03
    cfg = AlgorithmConfig(
        clip_low=eps,
        clip_high=eps,
        ratio_level="sequence",
        loss_agg_mode="seq-mean-token-mean",
        kl=KLConfig(beta=0.0),
    )
    old_bt = _logprobs(theta_old, y_bt)

    theta1 = theta.clone().requires_grad_(True)
    loss, _ = grpo_policy_loss(_logprobs(theta1, y_bt), old_bt, adv_b, mask_bt, cfg)
    (grad,) = torch.autograd.grad(loss, theta1)

    # GSPO as written in the paper: s_i = exp(mean_t(log pi - log pi_old)), sequence-level clip
    theta2 = theta.clone().requires_grad_(True)
    log_s_b = ((_logprobs(theta2, y_bt) - old_bt) * mask_bt).sum(1) / mask_bt.sum(1)
    s_b = log_s_b.exp()
    assert ((s_b - 1).abs() > eps).any() and ((s_b - 1).abs() < eps).any()
    ref_loss = -torch.minimum(s_b * adv_b, s_b.clamp(1 - eps, 1 + eps) * adv_b).mean()
    (ref_grad,) = torch.autograd.grad(ref_loss, theta2)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)


def test_sequence_ratio_value_is_constant_per_sequence():
    lp_bt = torch.tensor([[-1.0, -2.0, -3.0]])
    old_bt = torch.tensor([[-1.5, -2.0, -9.0]])
    mask_bt = torch.tensor([[1.0, 1.0, 0.0]])
    r_bt = importance_ratio(lp_bt, old_bt, mask_bt, "sequence")
    assert r_bt[0, 0].item() == pytest.approx(math.exp(0.25))
    assert r_bt[0, 1].item() == pytest.approx(math.exp(0.25))
