"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Shape legend: B batch, S sequence, V vocabulary, Vt = V / TP (this rank's vocabulary slice).

With tensor parallelism the output layer leaves logits split over the vocabulary: rank r holds
columns [r*Vt, (r+1)*Vt). Gathering ``[B, S, V]`` would cost TP times the memory; instead each
quantity needs only scalars per token reduced over the TP group:

    l_r    = logsumexp of rank r's slice         (one fused local pass)
    m      = max_r l_r                          (all-reduce MAX)
    lse    = m + log sum_r exp(l_r - m)         (all-reduce SUM)
    logp_y = z_y - lse                          (z_y lives on one rank: masked local pick, SUM)
    H      = lse - sum_v p_v z_v,  p_v = exp(z_v - lse)

logp_y has a hand-written backward (``_VocabParallelLogprob``: onehot - softmax, built in place).

The entropy's sums go through megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward,
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


def _tp_max_(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp_group)
    return x


def _tp_sum_(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(x, group=tp_group)
    return x


class _VocabParallelLogprob(torch.autograd.Function):
    """log p(label) = z_label - lse with a hand-written backward: d logp / dz = onehot - softmax(z).

    Autograd through logsumexp + gather would materialise three [B, S, Vt] tensors in backward
    (softmax, the scattered one-hot, their sum); this builds one, in place. No communication in
    backward: each rank's slice needs only the global lse saved from forward.
    """

    @staticmethod
    def forward(ctx, logits_bsvt, labels_bs, vocab_start, tp_group):
        vt = logits_bsvt.shape[-1]
        # One fused logsumexp per rank; ranks combine as lse = m + log sum_r exp(l_r - m).
        local_lse_bs = torch.logsumexp(logits_bsvt, dim=-1)
        max_bs = _tp_max_(local_lse_bs.clone(), tp_group)
        lse_bs = max_bs + _tp_sum_((local_lse_bs - max_bs).exp(), tp_group).log()
        local_labels_bs = labels_bs - vocab_start
        owned_bs = (local_labels_bs >= 0) & (local_labels_bs < vt)
        local_labels_bs = local_labels_bs.clamp(0, vt - 1)
        picked_bs = torch.gather(logits_bsvt, -1, local_labels_bs.unsqueeze(-1)).squeeze(-1)
        logprobs_bs = _tp_sum_(picked_bs * owned_bs, tp_group) - lse_bs
        ctx.save_for_backward(logits_bsvt, lse_bs, local_labels_bs, owned_bs)
        ctx.mark_non_differentiable(lse_bs)
        return logprobs_bs, lse_bs

    @staticmethod
    def backward(ctx, grad_logprobs_bs, _grad_lse_bs):
        logits_bsvt, lse_bs, local_labels_bs, owned_bs = ctx.saved_tensors
        grad_bsvt = (logits_bsvt - lse_bs.unsqueeze(-1)).exp_().mul_(-grad_logprobs_bs.unsqueeze(-1))
        grad_bsvt.scatter_add_(-1, local_labels_bs.unsqueeze(-1), (grad_logprobs_bs * owned_bs).unsqueeze(-1))
        return grad_bsvt, None, None, None


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

    logprobs_bs, lse_bs = _VocabParallelLogprob.apply(logits_bsvt, labels_bs, vocab_start, tp_group)

    entropy_bs = None
    if with_entropy:
        # With c = lse held constant, e = exp(z - c) and Z = sum e (= 1 up to rounding, but it
        # carries the gradient): H = c + log Z - sum(e * z) / Z.
        exp_bsvt = (logits_bsvt - lse_bs.unsqueeze(-1)).exp()
        # -inf * 0 would be NaN at padded columns: their probability is exactly zero.
        finite_bsvt = logits_bsvt.masked_fill(exp_bsvt == 0, 0.0)
        z_bs = _tp_sum(exp_bsvt.sum(dim=-1), tp_group)
        entropy_bs = lse_bs + z_bs.log() - _tp_sum((exp_bsvt * finite_bsvt).sum(dim=-1), tp_group) / z_bs
    return logprobs_bs, entropy_bs
