"""Per-token logprobs: our vocab-parallel kernel (at TP1) against plain log_softmax + gather.

Both run in this process on the same logits; the last line prints the time ratio (ours / baseline)
for the forward and for forward + backward. At TP1 the two do the same arithmetic, so a ratio near 1
says the TP-ready formulation costs nothing when TP is off; memory is where TP>1 wins (no gathered
[B, S, V] tensor).

``--memory`` measures instead the peak host memory of one forward + backward (logprobs and entropy,
as the trainer's loss asks for them) over the logits, per 1k tokens and in fp32 copies of the
logits: each case runs in a fresh subprocess that allocates the logits, reads its peak resident
memory (``getrusage`` maxrss), runs the pass, and reports the rise of that peak (large tensors
are mmap-ed and returned to the OS when freed, so the peak follows live tensors).

    .venv/bin/python bench/logprobs_bench.py [--batch 8 --seq 512 --vocab 32768 --repeats 5]
    .venv/bin/python bench/logprobs_bench.py --memory [--batch 1 --seq 1024 --vocab 152064]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from grpo_megatron.models.logprobs import vocab_parallel_logprobs


def baseline(logits_bsv: torch.Tensor, labels_bs: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_bsv.float(), dim=-1).gather(-1, labels_bs.unsqueeze(-1)).squeeze(-1)


def ours(logits_bsv: torch.Tensor, labels_bs: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_logprobs(logits_bsv, labels_bs, tp_group=None, vocab_start=0)[0]


def timed(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits_bsv: torch.Tensor,
    labels_bs: torch.Tensor,
    repeats: int,
    backward: bool,
) -> float:
    best = float("inf")
    for _ in range(repeats):
        x = logits_bsv.detach().requires_grad_(backward)
        start = time.perf_counter()
        out = fn(x, labels_bs)
        if backward:
            out.sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def memory_case(batch: int, seq: int, vocab: int, dtype: str, entropy: bool) -> dict[str, float]:
    """One forward + backward in this process; the rise of the peak resident memory it caused."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    # Filled row by row: a full fp32 temporary here would raise the peak before the measurement.
    logits_bsv = torch.empty(batch, seq, vocab, dtype=getattr(torch, dtype))
    for b in range(batch):
        for s in range(seq):
            logits_bsv[b, s] = torch.randn(vocab, generator=gen)
    logits_bsv.requires_grad_(True)
    labels_bs = torch.randint(0, vocab, (batch, seq), generator=gen)
    before = _peak_rss()
    logprobs_bs, entropy_bs = vocab_parallel_logprobs(
        logits_bsv, labels_bs, tp_group=None, vocab_start=0, temperature=0.7, with_entropy=entropy
    )
    loss = -logprobs_bs.sum() + (0.01 * entropy_bs.sum() if entropy_bs is not None else 0.0)
    loss.backward()
    assert logits_bsv.grad is not None
    peak = _peak_rss() - before
    fp32_copy = batch * seq * vocab * 4
    return {
        "peak_bytes": float(peak),
        "per_1k_tokens_mib": peak / (batch * seq / 1000) / 2**20,
        "fp32_copies": peak / fp32_copy,
    }


def memory_report(args: argparse.Namespace) -> None:
    print(
        f"peak memory of logprobs + entropy, forward + backward, [B={args.batch}, S={args.seq}, V={args.vocab}]"
    )
    print(
        "(above the logits themselves, their gradient included; 1 fp32 copy = "
        f"{args.batch * args.seq * args.vocab * 4 / 2**20:.0f} MiB)"
    )
    for dtype in ("bfloat16", "float32"):
        for entropy in (True, False):
            code = (
                "import json, sys; sys.path.insert(0, 'bench'); from logprobs_bench import memory_case; "
                f"print(json.dumps(memory_case({args.batch}, {args.seq}, {args.vocab}, '{dtype}', {entropy})))"
            )
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"  logits {dtype:8s} entropy {'yes' if entropy else 'no ':3s}: peak +{r['peak_bytes'] / 2**20:7.0f} MiB"
                f" = {r['per_1k_tokens_mib']:6.0f} MiB per 1k tokens = {r['fp32_copies']:.2f} fp32 copies"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", action="store_true", help="peak memory instead of time (see above)")
    args = parser.parse_args()
    if args.memory:
        memory_report(args)
        return
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
