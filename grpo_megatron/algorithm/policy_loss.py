"""The GRPO policy loss: clipped surrogate, KL to the reference, TIS, loss aggregation.

Shape legend: B = responses in the (micro-)batch, T = response tokens (padded),
`response_mask_bt` = 1 on response tokens, 0 on padding (float or bool).

Micro-batching. The trainer splits a mini-batch into micro-batches, calls `grpo_policy_loss`
on each and SUMS the returned losses (or calls backward on each). For the sum to equal the
loss of the whole mini-batch, pass the same `normalizer` to every micro-batch: the value
`loss_normalizer(mode, mask)` computed over the mask of the WHOLE mini-batch (i.e. the sum of
`loss_normalizer` over its micro-batches: the total token count for `token-mean`, the total
number of sequences otherwise). With data parallelism the normalizer must count the tokens or
sequences of all DP ranks; if the gradient reduction AVERAGES over the D ranks (megatron's
default), pass (global count) / D so that the averaged gradient equals the gradient of the
global loss. normalizer=None uses the local micro-batch's own count (correct only when the
micro-batch is the whole batch).
"""

from collections.abc import Sequence
from typing import Literal

import torch

from grpo_megatron.algorithm.advantages import token_advantages
from grpo_megatron.algorithm.config import AlgorithmConfig
from grpo_megatron.algorithm.kl import kl_estimate

