"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Shape legend: B batch, S sequence, V vocabulary, Vt = V / TP (this rank's vocabulary slice),
C a chunk of tokens.

With tensor parallelism the output layer leaves logits split over the vocabulary: rank r holds
columns [r*Vt, (r+1)*Vt). Gathering ``[B, S, V]`` would cost TP times the memory; instead each
quantity needs only scalars per token reduced over the TP group. With z = logits / T:

    l_r    = logsumexp of rank r's slice                   (local; -inf for a slice of padding only)
    s_r    = sum_{v in r} exp(z_v - l_r) z_v               (local, for the entropy)
    m      = max_r l_r                                    (all-reduce MAX)
    lse    = m + log sum_r exp(l_r - m)                   (all-reduce SUM)
    logp_y = z_y - lse                                    (z_y lives on one rank: masked local pick, SUM)
    E[z]   = sum_r exp(l_r - lse) s_r                     (all-reduce SUM)
    H      = lse - E[z]

and backward needs no communication: with p_v = exp(z_v - lse), for this rank's columns

    d logp_y / d logits_v = (onehot_y(v) - p_v) / T
    d H / d logits_v      = p_v (E[z] - z_v) / T

Memory: one autograd node (``_VocabParallelLogprobEntropy``) keeps only the logits it was given
(no fp32 copy of them when they are bf16) and per-token scalars. Forward and backward walk the
tokens in chunks of at most ``CHUNK_ELEMENTS`` logits, each upcast to fp32 on its own, so the
fp32 working set is a few chunks, not copies of ``[B, S, Vt]``; backward writes the gradient in
the logits' dtype. (Before: the fp32 upcast, the temperature-scaled and masked copies, the
softmax and the entropy's products were each a full ``[B, S, Vt]`` fp32 tensor, several kept for
backward: 4-5 fp32 copies of the logits at the peak; bench/logprobs_bench.py --memory.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.algorithm.truncation import Truncation, truncated_logprobs

# fp32 logits per chunk: 16M elements = 64 MiB (about 110 tokens of a 152k vocabulary).
CHUNK_ELEMENTS = 1 << 24


def _tp_max_(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp_group)
    return x


