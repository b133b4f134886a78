"""Workers of tests/test_logprobs.py: ``vocab_parallel_logprobs`` over a real gloo TP group (issue 51
item 10). Four ranks hold TP2 (two groups of two) and TP4 (one group of four) at once; the vocabulary
(32 tokens) is padded as megatron pads it (``padded_vocab_size``: 128 x TP), so every rank but the first
of each group holds padding only."""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpo_megatron.models.builder import padded_vocab_size
from grpo_megatron.models.logprobs import vocab_parallel_logprobs
from tests.helpers.dist import init_gloo

VOCAB = 32
DIVISIBLE_BY = 128  # megatron's make_vocab_size_divisible_by default


def _shard_pass(tp: int, group: dist.ProcessGroup, tp_rank: int) -> dict[str, torch.Tensor]:
    padded = padded_vocab_size(VOCAB, DIVISIBLE_BY, tp)
    vt = padded // tp
    gen = torch.Generator().manual_seed(tp)  # the same full logits on every rank of the group
    full_bsv = torch.randn(2, 5, padded, generator=gen)
    labels_bs = torch.randint(0, VOCAB, (2, 5), generator=gen)
    mine_bsv = full_bsv[..., tp_rank * vt : (tp_rank + 1) * vt].clone().requires_grad_(True)
    lp, h = vocab_parallel_logprobs(
        mine_bsv,
        labels_bs,
        tp_group=group,
        vocab_start=tp_rank * vt,
        temperature=0.9,
        with_entropy=True,
        vocab_size=VOCAB,
    )
    assert h is not None
    (lp.sum() + h.sum()).backward()
    assert mine_bsv.grad is not None
    ref_bsv = torch.log_softmax(full_bsv[..., :VOCAB] / 0.9, dim=-1)
    ref_lp = ref_bsv.gather(-1, labels_bs[..., None])[..., 0]
    ref_h = -(ref_bsv.exp() * ref_bsv).sum(-1)
    return {
        "lp_diff": (lp - ref_lp).abs().max().detach(),
        "h_diff": (h - ref_h).abs().max().detach(),
        "finite": torch.tensor(
            bool(torch.isfinite(lp).all() and torch.isfinite(h).all() and torch.isfinite(mine_bsv.grad).all())
        ),
        "padding_only": torch.tensor(tp_rank * vt >= VOCAB),
    }


def padding_shards() -> dict[str, dict[str, torch.Tensor]]:
    rank, world = init_gloo()
    assert world == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {
        "tp2": _shard_pass(2, pairs[rank // 2], rank % 2),
        "tp4": _shard_pass(4, dist.new_group([0, 1, 2, 3]), rank),
    }
    dist.destroy_process_group()
    return out
