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

import torch

__all__ = ["tis_weights", "mismatch_metrics"]


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


def mismatch_metrics(
    trainer_logprobs_bt: torch.Tensor,
    rollout_logprobs_bt: torch.Tensor,
    response_mask_bt: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """How far the engine's logprobs are from the trainer's on the same tokens (detached):
      mismatch/logprob_abs_diff      mean |log pi_trainer - log pi_rollout| over valid tokens
      mismatch/logprob_abs_diff_max  max of the same
      mismatch/kl_k3                 mean k3 estimate of KL(pi_rollout || pi_trainer) from the
                                     rollout's own samples: r - 1 - log r, r = pi_trainer/pi_rollout
      mismatch/prob_diff             mean |pi_trainer - pi_rollout| (in probability space)
    """
    mask_bt = response_mask_bt.to(torch.float32)
    valid_bt = mask_bt > 0
    diff_bt = (trainer_logprobs_bt.detach().float() - rollout_logprobs_bt.detach().float()).clamp(-20.0, 20.0)
    abs_bt = diff_bt.abs()
    max_abs = abs_bt[valid_bt].max() if bool(valid_bt.any()) else abs_bt.new_zeros(())
    prob_diff_bt = (trainer_logprobs_bt.detach().float().exp() - rollout_logprobs_bt.detach().float().exp()).abs()
    return {
        "mismatch/logprob_abs_diff": _masked_mean(abs_bt, mask_bt),
        "mismatch/logprob_abs_diff_max": max_abs,
        "mismatch/kl_k3": _masked_mean(torch.expm1(diff_bt) - diff_bt, mask_bt),
        "mismatch/prob_diff": _masked_mean(prob_diff_bt, mask_bt),
    }
