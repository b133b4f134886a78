"""Sampling truncation (top-k, top-p, min-p) on both sides of the importance ratio.

Shape legend: R rows (tokens), V the whole vocabulary.

An engine that samples from a truncated distribution samples from

    q(y) = p(y) 1[y in S] / sum_{v in S} p(v),        p = softmax(logits / T)

where the kept set S (``keep_mask``) is, applied in this order to the tempered logits:

    top-k  (k > 0):  the k largest logits (ties at the k-th kept);
    top-p  (p < 1):  in order of probability (renormalised over what top-k kept), every token whose
                     preceding mass is below p (the first always stays: Holtzman et al. 2020);
    min-p  (m > 0):  tokens with p(v) >= m * max_v p(v) (Nguyen et al. 2024), of what remains.

Its behaviour logprob is ``log q(y) = z_y - logsumexp_{v in S} z_v`` (``truncated_logprobs``), not the
full distribution's ``log p(y)``: the ratio pi_theta / pi_behaviour of the off-policy corrections
and of the clipped surrogate is then ``q_theta(y) / q_behaviour(y)`` with the trainer's q over the
kept set its own logits give (the same rule at the trainer's weights): the correction issue 53 asks
for (TRL v1.17's unbiased importance sampling under top-k/p). Without truncation (k <= 0, p = 1,
m = 0) ``S`` is the whole vocabulary and ``log q = log p``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the rollout section names Truncation, and the CLI's help imports no torch
    import torch


@dataclass(frozen=True)
class Truncation:
    """What a sampler keeps of the tempered distribution (``SamplingParams``' and the rollout's)."""

    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def keep_mask(z_rv: torch.Tensor, t: Truncation) -> torch.Tensor:
    """Which tokens of each row ``t`` keeps (module docstring), from tempered fp32 logits ``[R, V]``
    (-inf where a token is impossible, e.g. vocabulary padding)."""
    import torch

    keep_rv = torch.isfinite(z_rv)
    if t.top_k > 0 and t.top_k < z_rv.shape[-1]:
        kth_r1 = torch.topk(z_rv, t.top_k, dim=-1).values[:, -1:]
        keep_rv &= z_rv >= kth_r1
    if t.top_p < 1.0:
        kept_rv = z_rv.masked_fill(~keep_rv, float("-inf"))
        sorted_rv, order_rv = torch.sort(kept_rv, dim=-1, descending=True)
        probs_rv = torch.softmax(sorted_rv, dim=-1)
        drop_sorted_rv = (probs_rv.cumsum(dim=-1) - probs_rv) >= t.top_p
        keep_rv &= ~drop_sorted_rv.scatter(-1, order_rv, drop_sorted_rv)
    if t.min_p > 0.0:
        probs_rv = torch.softmax(z_rv.masked_fill(~keep_rv, float("-inf")), dim=-1)
        keep_rv &= probs_rv >= t.min_p * probs_rv.max(dim=-1, keepdim=True).values
    return keep_rv


def truncated_logprobs(z_rv: torch.Tensor, labels_r: torch.Tensor, t: Truncation) -> torch.Tensor:
    """``log q(label)`` of each row (module docstring) from tempered fp32 logits ``[R, V]``;
    differentiable in ``z_rv`` (the kept set is a constant); -inf for a label outside the kept set."""
    import torch

    with torch.no_grad():
        keep_rv = keep_mask(z_rv, t)
    lse_r = torch.logsumexp(z_rv.masked_fill(~keep_rv, float("-inf")), dim=-1)
    picked_r = z_rv.gather(-1, labels_r[:, None])[:, 0]
    kept_r = keep_rv.gather(-1, labels_r[:, None])[:, 0]
    return torch.where(kept_r, picked_r - lse_r, torch.full_like(lse_r, float("-inf")))
