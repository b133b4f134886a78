"""Rollout -> micro-batch layout (training/batching.py): pure functions, no process groups."""

import pytest
import torch

from grpo_megatron.algorithm.config import AlgorithmConfig
from grpo_megatron.algorithm.policy_loss import grpo_policy_loss, loss_normalizer
from grpo_megatron.training.batching import (
    LossInputs,
    collate,
    dp_shares,
    make_sample,
    microbatch_rows,
    minibatch_slices,
    rank_microbatches,
    scatter_logprobs,
)


def test_sample_layout_puts_response_logprobs_at_the_positions_that_predict_them():
    s = make_sample([5, 6, 7], [8, 9], [-0.5, -0.25], advantage=1.5)
    assert s.tokens_s.tolist() == [5, 6, 7, 8]
    assert s.labels_s.tolist() == [6, 7, 8, 9]
    assert s.mask_s.tolist() == [0, 0, 1, 1]  # positions 2 and 3 predict the response tokens 8 and 9
    assert s.rollout_logprobs_s.tolist() == [0, 0, -0.5, -0.25]
    with pytest.raises(ValueError, match="rollout logprobs"):
        make_sample([1], [2, 3], [-1.0], 0.0)


def test_minibatches_cover_the_batch_contiguously():
    slices = minibatch_slices(10, 3)
    assert [list(r) for r in slices] == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    with pytest.raises(ValueError, match="updates_per_iteration"):
        minibatch_slices(2, 3)


def test_dp_shares_balance_tokens_and_partition_the_indices():
    lengths = [10, 1, 9, 2, 8, 3, 7, 4]
    shares = dp_shares(lengths, range(8), 2)
    assert sorted(shares[0] + shares[1]) == list(range(8))
    loads = [sum(lengths[i] for i in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= 2
    assert dp_shares(lengths, range(8), 2) == shares  # deterministic


def test_microbatch_rows_by_count_and_by_token_budget():
    lengths = [4, 10, 6, 2]
    assert microbatch_rows(lengths, range(4), micro_batch_size=3, max_tokens=None) == [[1, 2, 0], [3]]
    # Longest first; a group's padded size is rows * its first (longest) row.
    groups = microbatch_rows(lengths, range(4), micro_batch_size=1, max_tokens=12)
    assert groups == [[1], [2, 0], [3]]
    assert all(len(g) * lengths[g[0]] <= 12 or len(g) == 1 for g in groups)


def test_every_dp_rank_gets_the_same_number_of_micro_batches():
    lengths = [10, 9, 1, 1, 1]  # balanced by tokens: rank 0 gets rows 0 and 3, rank 1 rows 1, 2 and 4
    plans = [
        rank_microbatches(lengths, range(5), dp_size=2, dp_rank=r, micro_batch_size=1, max_tokens=None)
        for r in range(2)
    ]
    assert len(plans[0]) == len(plans[1]) == 3
    assert sorted(i for p in plans for rows in p for i in rows) == list(range(5))
    assert plans[0][-1] == []  # the padding micro-batch of the less busy rank


def test_collate_pads_right_and_placeholder_contributes_nothing():
    samples = [make_sample([1, 2], [3], [-1.0], 1.0), make_sample([1], [4, 5, 6], [-1.0, -2.0, -3.0], -1.0)]
    mb = collate(samples, [0, 1], pad_id=0)
    assert mb.tokens_bs.tolist() == [[1, 2, 0], [1, 4, 5]]
    inputs = LossInputs.of(mb)
    assert inputs.mask_bs.tolist() == [[0, 1, 0], [1, 1, 1]]
    assert inputs.advantages_b.tolist() == [1.0, -1.0]
    assert inputs.ref_logprobs_bs is None and inputs.old_logprobs_bs is None
    empty = collate(samples, [], pad_id=0)
    assert empty.tokens_bs.shape == (1, 1) and float(LossInputs.of(empty).mask_bs.sum()) == 0

    out_bs = torch.arange(6, dtype=torch.float32).view(2, 3)
    scatter_logprobs(samples, [[0, 1]], [out_bs], "ref")
    assert samples[0].ref_logprobs_s.tolist() == [0, 1]  # masked to the response position
    assert samples[1].ref_logprobs_s.tolist() == [3, 4, 5]
    assert LossInputs.of(collate(samples, [0, 1], pad_id=0)).ref_logprobs_bs.tolist() == [
        [0, 1, 0],
        [3, 4, 5],
    ]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_losses_with_the_global_normaliser_sum_to_the_whole_batch_loss(mode):
    gen = torch.Generator().manual_seed(0)
    samples = [
        make_sample([1, 2, 3][: 1 + i % 3], list(range(2, 3 + i % 4)), [-1.0] * (1 + i % 4), float(i % 3 - 1))
        for i in range(7)
    ]
    cfg = AlgorithmConfig(loss_agg_mode=mode)
    normalizer = sum(loss_normalizer(mode, s.mask_s[None]) for s in samples)

    # The same per-sample logprobs, laid out once as one batch and once as three micro-batches.
    logprobs = {i: -torch.rand(samples[i].length, generator=gen) for i in range(7)}

    def batch_loss(rows):
        mb = collate(samples, rows, pad_id=0)
        lp_bs = torch.zeros(mb.tokens_bs.shape)
        for b, i in enumerate(rows):
            lp_bs[b, : samples[i].length] = logprobs[i]
        old_bs = lp_bs + 0.1 * LossInputs.of(mb).mask_bs
        loss, _ = grpo_policy_loss(
            lp_bs,
            old_bs,
            LossInputs.of(mb).advantages_b,
            LossInputs.of(mb).mask_bs,
            cfg,
            normalizer=normalizer,
            norm_len=8,
        )
        return loss

    whole = batch_loss(list(range(7)))
    split = sum(
        batch_loss(rows)
        for rows in microbatch_rows(
            [s.length for s in samples], range(7), micro_batch_size=3, max_tokens=None
        )
    )
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-7)
