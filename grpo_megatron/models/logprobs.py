"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Shape legend: B batch, S sequence, V vocabulary, Vt = V / TP (this rank's vocabulary slice).

With tensor parallelism the output layer leaves logits split over the vocabulary: rank r holds
columns [r*Vt, (r+1)*Vt). Gathering ``[B, S, V]`` would cost TP times the memory; instead each
quantity needs only scalars per token reduced over the TP group:

    m      = max_v z_v                          (all-reduce MAX, no gradient needed)
    Z      = sum_v exp(z_v - m)                 (all-reduce SUM)
    lse    = m + log Z
    logp_y = z_y - lse                          (z_y lives on one rank: masked local pick, SUM)
    H      = lse - sum_v p_v z_v,  p_v = exp(z_v - lse)

The sums go through megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward,
identity backward): the loss is replicated over TP, so each rank's gradient is exactly the
gradient with respect to its own slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_sum(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=tp_group)


def vocab_parallel_logprobs(
    logits_bsvt: torch.Tensor,
    labels_bs: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(labels) and optionally the entropy H of softmax(logits / temperature), per token.

    ``logits_bsvt``: this rank's vocabulary slice starting at ``vocab_start``.
    ``vocab_size``: the real (unpadded) vocabulary; padded columns get -inf so they carry no
    probability, as in the HF model and the rollout engine.
    Returns fp32 ``logprobs_bs`` and ``entropy_bs`` (or None).
    """
    logits_bsvt = logits_bsvt.float()
    if temperature != 1.0:
        logits_bsvt = logits_bsvt / temperature
    vt = logits_bsvt.shape[-1]
    if vocab_size is not None and vocab_start + vt > vocab_size:
        pad_v = torch.arange(vocab_start, vocab_start + vt, device=logits_bsvt.device) >= vocab_size
        logits_bsvt = logits_bsvt.masked_fill(pad_v, float("-inf"))

    max_bs = logits_bsvt.detach().amax(dim=-1)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(max_bs, op=dist.ReduceOp.MAX, group=tp_group)
    shifted_bsvt = logits_bsvt - max_bs.unsqueeze(-1)
    exp_bsvt = shifted_bsvt.exp()
    sum_exp_bs = _tp_sum(exp_bsvt.sum(dim=-1), tp_group)
    log_z_bs = sum_exp_bs.log()

    local_labels_bs = labels_bs - vocab_start
    owned_bs = (local_labels_bs >= 0) & (local_labels_bs < vt)
    picked_bs = torch.gather(shifted_bsvt, -1, local_labels_bs.clamp(0, vt - 1).unsqueeze(-1)).squeeze(-1)
    picked_bs = _tp_sum(picked_bs * owned_bs, tp_group)
    logprobs_bs = picked_bs - log_z_bs

    entropy_bs = None
    if with_entropy:
        # -inf * 0 would be NaN at padded columns: their probability is exactly zero.
        finite_bsvt = torch.where(exp_bsvt > 0, shifted_bsvt, torch.zeros_like(shifted_bsvt))
        weighted_bs = _tp_sum((exp_bsvt * finite_bsvt).sum(dim=-1), tp_group)
        entropy_bs = log_z_bs - weighted_bs / sum_exp_bs
    return logprobs_bs, entropy_bs