def _tp_sum_(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(x, group=tp_group)
    return x


def token_chunks(b: int, s: int, vt: int, max_elements: int | None = None) -> list[tuple[slice, slice]]:
    """(rows, positions) slices covering ``[b, s]`` with at most ``max_elements`` (default
    ``CHUNK_ELEMENTS``) logits each, one token's ``vt`` at least: whole rows when a row fits,
    else pieces of one row."""
    max_elements = CHUNK_ELEMENTS if max_elements is None else max_elements
    if s * vt <= max_elements:
        rows = max(1, max_elements // (s * vt))
        return [(slice(r, min(r + rows, b)), slice(0, s)) for r in range(0, b, rows)]
    step = max(1, max_elements // vt)
    return [(slice(r, r + 1), slice(p, min(p + step, s))) for r in range(b) for p in range(0, s, step)]


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """(logp_y, H) per token from this rank's logits slice; chunked forward, hand-written chunked
    backward (formulas in the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits_bsvt: torch.Tensor,
        labels_bs: torch.Tensor,
        vocab_start: int,
        vocab_size: int,
        temperature: float,
        tp_group: dist.ProcessGroup | None,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, vt = logits_bsvt.shape
        pad_v = None
        if vocab_size is not None and vocab_start + vt > vocab_size:
            pad_v = torch.arange(vocab_start, vocab_start + vt, device=logits_bsvt.device) >= vocab_size
        local_labels_bs = labels_bs - vocab_start
        owned_bs = (local_labels_bs >= 0) & (local_labels_bs < vt)
        local_labels_bs = local_labels_bs.clamp(0, vt - 1)
        device = logits_bsvt.device
        local_lse_bs = torch.empty((b, s), dtype=torch.float32, device=device)
        picked_bs = torch.empty((b, s), dtype=torch.float32, device=device)
        weighted_bs = torch.empty((b, s), dtype=torch.float32, device=device) if with_entropy else None
        for rows, pos in token_chunks(b, s, vt):
            z_cvt = _scaled_fp32(logits_bsvt[rows, pos], temperature, pad_v)
            lse_c = torch.logsumexp(z_cvt, dim=-1)
            local_lse_bs[rows, pos] = lse_c
            picked_bs[rows, pos] = z_cvt.gather(-1, local_labels_bs[rows, pos].unsqueeze(-1)).squeeze(-1)
            if weighted_bs is not None:
                pz_cvt = (z_cvt - lse_c.unsqueeze(-1)).exp_().mul_(z_cvt)
                if pad_v is not None:
                    pz_cvt.masked_fill_(pad_v, 0.0)  # p = 0 there (-inf * 0 gave NaN)
                weighted_bs[rows, pos] = pz_cvt.sum(dim=-1)
                del pz_cvt
            del z_cvt
        max_bs = _tp_max_(local_lse_bs.clone(), tp_group)
        lse_bs = max_bs + _tp_sum_((local_lse_bs - max_bs).exp(), tp_group).log()
        # where, not a product: a shard of padding only picks -inf, and -inf * 0 is NaN (issue 51 item 10)
        logprobs_bs = _tp_sum_(torch.where(owned_bs, picked_bs, 0.0), tp_group) - lse_bs
        if weighted_bs is not None:
            mean_z_bs = _tp_sum_((local_lse_bs - lse_bs).exp() * weighted_bs, tp_group)
            entropy_bs = lse_bs - mean_z_bs
        else:
            mean_z_bs = entropy_bs = logprobs_bs.new_zeros(())
            ctx.mark_non_differentiable(entropy_bs)
        ctx.save_for_backward(logits_bsvt, local_labels_bs, owned_bs, lse_bs, mean_z_bs)
        ctx.temperature, ctx.pad_v, ctx.with_entropy = temperature, pad_v, with_entropy
        return logprobs_bs, entropy_bs

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs_bs: torch.Tensor, grad_entropy_bs: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        logits_bsvt, local_labels_bs, owned_bs, lse_bs, mean_z_bs = ctx.saved_tensors
        b, s, vt = logits_bsvt.shape
        if grad_logprobs_bs is None:
            grad_logprobs_bs = torch.zeros_like(lse_bs)
        with_entropy = ctx.with_entropy and grad_entropy_bs is not None
        grad_bsvt = torch.empty_like(logits_bsvt)
        for rows, pos in token_chunks(b, s, vt):
            z_cvt = _scaled_fp32(logits_bsvt[rows, pos], ctx.temperature, ctx.pad_v)
            p_cvt = (z_cvt - lse_bs[rows, pos].unsqueeze(-1)).exp_()
            g_lp_c1 = grad_logprobs_bs[rows, pos].unsqueeze(-1)
            if with_entropy:
                assert grad_entropy_bs is not None  # the entropy output was used, so it has a gradient
                # p * (g_H (E[z] - z) - g_lp)
                g_cvt = torch.sub(mean_z_bs[rows, pos].unsqueeze(-1), z_cvt)
                if ctx.pad_v is not None:
                    g_cvt.masked_fill_(ctx.pad_v, 0.0)  # p = 0 there (inf * 0 would be NaN)
                g_cvt.mul_(grad_entropy_bs[rows, pos].unsqueeze(-1)).sub_(g_lp_c1).mul_(p_cvt)
            else:
                g_cvt = p_cvt.mul_(-g_lp_c1)
            owned_g_c1 = (grad_logprobs_bs[rows, pos] * owned_bs[rows, pos]).unsqueeze(-1)
            g_cvt.scatter_add_(-1, local_labels_bs[rows, pos].unsqueeze(-1), owned_g_c1)
            if ctx.temperature != 1.0:
                g_cvt.div_(ctx.temperature)
            grad_bsvt[rows, pos] = g_cvt
            del z_cvt, p_cvt, g_cvt
        return grad_bsvt, None, None, None, None, None, None


def _scaled_fp32(logits_cvt: torch.Tensor, temperature: float, pad_v: torch.Tensor | None) -> torch.Tensor:
    """``logits / temperature`` of one chunk in fp32, padded columns at -inf. Read-only: for fp32
    logits at T=1 without padding it is the logits' own view (no copy)."""
    if logits_cvt.dtype == torch.float32 and temperature == 1.0 and pad_v is None:
        return logits_cvt
    if logits_cvt.dtype != torch.float32:
        z_cvt = logits_cvt.float()
        if temperature != 1.0:
            z_cvt.div_(temperature)
    else:  # a new tensor either way: the padding below writes into it
        z_cvt = logits_cvt / temperature if temperature != 1.0 else logits_cvt.clone()
    if pad_v is not None:
        z_cvt.masked_fill_(pad_v, float("-inf"))
    return z_cvt


def vocab_parallel_logprobs(
    logits_bsvt: torch.Tensor,
    labels_bs: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    vocab_size: int | None = None,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(labels) and optionally the entropy H of softmax(logits / temperature), per token.

    ``logits_bsvt``: this rank's vocabulary slice starting at ``vocab_start``, any float dtype
    (computed in fp32 chunk by chunk).
    ``vocab_size``: the real (unpadded) vocabulary; padded columns get -inf so they carry no
    probability, as in the HF model and the rollout engine.
    ``truncation`` (active): the logprobs are those of the truncated, renormalised distribution a
    top-k / top-p / min-p sampler draws from (``algorithm/truncation.py``), over the whole vocabulary
    gathered chunk by chunk (``truncated_logprobs_bs``); the entropy stays the full distribution's.
    Returns fp32 ``logprobs_bs`` and ``entropy_bs`` (or None).
    """
    logprobs_bs, entropy_bs = _VocabParallelLogprobEntropy.apply(
        logits_bsvt, labels_bs, vocab_start, vocab_size, temperature, tp_group, with_entropy
    )
    if truncation is not None and truncation.active:
        logprobs_bs = truncated_logprobs_bs(
            logits_bsvt,
            labels_bs,
            truncation,
            temperature=temperature,
            vocab_size=vocab_size,
            tp_group=tp_group,
        )
    return logprobs_bs, entropy_bs if with_entropy else None


class _GatherVocab(torch.autograd.Function):
    """Every TP rank's vocabulary slice, concatenated; backward keeps this rank's slice of the gradient
    without communication (every TP rank computes the same loss from the gathered logits)."""

    @staticmethod
    def forward(ctx: Any, logits_xvt: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
        parts = [torch.empty_like(logits_xvt) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, logits_xvt.contiguous(), group=tp_group)
        ctx.start, ctx.width = dist.get_rank(tp_group) * logits_xvt.shape[-1], logits_xvt.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad_xv: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_xv[..., ctx.start : ctx.start + ctx.width].contiguous(), None


TRUNCATED_FLOOR = -100.0
"""The trainer's logprob of a token its own truncation drops (an engine with other numerics kept it):
exp(-100) ~ 0 as a probability, but finite, so that ratios, mismatch metrics and their sums stay so."""


def truncated_logprobs_bs(
    logits_bsvt: torch.Tensor,
    labels_bs: torch.Tensor,
    truncation: Truncation,
    *,
    temperature: float,
    vocab_size: int | None,
    tp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``log q(label)`` per token (``algorithm/truncation.py``) from this rank's vocabulary slice: each
    chunk of tokens' slices gathered over TP (differentiable: ``_GatherVocab``), the padded
    columns at -inf, floored at ``TRUNCATED_FLOOR``. Every rank computes the same values."""
    b, s, vt = logits_bsvt.shape
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    out_bs = torch.empty((b, s), dtype=torch.float32, device=logits_bsvt.device)
    pieces = []
    for rows, pos in token_chunks(b, s, vt * tp):
        chunk_cvt = logits_bsvt[rows, pos]
        if tp > 1:
            chunk_cvt = _GatherVocab.apply(chunk_cvt, tp_group)
        z_rv = chunk_cvt.float().flatten(0, 1) / temperature
        if vocab_size is not None and vocab_size < z_rv.shape[-1]:
            z_rv = z_rv.masked_fill(
                torch.arange(z_rv.shape[-1], device=z_rv.device) >= vocab_size, float("-inf")
            )
        logp_r = truncated_logprobs(z_rv, labels_bs[rows, pos].flatten(), truncation).clamp(
            min=TRUNCATED_FLOOR
        )
        pieces.append((rows, pos, logp_r.view(chunk_cvt.shape[:2])))
    for rows, pos, logp_cs in pieces:
        out_bs = out_bs.index_put((torch.arange(b)[rows][:, None], torch.arange(s)[pos][None, :]), logp_cs)
    return out_bs