__all__ = [
    "loss_normalizer",
    "normalizer_of_counts",
    "aggregate_loss",
    "importance_ratio",
    "clipped_surrogate",
    "grpo_policy_loss",
]

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _masked_mean(x_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    return (x_bt * mask_bt).sum() / mask_bt.sum().clamp(min=1.0)


def loss_normalizer(loss_agg_mode: LossAggMode, response_mask_bt: torch.Tensor) -> float:
    """The denominator of `aggregate_loss` for this mask: the number of valid tokens for
    `token-mean`, the number of sequences with at least one valid token for the two
    `seq-mean-*` modes. Sum it over micro-batches (and DP ranks) to get the global value."""
    mask_bt = response_mask_bt.to(torch.float32)
    if loss_agg_mode == "token-mean":
        return float(mask_bt.sum())
    if loss_agg_mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        return float((mask_bt.sum(dim=1) > 0).sum())
    raise ValueError(
        f"algorithm.loss_agg_mode={loss_agg_mode!r} is not one of token-mean, "
        "seq-mean-token-mean, seq-mean-token-sum-norm"
    )


def normalizer_of_counts(loss_agg_mode: LossAggMode, valid_tokens: Sequence[int]) -> float:
    """`loss_normalizer` from each sequence's count of valid tokens alone (what every rank knows of
    the samples other replicas train): their sum for `token-mean`, the sequences with any for the
    `seq-mean-*` modes."""
    if loss_agg_mode == "token-mean":
        return float(sum(valid_tokens))
    if loss_agg_mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        return float(sum(1 for n in valid_tokens if n > 0))
    raise ValueError(
        f"algorithm.loss_agg_mode={loss_agg_mode!r} is not one of token-mean, "
        "seq-mean-token-mean, seq-mean-token-sum-norm"
    )


def aggregate_loss(
    loss_bt: torch.Tensor,
    response_mask_bt: torch.Tensor,
    loss_agg_mode: LossAggMode,
    *,
    normalizer: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce per-token losses l_{i,t} to a scalar. With N = `normalizer` (default: the local
    `loss_normalizer`), |o_i| = valid tokens of sequence i, L = `norm_len`:

    token-mean (DAPO, Yu et al. 2025):                 sum_{i,t} l_{i,t} / N_tokens
    seq-mean-token-mean (GRPO paper, Shao et al. 2024): sum_i (1/|o_i|) sum_t l_{i,t} / N_seqs
    seq-mean-token-sum-norm (Dr.GRPO, Liu et al. 2025): sum_i (1/L) sum_t l_{i,t} / N_seqs
        where L is a constant (the maximum response length), so no response length biases
        the gradient.
    All three are sums over micro-batches when N is the global count (module docstring).
    """
    mask_bt = response_mask_bt.to(loss_bt.dtype)
    if normalizer is None:
        normalizer = loss_normalizer(loss_agg_mode, response_mask_bt)
    denom = max(float(normalizer), 1e-8)
    masked_bt = loss_bt * mask_bt
    if loss_agg_mode == "token-mean":
        return masked_bt.sum() / denom
    if loss_agg_mode == "seq-mean-token-mean":
        seq_len_b = mask_bt.sum(dim=1).clamp(min=1.0)
        return (masked_bt.sum(dim=1) / seq_len_b).sum() / denom
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if norm_len is None or norm_len < 1:
            raise ValueError(
                f"seq-mean-token-sum-norm needs norm_len >= 1 (got {norm_len}): set algorithm.loss_norm_len "
                "or pass the rollout's max_new_tokens"
            )
        return (masked_bt.sum(dim=1) / float(norm_len)).sum() / denom
    raise ValueError(
        f"algorithm.loss_agg_mode={loss_agg_mode!r} is not one of token-mean, "
        "seq-mean-token-mean, seq-mean-token-sum-norm"
    )


def importance_ratio(
    logprobs_bt: torch.Tensor,
    old_logprobs_bt: torch.Tensor,
    response_mask_bt: torch.Tensor,
    ratio_level: Literal["token", "sequence"] = "token",
) -> torch.Tensor:
    """Importance ratio ratio_bt of the current policy to the old (behaviour) policy.

    token (PPO / GRPO):  rho_{i,t} = exp(log pi(y_t) - log pi_old(y_t))
    sequence (GSPO, Zheng et al. 2025, the GSPO-token form):
        s_i = exp( (1/|o_i|) sum_t (log pi(y_t) - log pi_old(y_t)) )   (length-normalized)
        s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]
      Its value is s_i at every token of sequence i, and its gradient is s_i * grad log pi(y_t),
      so with `seq-mean-token-mean` aggregation the loss gradient is exactly GSPO's.
    Padding positions get ratio 1 (they are masked out of every sum anyway).
    """
    mask_bt = response_mask_bt.to(torch.float32)
    log_ratio_bt = (logprobs_bt.float() - old_logprobs_bt.detach().float()) * mask_bt
    if ratio_level == "token":
        return torch.exp(log_ratio_bt)
    if ratio_level == "sequence":
        seq_len_b = mask_bt.sum(dim=1).clamp(min=1.0)
        log_seq_ratio_b = log_ratio_bt.sum(dim=1) / seq_len_b
        logprobs_f_bt = logprobs_bt.float()
        log_ratio_bt = (log_seq_ratio_b.detach()[:, None] + logprobs_f_bt - logprobs_f_bt.detach()) * mask_bt
        return torch.exp(log_ratio_bt)
    raise ValueError(f"algorithm.ratio_level={ratio_level!r} must be 'token' or 'sequence'")


def clipped_surrogate(
    ratio_bt: torch.Tensor,
    advantages_bt: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate loss (to MINIMIZE) with asymmetric clipping:

        l_t = -min(rho_t * A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) * A_t)
    PPO (Schulman et al. 2017) with DAPO's decoupled clip (clip-higher: clip_high > clip_low
    lets low-probability tokens grow, against entropy collapse). Optional dual clip
    (Ye et al. 2020, "Mastering complex control in MOBA games"): for A_t < 0,
        l_t = min(l_t, -dual_clip * A_t)
    which bounds the loss of a very large ratio on a negative-advantage token.

    Returns loss_bt and boolean masks `clipped_low_bt`, `clipped_high_bt`, `dual_clipped_bt`
    marking tokens whose gradient the clip zeroed.
    """
    clipped_ratio_bt = ratio_bt.clamp(1.0 - clip_low, 1.0 + clip_high)
    unclipped_loss_bt = -advantages_bt * ratio_bt
    clipped_loss_bt = -advantages_bt * clipped_ratio_bt
    loss_bt = torch.maximum(unclipped_loss_bt, clipped_loss_bt)
    ratio_d_bt = ratio_bt.detach()
    masks = {
        "clipped_high_bt": (advantages_bt > 0) & (ratio_d_bt > 1.0 + clip_high),
        "clipped_low_bt": (advantages_bt < 0) & (ratio_d_bt < 1.0 - clip_low),
        "dual_clipped_bt": torch.zeros_like(ratio_d_bt, dtype=torch.bool),
    }
    if dual_clip is not None:
        negative_bt = advantages_bt < 0
        dual_loss_bt = -advantages_bt * dual_clip
        loss_bt = torch.where(negative_bt, torch.minimum(loss_bt, dual_loss_bt), loss_bt)
        masks["dual_clipped_bt"] = negative_bt & (ratio_d_bt > dual_clip)
    return loss_bt, masks


def _clip_and_ratio_metrics(
    ratio_bt: torch.Tensor, clip_masks: dict[str, torch.Tensor], mask_bt: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``grpo_policy_loss``'s clip fractions (token means of ``clipped_surrogate``'s masks) and the
    ratio's mean, max and min over the response tokens (1 when there are none)."""
    valid_bt = mask_bt > 0
    ratio_d_bt = ratio_bt.detach()
    has_valid = bool(valid_bt.any())
    low = _masked_mean(clip_masks["clipped_low_bt"].float(), mask_bt)
    high = _masked_mean(clip_masks["clipped_high_bt"].float(), mask_bt)
    return {
        "clip_frac": low + high,
        "clip_frac/low": low,
        "clip_frac/high": high,
        "clip_frac/dual": _masked_mean(clip_masks["dual_clipped_bt"].float(), mask_bt),
        "ratio/mean": _masked_mean(ratio_d_bt, mask_bt),
        "ratio/max": ratio_d_bt[valid_bt].max() if has_valid else ratio_d_bt.new_ones(()),
        "ratio/min": ratio_d_bt[valid_bt].min() if has_valid else ratio_d_bt.new_ones(()),
    }


def grpo_policy_loss(
    logprobs_bt: torch.Tensor,
    old_logprobs_bt: torch.Tensor | None,
    advantages_b: torch.Tensor,
    response_mask_bt: torch.Tensor,
    cfg: AlgorithmConfig,
    *,
    ref_logprobs_bt: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    tis_weights_bt: torch.Tensor | None = None,
    normalizer: float | None = None,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective (DeepSeekMath eq. 3, negated to a loss) with the configured fixes:

        l_{i,t} = w_{i,t} * -min(rho_{i,t} A_i, clip(rho_{i,t}, 1-eps_low, 1+eps_high) A_i)
                  + beta * KL_est(pi || pi_ref)_{i,t}
        loss    = aggregate(l, cfg.loss_agg_mode, normalizer)

    rho: `importance_ratio` at cfg.ratio_level (token: PPO/GRPO; sequence: GSPO).
    clip: `clipped_surrogate` (DAPO clip-higher, optional dual clip).
    w: TIS weights from `mismatch.tis_weights` (Yao et al. 2025) or 1.
    KL_est: `kl.kl_estimate` with cfg.kl.estimator (Schulman's k1/k2/k3); skipped when
      kl_beta == 0 (then `ref_logprobs_bt` may be None: no reference model is needed).
    aggregate: `aggregate_loss`; see the module docstring for `normalizer` under
      micro-batching and data parallelism. `norm_len` defaults to cfg.loss_norm_len.

    old_logprobs_bt=None means a single on-policy update: pi_old = sg[pi] (ratio 1, gradient
    A * grad log pi). Returns (loss, metrics); metrics are detached scalar tensors computed
    over THIS micro-batch (token means unless named otherwise), for logging:
      loss/total, loss/pg, loss/kl      (the last two aggregated with the same normalizer)
      clip_frac, clip_frac/low, clip_frac/high, clip_frac/dual
      ratio/mean, ratio/max, ratio/min, kl (token mean of KL_est), ppo_kl (mean log pi_old - log pi)
      num_tokens, num_seqs
    """
    if logprobs_bt.dim() != 2 or response_mask_bt.shape != logprobs_bt.shape:
        raise ValueError(
            f"logprobs_bt {tuple(logprobs_bt.shape)} and response_mask_bt "
            f"{tuple(response_mask_bt.shape)} must both be [B, T]"
        )
    if advantages_b.shape != logprobs_bt.shape[:1]:
        raise ValueError(
            f"advantages_b {tuple(advantages_b.shape)} must be [B] = {tuple(logprobs_bt.shape[:1])}"
        )
    if old_logprobs_bt is None:
        old_logprobs_bt = logprobs_bt.detach()
    mask_bt = response_mask_bt.to(torch.float32)
    if norm_len is None:
        norm_len = cfg.loss_norm_len

    ratio_bt = importance_ratio(logprobs_bt, old_logprobs_bt, mask_bt, cfg.ratio_level)
    advantages_bt = token_advantages(advantages_b.detach(), mask_bt)
    pg_loss_bt, clip_masks = clipped_surrogate(
        ratio_bt, advantages_bt, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip
    )
    if tis_weights_bt is not None:
        pg_loss_bt = pg_loss_bt * tis_weights_bt.detach().float()

    def agg(x_bt: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(x_bt, mask_bt, cfg.loss_agg_mode, normalizer=normalizer, norm_len=norm_len)

    pg_loss = agg(pg_loss_bt)
    metrics: dict[str, torch.Tensor] = {}
    if kl_beta > 0:
        if ref_logprobs_bt is None:
            raise ValueError(f"kl_beta={kl_beta} > 0 needs ref_logprobs_bt (reference-model logprobs)")
        kl_bt = kl_estimate(logprobs_bt, ref_logprobs_bt, cfg.kl.estimator, cfg.kl.clamp)
        kl_loss = agg(kl_bt)
        loss = pg_loss + kl_beta * kl_loss
        metrics["loss/kl"] = kl_loss.detach()
        metrics["kl"] = _masked_mean(kl_bt.detach(), mask_bt)
    else:
        loss = pg_loss

    metrics.update(
        {
            "loss/total": loss.detach(),
            "loss/pg": pg_loss.detach(),
            **_clip_and_ratio_metrics(ratio_bt, clip_masks, mask_bt),
            "ppo_kl": _masked_mean(old_logprobs_bt.detach().float() - logprobs_bt.detach().float(), mask_bt),
            "num_tokens": mask_bt.sum(),
            "num_seqs": (mask_bt.sum(dim=1) > 0).sum().float(),
        }
    )
    return loss, metrics
