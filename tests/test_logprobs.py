"""vocab_parallel_logprobs at TP1 equals torch's log_softmax in value and gradient (entropy,
temperature and padded vocabulary included); tests/test_layouts.py covers TP > 1."""

from __future__ import annotations

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
