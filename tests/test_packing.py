"""Sequence packing (training/packing.py): the layout, the bin-packing rule, the local packed
attention, and packed vs padded micro-batches through real megatron-core at several layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grpo_megatron.models.local_attention import segment_attention
from grpo_megatron.training.batching import (
    all_rank_microbatches,
    batch_metrics,
    collate,
    make_sample,
    microbatch_rows,
)
from grpo_megatron.training.packing import PackedRows, first_fit_decreasing
from tests.helpers.dist import run_distributed

TOL = 1e-5


def test_packed_rows_unpack_and_pack_are_inverse_and_differentiable():
    rows = PackedRows((3, 1, 2))
    assert rows.cu_seqlens().tolist() == [0, 3, 4, 6]
    assert rows.cu_seqlens(pad_to=8).tolist() == [0, 3, 4, 6, 8]  # the padded tail is its own segment
    assert rows.position_ids().tolist() == [0, 1, 2, 0, 0, 1]
    x_t = torch.arange(1.0, 9.0, requires_grad=True)  # 6 tokens + 2 of padding
    x_bs = rows.unpack(x_t)
    assert x_bs.tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]
    assert torch.equal(rows.pack(x_bs), x_t[:6].detach())
    (x_bs * torch.arange(9.0).view(3, 3)).sum().backward()
    assert x_t.grad.tolist() == [0, 1, 2, 3, 6, 7, 0, 0]  # each token gets its row position's weight
    # Trailing dimensions ride along (e.g. expert routes [T, topk] for routing replay).
    routes_tk = torch.arange(12).view(6, 2)
    assert torch.equal(rows.pack(rows.unpack(routes_tk, fill=-1)), routes_tk)
    with pytest.raises(ValueError, match="lengths >= 1"):
        PackedRows((2, 0))


def test_slots_pad_each_row_for_context_parallelism():
    rows = PackedRows((3, 1)).padded_to(4)  # cp = 2: every row a multiple of 2 x cp
    assert rows.slots == (4, 4) and rows.total == 8
    assert rows.cu_seqlens().tolist() == [0, 4, 8]
    assert rows.position_ids().tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    x_t = torch.tensor([1.0, 2, 3, 0, 4, 0, 0, 0])
    assert rows.unpack(x_t).tolist() == [[1, 2, 3], [4, 0, 0]]
    assert torch.equal(rows.pack(rows.unpack(x_t)), x_t)


def test_context_parallel_chunks_are_megatrons_load_balanced_split():
    from grpo_megatron.distributed.context_parallel import local_index, restore_index

    cu_seqlens = torch.tensor([0, 8, 12])  # two segments, cp = 2: chunks of 2 and of 1 tokens
    # rank i holds chunks i and 2cp-1-i of every segment, segment by segment
    assert local_index(cu_seqlens, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert local_index(cu_seqlens, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    gathered = torch.cat([local_index(cu_seqlens, 2, r) for r in range(2)])
    assert gathered[restore_index(cu_seqlens, 2)].tolist() == list(range(12))
    with pytest.raises(ValueError, match="2 x cp"):
        local_index(torch.tensor([0, 6]), 2, 0)


def test_first_fit_decreasing_fills_the_token_budget():
    lengths = [7, 2, 5, 3, 9, 4, 12]
    bins = first_fit_decreasing(lengths, range(7), 12)
    # Longest first, each into the first bin with room: 12 | 9+3 | 7+5 | 4+2.
    assert bins == [[6], [4, 3], [0, 2], [5, 1]]
    assert sorted(i for b in bins for i in b) == list(range(7))
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins)
    assert first_fit_decreasing([20, 1], range(2), 8) == [[0], [1]]  # over the budget: alone


def test_packing_needs_fewer_micro_batches_and_reports_its_padding():
    lengths = [40, 5, 6, 4, 7, 5, 3, 6]
    padded = microbatch_rows(lengths, range(8), micro_batch_size=1, max_tokens=40)
    packed = microbatch_rows(lengths, range(8), micro_batch_size=1, max_tokens=40, packing=True)
    assert len(packed) < len(padded)
    per_rank = all_rank_microbatches(
        lengths, range(8), dp_size=2, micro_batch_size=1, max_tokens=40, packing=True
    )
    assert len(per_rank[0]) == len(per_rank[1])  # every rank runs the same number
    loads = [sum(lengths[i] for mb in r for i in mb) for r in per_rank]
    assert abs(loads[0] - loads[1]) <= max(lengths)  # token-balanced shares
    assert batch_metrics(lengths, [packed], True)["batch/padding_frac"] == 0.0
    m = batch_metrics(lengths, [[[0, 1]]], False)  # one padded micro-batch: 2 x 40 tokens for 45
    assert m == {"batch/padding_frac": pytest.approx(1 - 45 / 80), "batch/tokens_per_microbatch": 80.0}


def test_collate_packs_tokens_end_to_end_and_keeps_the_loss_inputs_as_rows():
    samples = [make_sample([1, 2], [3, 4, 5], [-1.0] * 3, 1.0), make_sample([6], [7], [-2.0], -1.0)]
    mb = collate(samples, [0, 1], pad_id=0, packed=True)
    assert mb.packed == PackedRows((4, 1))
    assert mb.tokens_bs.tolist() == [[1, 2, 3, 4, 6]]
    assert mb.labels_bs.tolist() == [[2, 3, 4, 5, 7]]
    assert mb.position_ids_bs.tolist() == [[0, 1, 2, 3, 0]]
    assert mb.extras["mask_bs"].tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    assert collate(samples, [], pad_id=0, packed=True).packed == PackedRows((1,))


def test_segment_attention_equals_block_diagonal_masked_attention():
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 1, 3)
    q_thd = torch.randn(9, 4, 8, generator=gen)
    k_thd, v_thd = torch.randn(2, 9, 2, 8, generator=gen)  # grouped-query: 4 heads over 2 groups
    out_thd = segment_attention(
        q_thd, k_thd, v_thd, PackedRows(lengths).cu_seqlens(), scale=0.3, dropout_p=0.0
    )
    seg_t = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    allowed_tt = (seg_t[:, None] == seg_t[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    ref_hsd = F.scaled_dot_product_attention(
        q_thd.transpose(0, 1),
        k_thd.repeat_interleave(2, dim=1).transpose(0, 1),
        v_thd.repeat_interleave(2, dim=1).transpose(0, 1),
        attn_mask=allowed_tt,
        scale=0.3,
    )
    torch.testing.assert_close(out_thd, ref_hsd.transpose(0, 1), rtol=0, atol=1e-6)


def _check(per_rank: list[dict], names) -> None:
    failures = []
    for results in per_rank:
        for name in names:
            r = results[name]
            for key in [k for k in r if k.endswith("_diff")]:
                if not r[key] <= TOL:
                    failures.append(f"{name}: {key}={r[key]:.3g} > {TOL} (grad scale {r['grad_scale']:.3g})")
    assert not failures, "\n".join(failures)


@pytest.mark.launches
def test_packed_equals_padded_in_one_process():
    per_rank = run_distributed(
        "tests.workers.packing_workers:layouts", 1, timeout_s=180, layouts={"world 1": []}
    )
    _check(per_rank, ["world 1"])


TWO_RANKS = {
    "TP2 (sequence parallel)": ["parallel.tp=2"],
    "EP2 alltoall": ["parallel.ep=2", "model.moe_token_dispatcher=alltoall"],
    "EP2 allgather": ["parallel.ep=2", "model.moe_token_dispatcher=allgather"],
    "PP2": ["parallel.pp=2"],
    "DP2": [],
}


@pytest.mark.launches
def test_packed_equals_padded_at_two_rank_layouts():
    per_rank = run_distributed("tests.workers.packing_workers:layouts", 2, timeout_s=300, layouts=TWO_RANKS)
    _check(per_rank, TWO_RANKS)


# Context parallelism (distributed/context_parallel.py): packed rows of odd lengths split over CP
# ranks give the one-process results; so do right-padded micro-batches (run as packed rows).
@pytest.fixture(scope="module")
def cp_reference() -> dict:
    (ref,) = run_distributed("tests.workers.packing_workers:cp_reference", 1, timeout_s=180)
    return ref


@pytest.mark.launches
def test_context_parallel_two_ranks_equals_one_process(cp_reference: dict) -> None:
    layouts = {"CP2": ["parallel.cp=2"]}
    per_rank = run_distributed(
        "tests.workers.packing_workers:cp_layouts", 2, timeout_s=300, layouts=layouts, reference=cp_reference
    )
    _check(per_rank, layouts)


FOUR_RANKS_CP = {
    "CP2xEP2": ["parallel.cp=2", "parallel.ep=2"],
    "CP2xTP2 (sequence parallel)": ["parallel.cp=2", "parallel.tp=2"],
    "CP2xPP2": ["parallel.cp=2", "parallel.pp=2"],
    "CP2xDP2": ["parallel.cp=2"],
}


@pytest.mark.launches
def test_context_parallel_four_rank_layouts_equal_one_process(cp_reference: dict) -> None:
    per_rank = run_distributed(
        "tests.workers.packing_workers:cp_layouts",
        4,
        timeout_s=420,
        layouts=FOUR_RANKS_CP,
        reference=cp_reference,
    )
    _check(per_rank, FOUR_RANKS_CP)
