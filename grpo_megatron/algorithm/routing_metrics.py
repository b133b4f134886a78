"""MoE routing statistics: small pure tensor functions (no process groups).

Shape legend: T tokens, K experts chosen per token (top-k), E experts, M MoE layers.
"""

from __future__ import annotations

import torch


def route_mismatches(own_tk: torch.Tensor, other_tk: torch.Tensor, valid_t: torch.Tensor) -> torch.Tensor:
    """Number of valid tokens whose expert *sets* differ: ``sum_t valid_t * [sort(own_t) != sort(other_t)]``.
    Engines and trainers list a token's k experts in different orders; only the set routes the token."""
    differs_t = (own_tk.long().sort(-1).values != other_tk.long().sort(-1).values).any(-1)
    return (differs_t & valid_t).sum()


def expert_counts(routes_tk: torch.Tensor, valid_t: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, ``count_e = sum_t valid_t * [e in routes_t]``, shape ``[E]``."""
    ids = routes_tk[valid_t].long().reshape(-1)
    return torch.bincount(ids, minlength=num_experts)[:num_experts].to(torch.float64)


def load_metrics(counts_me: torch.Tensor, *, per_layer: bool) -> dict[str, float]:
    """Expert-load balance from per-layer token counts ``counts_me``:
    ``max_over_mean_m = max_e c_me / mean_e c_me`` (1 = perfectly even; E = everything on one expert)
    and the coefficient of variation ``cv_m = std_e c_me / mean_e c_me`` (population std), averaged
    over the layers that saw tokens (plus the worst layer, and each layer when ``per_layer``)."""
    counts_me = counts_me.to(torch.float64)
    mean_m = counts_me.mean(-1)
    seen_m = mean_m > 0
    if not bool(seen_m.any()):
        return {}
    ratio_m = counts_me.max(-1).values[seen_m] / mean_m[seen_m]
    cv_m = counts_me.std(-1, correction=0)[seen_m] / mean_m[seen_m]
    out = {
        "routing/load_max_over_mean": float(ratio_m.mean()),
        "routing/load_max_over_mean_worst": float(ratio_m.max()),
        "routing/load_cv": float(cv_m.mean()),
    }
    if per_layer:
        for j, m in enumerate(seen_m.nonzero()[:, 0].tolist()):
            out[f"routing/load_max_over_mean/layer{m}"] = float(ratio_m[j])
            out[f"routing/load_cv/layer{m}"] = float(cv_m[j])
    return out
