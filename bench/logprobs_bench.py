"""Per-token logprobs: our vocab-parallel kernel (at TP1) against plain log_softmax + gather.

Both run in this process on the same logits; the last line prints the time ratio (ours / baseline)
for the forward and for forward + backward. At TP1 the two do the same arithmetic, so a ratio near 1
says the TP-ready formulation costs nothing when TP is off; memory is where TP>1 wins (no gathered
[B, S, V] tensor), which this benchmark does not measure.

    .venv/bin/python bench/logprobs_bench.py [--batch 8 --seq 512 --vocab 32768 --repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from grpo_megatron.models.logprobs import vocab_parallel_logprobs


def baseline(logits_bsv: torch.Tensor, labels_bs: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_bsv.float(), dim=-1).gather(-1, labels_bs.unsqueeze(-1)).squeeze(-1)


def ours(logits_bsv: torch.Tensor, labels_bs: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_logprobs(logits_bsv, labels_bs, tp_group=None, vocab_start=0)[0]


def timed(fn, logits_bsv: torch.Tensor, labels_bs: torch.Tensor, repeats: int, backward: bool) -> float:
    best = float("inf")
    for _ in range(repeats):
        x = logits_bsv.detach().requires_grad_(backward)
        start = time.perf_counter()
        out = fn(x, labels_bs)
        if backward:
            out.sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    logits_bsv = torch.randn(args.batch, args.seq, args.vocab, generator=gen)
    labels_bs = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    diff = (ours(logits_bsv, labels_bs) - baseline(logits_bsv, labels_bs)).abs().max().item()
    print(f"shape [B={args.batch}, S={args.seq}, V={args.vocab}], max |ours - baseline| = {diff:.2e}")
    for backward in (False, True):
        t_base = timed(baseline, logits_bsv, labels_bs, args.repeats, backward)
        t_ours = timed(ours, logits_bsv, labels_bs, args.repeats, backward)
        label = "forward+backward" if backward else "forward"
        print(
            f"{label:17s} baseline {t_base * 1e3:8.1f} ms   ours {t_ours * 1e3:8.1f} ms   ratio {t_ours / t_base:.2f}"
        )


if __name__ == "__main__":
    main()
