"""Off-policy corrections: weights on the policy-gradient term for samples drawn by another policy.

Shape legend: B = responses in the batch, T = response tokens.

The behaviour policy that sampled a response is the rollout engine's, pi_rollout: in the
synchronous loop it differs from the trainer's pi_old only by the train/engine mismatch (kernels,
precision, MoE routing); in the asynchronous loop (train.max_staleness > 0) it is also up to N
weight versions older. Each correction turns the per-token log ratio

    log r_{i,t} = log pi_old_trainer(y_{i,t}) - log pi_rollout(y_{i,t})

into a constant weight w_{i,t} (no gradient through it) that multiplies the token's policy-gradient
loss (``policy_loss.grpo_policy_loss``'s ``tis_weights_bt``). With max_staleness 0 every r is 1 up to
the mismatch, so every weight is 1 up to it too. Token-level TIS is ``mismatch.tis_weights``.

The sequence ratio is either the product of the token ratios, rho_i = exp(sum_t log r_{i,t})
(the importance ratio of the whole response), or their geometric mean,
rho_i = exp(mean_t log r_{i,t}) (length-normalised: a long response's product drifts far from 1
even when every token is close to it).

A weight of 0 (MIS, IcePop outside their band) removes the token's policy gradient, not the token:
it stays in the loss normaliser (token-mean: sum_{i,t} w l / sum_i |y_i| over every sampled token), as
in IcePop's and Seq-MIS's estimators; verl's rejection renormalises over the survivors instead
(docs/algorithm.md, "Rejected tokens stay in the normaliser").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["sequence_log_ratio", "seq_tis_weights", "mis_weights", "icepop_weights", "OffPolicyStats"]

# exp of a log ratio above this is inf in fp32; clamping keeps garbage logprobs (-inf) from making NaN.
_MAX_LOG = 20.0


def sequence_log_ratio(log_ratio_bt: torch.Tensor, mask_bt: torch.Tensor, geometric: bool) -> torch.Tensor:
    """log rho_b = sum_t log r_{b,t} (``geometric``: divided by the response's token count); 0 for
    an empty response."""
    mask = mask_bt.float()
    total_b = (log_ratio_bt.float() * mask).sum(dim=1)
    return total_b / mask.sum(dim=1).clamp(min=1.0) if geometric else total_b


def seq_tis_weights(
    log_ratio_bt: torch.Tensor, mask_bt: torch.Tensor, cap: float, geometric: bool
) -> torch.Tensor:
    """Sequence-level truncated importance sampling: every token of response i gets

        w_i = min(rho_i, C)

    (Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch", sequence-level TIS; the token-level form is Yao et al. 2025).
    Returns ``[B, T]`` weights, 0 on padding."""
    log_rho_b = sequence_log_ratio(log_ratio_bt, mask_bt, geometric)
    w_b = torch.exp(log_rho_b.clamp(max=_MAX_LOG)).clamp(max=cap)
    return w_b[:, None] * mask_bt.float()


def mis_weights(
    log_ratio_bt: torch.Tensor, mask_bt: torch.Tensor, low: float, high: float, geometric: bool
) -> torch.Tensor:
    """Masked importance sampling (sequence level): a response whose ratio leaves the band is dropped,
    the others keep their importance weight:

        w_i = rho_i * 1[low <= rho_i <= high]

    (Liu, Li et al. 2025, "When Speed Kills Stability", Seq-MIS: rejecting the sequences whose ratio
    is out of range removes the biased tail that truncation keeps). Returns ``[B, T]``, 0 on padding."""
    log_rho_b = sequence_log_ratio(log_ratio_bt, mask_bt, geometric)
    rho_b = torch.exp(log_rho_b.clamp(max=_MAX_LOG))
    keep_b = (rho_b >= low) & (rho_b <= high)
    return (rho_b * keep_b)[:, None] * mask_bt.float()


def icepop_weights(
    log_ratio_bt: torch.Tensor, mask_bt: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """IcePop (token level): a token whose train/rollout ratio leaves the band contributes no gradient,
    the others keep their importance weight:

        w_{i,t} = r_{i,t} * 1[low <= r_{i,t} <= high]

    (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
    Model" (Ring-1T), IcePop's masked, calibrated gradient; they used [0.5, 5]). Returns ``[B, T]``,
    0 on padding."""
    r_bt = torch.exp(log_ratio_bt.float().clamp(max=_MAX_LOG))
    keep_bt = (r_bt >= low) & (r_bt <= high)
    return r_bt * keep_bt * mask_bt.float()


@dataclass
class OffPolicyStats:
    """Token-mean statistics of one micro-batch (``off_policy/*`` metrics): the token ratio r's mean,
    max and min, the weight's mean, and the fraction of tokens whose weight a mask zeroed."""

    ratio_mean: torch.Tensor
    ratio_max: torch.Tensor
    ratio_min: torch.Tensor
    weight_mean: torch.Tensor
    masked_frac: torch.Tensor

    @classmethod
    def of(
        cls, log_ratio_bt: torch.Tensor, weights_bt: torch.Tensor | None, mask_bt: torch.Tensor
    ) -> OffPolicyStats:
        valid_bt = mask_bt > 0
        n = mask_bt.float().sum().clamp(min=1.0)
        r_bt = torch.exp(log_ratio_bt.detach().float().clamp(max=_MAX_LOG))
        one = r_bt.new_ones(())
        w_bt = weights_bt.float() if weights_bt is not None else valid_bt.float()
        return cls(
            ratio_mean=(r_bt * valid_bt).sum() / n,
            ratio_max=r_bt[valid_bt].max() if bool(valid_bt.any()) else one,
            ratio_min=r_bt[valid_bt].min() if bool(valid_bt.any()) else one,
            weight_mean=(w_bt * valid_bt).sum() / n,
            masked_frac=((w_bt == 0) & valid_bt).float().sum() / n,
        )
