"""Group-relative advantages (GRPO, Dr.GRPO, RLOO).

Shape legend: B = responses in the batch (num_prompts * G), P = prompts, G = responses per
prompt (the group), T = response tokens. The G responses of one prompt are contiguous, so a
reward vector `rewards_b` reshapes to `rewards_pg = rewards_b.view(P, G)`.
"""

from typing import Literal

import torch

from grpo_megatron.algorithm.config import AlgorithmConfig

__all__ = ["group_advantages", "advantages_from_config", "token_advantages"]


def group_advantages(
    rewards_b: torch.Tensor,
    group_size: int,
    *,
    estimator: Literal["grpo", "rloo"] = "grpo",
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Outcome advantage of each response relative to its group.

    `grpo` (DeepSeekMath, Shao et al. 2024, outcome supervision):
        A_i = (r_i - mean(r_g)) / (std(r_g) + eps)
    `grpo` with norm_by_std=False (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-like
    training"): A_i = r_i - mean(r_g)   (no std division: it biases toward easy/hard prompts)
    `rloo` (Ahmadian et al. 2024, leave-one-out baseline):
        A_i = r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) * (r_i - mean(r_g))
        optionally divided by (std(r_g) + eps) as well when norm_by_std=True.

    std is the unbiased (Bessel-corrected) sample std over the G rewards, as torch.std computes
    it. A group whose rewards are all equal (or G = 1) gets exactly zero advantages, never NaN:
    this is forced explicitly, because the float mean of equal non-dyadic rewards (e.g. 0.1)
    can differ from them by an ulp, which eps alone would amplify to a spurious advantage.

    Returns advantages_b (float32, same device), detached from any graph.
    """
    if rewards_b.dim() != 1:
        raise ValueError(f"rewards_b must be 1-D [B], got shape {tuple(rewards_b.shape)}")
    if group_size < 1 or rewards_b.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the number of rewards {rewards_b.numel()}: "
            "the G responses of each prompt must be contiguous"
        )
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"estimator={estimator!r} must be 'grpo' or 'rloo'")
    rewards_pg = rewards_b.detach().to(torch.float32).view(-1, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards_b, dtype=torch.float32)

    mean_p1 = rewards_pg.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        adv_pg = rewards_pg - mean_p1
    else:
        others_mean_pg = (rewards_pg.sum(dim=1, keepdim=True) - rewards_pg) / (group_size - 1)
        adv_pg = rewards_pg - others_mean_pg
    if norm_by_std:
        std_p1 = rewards_pg.std(dim=1, keepdim=True)
        adv_pg = adv_pg / (std_p1 + eps)
    all_equal_p1 = rewards_pg.amax(dim=1, keepdim=True) == rewards_pg.amin(dim=1, keepdim=True)
    adv_pg = torch.where(all_equal_p1, torch.zeros_like(adv_pg), adv_pg)
    return adv_pg.reshape(-1)


def advantages_from_config(rewards_b: torch.Tensor, group_size: int, cfg: AlgorithmConfig) -> torch.Tensor:
    """`group_advantages` with cfg.advantage_estimator, cfg.norm_adv_by_std and cfg.adv_eps."""
    return group_advantages(
        rewards_b,
        group_size,
        estimator=cfg.advantage_estimator,
        norm_by_std=cfg.norm_adv_by_std,
        eps=cfg.adv_eps,
    )


def token_advantages(advantages_b: torch.Tensor, response_mask_bt: torch.Tensor) -> torch.Tensor:
    """Broadcast outcome advantages to every response token: A_{i,t} = A_i on valid tokens,
    0 on padding (GRPO outcome supervision gives all tokens of a response the same advantage)."""
    return advantages_b[:, None].to(torch.float32) * response_mask_bt.to(torch.float32)
