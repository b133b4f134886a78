"""Train/inference mismatch: truncated importance sampling (TIS) and mismatch metrics.

Shape legend: B = responses in the batch, T = response tokens.

The rollout engine (SGLang, or our embedded sampler) and the trainer (megatron-core) compute
different probabilities for the same tokens under the same weights (kernels, precision, MoE
routing). Sampling from pi_rollout while optimizing with pi_old_trainer as the behaviour
policy is then off-policy. Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training", correct it with a truncated importance weight per token:
    w_t = min(pi_old_trainer(y_t) / pi_rollout(y_t), C)
which multiplies the policy-gradient term of the loss (a constant: no gradient through w).
"""

from dataclasses import dataclass

import torch

__all__ = ["tis_weights", "mismatch_metrics", "MismatchSums"]


def _masked_mean(x_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    return (x_bt * mask_bt).sum() / mask_bt.sum().clamp(min=1.0)


def tis_weights(
    old_logprobs_bt: torch.Tensor,
    rollout_logprobs_bt: torch.Tensor,
    response_mask_bt: torch.Tensor,
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights w_bt = min(exp(old_logprobs - rollout_logprobs), cap)
    (TIS, Yao et al. 2025), detached, 0 on padding; plus metrics:
    `tis/weight_mean`, `tis/clip_frac` (fraction of valid tokens where the cap was active).
    """
    mask_bt = response_mask_bt.to(torch.float32)
    log_w_bt = old_logprobs_bt.detach().float() - rollout_logprobs_bt.detach().float()
    # Clamp the exponent: a garbage rollout logprob (e.g. -inf) must not produce inf * 0 = NaN.
    raw_w_bt = torch.exp(log_w_bt.clamp(max=20.0))
    w_bt = raw_w_bt.clamp(max=cap) * mask_bt
    metrics = {
        "tis/weight_mean": _masked_mean(w_bt, mask_bt),
        "tis/clip_frac": _masked_mean((raw_w_bt > cap).float(), mask_bt),
    }
    return w_bt, metrics


@dataclass
class MismatchSums:
    """How far the engine's logprobs are from the trainer's on the same tokens, as sums over the
    valid tokens of a batch, so that micro-batches and data-parallel ranks add up before the mean:
    ``mismatch/logprob_abs_diff`` = abs_diff_sum / tokens, ``mismatch/logprob_abs_diff_max`` = abs_diff_max."""

    abs_diff_sum: torch.Tensor
    """sum of |log pi_trainer - log pi_rollout| over valid tokens."""
    abs_diff_max: torch.Tensor
    """max of the same (0 without valid tokens)."""
    tokens: torch.Tensor
    """number of valid tokens."""


def mismatch_metrics(
    trainer_logprobs_bt: torch.Tensor,
    rollout_logprobs_bt: torch.Tensor,
    response_mask_bt: torch.Tensor,
) -> MismatchSums:
    """|log pi_trainer(y_t) - log pi_rollout(y_t)| over the valid tokens (detached), summed and maxed
    (the difference is clamped to [-20, 20]: a garbage rollout logprob must not make the mean inf)."""
    mask_bt = response_mask_bt.to(torch.float32)
    diff_bt = (trainer_logprobs_bt.detach().float() - rollout_logprobs_bt.detach().float()).clamp(-20.0, 20.0)
    abs_bt = diff_bt.abs() * mask_bt
    return MismatchSums(abs_bt.sum(), abs_bt.max() if abs_bt.numel() else abs_bt.new_zeros(()), mask_bt.sum())
