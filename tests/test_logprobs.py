"""vocab_parallel_logprobs at TP1 equals torch's log_softmax in value and gradient (entropy,
temperature and padded vocabulary included); tests/test_layouts.py covers TP > 1."""

from __future__ import annotations

import pytest
import torch

from grpo_megatron.models.logprobs import vocab_parallel_logprobs


def _reference(z_bsv: torch.Tensor, labels_bs: torch.Tensor, temperature: float, vocab: int):
    z_bsv = (z_bsv / temperature).masked_fill(torch.arange(z_bsv.shape[-1]) >= vocab, float("-inf"))
    logp_bsv = torch.log_softmax(z_bsv, dim=-1)
    p_bsv = logp_bsv.exp()
    entropy_bs = -(p_bsv * logp_bsv.masked_fill(p_bsv == 0, 0.0)).sum(-1)
    return logp_bsv.gather(-1, labels_bs[..., None])[..., 0], entropy_bs


def test_matches_log_softmax_in_value_and_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    z_bsv = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    labels_bs = torch.randint(0, 13, (3, 5), generator=gen)
    w_lp, w_h = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)

    lp, h = vocab_parallel_logprobs(
        z_bsv, labels_bs, tp_group=None, vocab_start=0, temperature=0.7, with_entropy=True, vocab_size=13
    )
    ref_lp, ref_h = _reference(z_bsv, labels_bs, 0.7, 13)
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h, ref_h, atol=1e-6, rtol=1e-6)

    (grad,) = torch.autograd.grad((w_lp * lp).sum() + (w_h * h).sum(), z_bsv)
    (ref_grad,) = torch.autograd.grad((w_lp * ref_lp).sum() + (w_h * ref_h).sum(), z_bsv)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)
    assert torch.all(grad[..., 13:] == 0), "padded vocabulary columns must get no gradient"


def test_logprobs_only_path_has_no_entropy() -> None:
    z_bsv = torch.randn(2, 4, 8)
    lp, h = vocab_parallel_logprobs(z_bsv, torch.zeros(2, 4, dtype=torch.long), tp_group=None, vocab_start=0)
    assert h is None
    torch.testing.assert_close(lp, torch.log_softmax(z_bsv, -1)[..., 0])


def test_chunks_cover_every_token_once() -> None:
    from grpo_megatron.models.logprobs import token_chunks

    for b, s, vt, limit in [
        (3, 5, 16, 1 << 20),
        (3, 5, 16, 40),
        (3, 5, 16, 16),
        (4, 7, 10, 150),
        (2, 3, 8, 1),
    ]:
        seen = torch.zeros(b, s, dtype=torch.int64)
        for rows, pos in token_chunks(b, s, vt, limit):
            seen[rows, pos] += 1
            assert seen[rows, pos].numel() * vt <= max(limit, vt)
        assert torch.all(seen == 1), (b, s, vt, limit)


def test_chunked_passes_equal_the_reference(monkeypatch) -> None:
    """Chunks of a few tokens (pieces of rows, on a transposed non-contiguous input as megatron's
    [S, B, V] output gives): same values and gradients."""
    from grpo_megatron.models import logprobs

    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 2 * 16)
    gen = torch.Generator().manual_seed(1)
    z_sbv = torch.randn(5, 3, 16, generator=gen, requires_grad=True)
    z_bsv = z_sbv.transpose(0, 1)
    labels_bs = torch.randint(0, 13, (3, 5), generator=gen)
    w_lp, w_h = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    lp, h = vocab_parallel_logprobs(
        z_bsv, labels_bs, tp_group=None, vocab_start=0, temperature=1.3, with_entropy=True, vocab_size=13
    )
    ref_lp, ref_h = _reference(z_bsv, labels_bs, 1.3, 13)
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h, ref_h, atol=1e-6, rtol=1e-6)
    (grad,) = torch.autograd.grad((w_lp * lp).sum() + (w_h * h).sum(), z_sbv)
    (ref_grad,) = torch.autograd.grad((w_lp * ref_lp).sum() + (w_h * ref_h).sum(), z_sbv)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)


def test_bf16_logits_are_computed_in_fp32() -> None:
    """bf16 logits (a bf16 model's output): fp32 logprobs and entropy of the upcast logits, exactly
    what the rollout engine computes (log_softmax of logits.float() / T); the gradient in bf16."""
    gen = torch.Generator().manual_seed(2)
    z_bsv = (torch.randn(2, 6, 32, generator=gen) * 3).to(torch.bfloat16).requires_grad_(True)
    labels_bs = torch.randint(0, 32, (2, 6), generator=gen)
    lp, h = vocab_parallel_logprobs(
        z_bsv, labels_bs, tp_group=None, vocab_start=0, temperature=0.8, with_entropy=True
    )
    assert lp.dtype == h.dtype == torch.float32
    engine_lp = torch.log_softmax(z_bsv.detach().float() / 0.8, dim=-1).gather(-1, labels_bs[..., None])[
        ..., 0
    ]
    torch.testing.assert_close(lp, engine_lp, atol=1e-6, rtol=1e-6)
    ref_lp, ref_h = _reference(z_bsv.detach().float(), labels_bs, 0.8, 32)
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)
    (lp.sum() + h.sum()).backward()
    assert z_bsv.grad is not None and z_bsv.grad.dtype == torch.bfloat16


@pytest.mark.launches
def test_a_vocabulary_shard_of_padding_only_gives_finite_logprobs_at_tp2_and_tp4() -> None:
    """Issue 51 item 10: a vocabulary of 32 padded to 128 x TP leaves every TP rank but the first a
    shard of padding only; its log-sum-exp is -inf, and its masked pick of the label was -inf * 0 =
    NaN in the sum over TP (``verify ... parallel.tp=2`` printed a NaN logprob difference). Real gloo
    TP groups of 2 and 4: logprobs, entropy and gradients finite and equal to log_softmax."""
    from tests.helpers.dist import run_distributed

    per_rank = run_distributed("tests.workers.logprob_workers:padding_shards", 4, timeout_s=180)
    for rank, result in enumerate(per_rank):
        for tp in ("tp2", "tp4"):
            r = result[tp]
            assert bool(r["finite"]), (rank, tp, r)
            assert float(r["lp_diff"]) < 1e-5 and float(r["h_diff"]) < 1e-5, (rank, tp, r)
    assert [bool(r["tp4"]["padding_only"]) for r in per_rank] == [False, True, True, True]
    assert [bool(r["tp2"]["padding_only"]) for r in per_rank] == [False, True, False, True]
