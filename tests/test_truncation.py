"""Issue 53 item 4: top-k / top-p / min-p on both sides of the ratio (algorithm/truncation.py), against
distributions computed by hand; the embedded engine samples from and reports the truncated
distribution; the trainer's vocab-parallel logprobs of it equal the formula's."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_megatron.algorithm.truncation import Truncation, keep_mask, truncated_logprobs
from grpo_megatron.models.logprobs import TRUNCATED_FLOOR, vocab_parallel_logprobs
from grpo_megatron.rollout.config import RolloutConfig
from grpo_megatron.rollout.embedded import sample_next
from grpo_megatron.rollout.engine import SamplingParams

Z = [2.0, 1.0, 0.5, 0.0, -1.0]
P = [math.exp(z) / sum(math.exp(v) for v in Z) for z in Z]  # 0.5465, 0.2010, 0.1219, 0.0740, 0.0272


def _hand(kept: list[int], label: int) -> float:
    return math.log(P[label] / sum(P[i] for i in kept))


@pytest.mark.parametrize(
    ("truncation", "kept"),
    [
        (Truncation(top_k=3), [0, 1, 2]),
        (Truncation(top_p=0.8), [0, 1, 2]),  # mass before token 2: 0.7475 < 0.8; before token 3: 0.869
        (Truncation(top_p=0.5), [0]),  # the first token always stays
        (Truncation(min_p=0.2), [0, 1, 2]),  # p >= 0.2 * 0.5465 = 0.1093
        (Truncation(top_k=4, top_p=0.7), [0, 1]),  # renormalised over 4: 0.5623, 0.2069 -> 0.769 >= 0.7
        (Truncation(), [0, 1, 2, 3, 4]),
    ],
)
def test_the_kept_set_and_its_logprobs_are_the_hand_computed_ones(truncation, kept) -> None:
    z_rv = torch.tensor([Z] * 5)
    assert keep_mask(z_rv, truncation)[0].nonzero()[:, 0].tolist() == kept
    got = truncated_logprobs(z_rv, torch.arange(5), truncation)
    for label in range(5):
        expected = _hand(kept, label) if label in kept else -math.inf
        assert got[label].item() == pytest.approx(expected, abs=1e-6), (label, got.tolist())


def test_the_embedded_engine_samples_the_truncated_distribution_and_reports_its_logprobs() -> None:
    logits_rv = torch.tensor([Z] * 20000)
    params = SamplingParams(top_k=4, top_p=0.7)
    tokens_r, logprobs_r = sample_next(logits_rv, params, torch.Generator().manual_seed(0))
    assert set(tokens_r.tolist()) == {0, 1}
    share = (tokens_r == 1).float().mean().item()
    assert share == pytest.approx(P[1] / (P[0] + P[1]), abs=0.01)  # 0.2689
    assert logprobs_r[tokens_r == 1][0].item() == pytest.approx(_hand([0, 1], 1), abs=1e-6)
    _, full = sample_next(logits_rv[:2], SamplingParams(), torch.Generator().manual_seed(0))
    assert full.tolist()[0] in [
        pytest.approx(math.log(p), abs=1e-6) for p in P
    ]  # off: the full distribution's


def test_the_trainers_logprobs_take_the_same_truncation_with_a_floor_for_dropped_tokens() -> None:
    """``vocab_parallel_logprobs(truncation=...)`` at TP1, temperature 2, a padded vocabulary: the
    formula's values; a token the trainer's truncation drops gets the finite floor; gradients flow to
    the kept tokens' logits only."""
    gen = torch.Generator().manual_seed(0)
    logits_bsv = torch.randn(2, 3, 8, generator=gen).requires_grad_()
    labels_bs = torch.tensor([[0, 1, 2], [3, 4, 5]])
    t = Truncation(top_k=3)
    got, _ = vocab_parallel_logprobs(
        logits_bsv, labels_bs, tp_group=None, vocab_start=0, temperature=2.0, vocab_size=6, truncation=t
    )
    z_rv = (logits_bsv.detach() / 2.0)[..., :6].reshape(6, 6)
    expected = truncated_logprobs(z_rv, labels_bs.flatten(), t).clamp(min=TRUNCATED_FLOOR).view(2, 3)
    assert torch.equal(got.detach(), expected)
    assert (got == TRUNCATED_FLOOR).any() and torch.isfinite(got).all()
    got.sum().backward()
    grad = logits_bsv.grad.reshape(6, 8)
    assert (grad[:, 6:] == 0).all()  # padding
    dropped = ~keep_mask(torch.nn.functional.pad(z_rv, (0, 2), value=float("-inf")), t)
    assert (grad[dropped] == 0).all()


def test_truncation_is_refused_with_sglang_and_checked() -> None:
    with pytest.raises(ValueError, match="SGLang reports the logprobs of the full distribution"):
        RolloutConfig(engine="sglang", top_k=20).validate()
    with pytest.raises(ValueError, match="top_p must be in"):
        RolloutConfig(top_p=0.0).validate()
    RolloutConfig(top_k=20, top_p=0.95, min_p=0.05).validate()
