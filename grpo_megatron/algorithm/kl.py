"""KL divergence to the reference policy: per-token estimators and the beta schedule.

Shape legend: B = responses in the batch, T = response tokens.

The estimators follow John Schulman, "Approximating KL Divergence" (2020): with tokens
sampled from the current policy pi and r = pi_ref(y_t) / pi(y_t),
    k1 = -log r                    unbiased, high variance, can be negative
    k2 = (log r)^2 / 2             biased, low variance, non-negative
    k3 = (r - 1) - log r           unbiased, low variance, non-negative (GRPO eq. 4)
All three are 0 when pi == pi_ref.
"""

import math
from typing import Literal

import torch

from grpo_megatron.algorithm.config import KLConfig

__all__ = ["kl_estimate", "kl_beta"]


def kl_estimate(
    logprobs_bt: torch.Tensor,
    ref_logprobs_bt: torch.Tensor,
    estimator: Literal["k1", "k2", "k3"] = "k3",
    clamp: float = 10.0,
) -> torch.Tensor:
    """Per-token estimate kl_bt of KL(pi || pi_ref) at the sampled tokens (Schulman's note).

    log r = ref_logprobs - logprobs is clamped to [-clamp, clamp] before the estimator (so
    exp cannot overflow) and the estimate itself to [-clamp, clamp] after it: one token that
    the reference finds very unlikely must not dominate the batch loss. Gradients flow into
    `logprobs_bt` (the policy); the reference is treated as a constant.
    """
    if logprobs_bt.shape != ref_logprobs_bt.shape:
        raise ValueError(
            f"logprobs_bt {tuple(logprobs_bt.shape)} and ref_logprobs_bt {tuple(ref_logprobs_bt.shape)} differ"
        )
    log_ratio_bt = (ref_logprobs_bt.detach().float() - logprobs_bt.float()).clamp(-clamp, clamp)
    if estimator == "k1":
        kl_bt = -log_ratio_bt
    elif estimator == "k2":
        kl_bt = 0.5 * log_ratio_bt.square()
    elif estimator == "k3":
        # expm1 keeps (r - 1) accurate when r is close to 1, where k3 is a difference of small numbers.
        kl_bt = torch.expm1(log_ratio_bt) - log_ratio_bt
    else:
        raise ValueError(f"estimator={estimator!r} must be one of k1, k2, k3")
    return kl_bt.clamp(-clamp, clamp)


def kl_beta(cfg: KLConfig, iteration: int, total_iterations: int) -> float:
    """The KL coefficient at `iteration` (0-based) of a run of `total_iterations`.

    constant: beta.
    cosine:   p = iteration / total_iterations, w = warmup_fraction;
              p < w : beta * p / w                                   (linear warm-up from 0)
              p >= w: beta_end + (beta - beta_end) * (1 + cos(pi * (p - w) / (1 - w))) / 2
    A cosine schedule therefore starts at 0 when w > 0, reaches `beta` at the end of the
    warm-up, and decays to `beta_end` at iteration == total_iterations.
    """
    if cfg.schedule == "constant":
        return float(cfg.beta)
    if cfg.schedule != "cosine":
        raise ValueError(f"algorithm.kl.schedule={cfg.schedule!r} must be 'constant' or 'cosine'")
    if total_iterations < 1:
        raise ValueError(f"total_iterations={total_iterations} must be >= 1")
    progress = min(max(iteration / total_iterations, 0.0), 1.0)
    warmup = cfg.warmup_fraction
    if progress < warmup:
        return float(cfg.beta * progress / warmup)
    decay = (progress - warmup) / (1.0 - warmup)
    return float(cfg.beta_end + (cfg.beta - cfg.beta_end) * 0.5 * (1.0 + math.cos(math.pi * decay)))
