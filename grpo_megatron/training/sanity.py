"""``grpo-megatron sanity``: build the policy at the configured layout and take a few training steps.

The smallest real job of the stack: HF config -> megatron GPTModel (sharded) -> DDP + Adam ->
``train.iterations`` steps of next-token loss on a fixed synthetic batch (repeating digit
sequences, which a working model learns within a few steps) -> the loss printed each step.
It exercises the same bootstrap, model builder and forward/backward path as GRPO training.
Run it on several processes with torchrun to see a sharded layout, e.g.
``torchrun --nproc-per-node 2 -m grpo_megatron sanity examples/tiny_moe.yaml parallel.ep=2``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from grpo_megatron.distributed.collectives import collective_device

if TYPE_CHECKING:
    from grpo_megatron.config import JobConfig


def synthetic_batch(vocab_size: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[batch, seq_len]`` rows that repeat a short random motif: learnable in a few steps."""
    gen = torch.Generator().manual_seed(seed)
    motif_len = 4
    motif_bm = torch.randint(3, vocab_size, (batch, motif_len), generator=gen)
    return motif_bm.repeat(1, -(-seq_len // motif_len))[:, :seq_len]


def main(cfg: JobConfig) -> int:
    from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed
    from grpo_megatron.training.forward_backward import MicroBatch, forward_backward
    from grpo_megatron.training.policy import build_policy

    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    policy = build_policy(hf, cfg.model, cfg.parallel, cfg.train, ps)
    n_params = sum(p.numel() for p in policy.model.parameters())
    if ps.rank == 0:
        print(
            f"[sanity] {policy.spec.model_type}: {n_params / 1e6:.2f}M parameters on rank 0 | {ps.describe()}"
        )

    # Each data-parallel rank trains on its own rows of one global batch.
    rows_per_rank, seq_len = 4, 32
    tokens_bs = synthetic_batch(policy.spec.vocab_size, rows_per_rank * ps.dp, seq_len + 1, cfg.train.seed)
    mine_bs = tokens_bs[ps.dp_rank * rows_per_rank : (ps.dp_rank + 1) * rows_per_rank]
    global_tokens = rows_per_rank * ps.dp * seq_len
    microbatches = [
        MicroBatch(tokens_bs=mine_bs[i : i + 2, :-1], labels_bs=mine_bs[i : i + 2, 1:])
        for i in range(0, rows_per_rank, 2)
    ]

    def nll(
        logprobs_bs: torch.Tensor, entropy_bs: torch.Tensor | None, mb: MicroBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # Token sum over the global token count: exact under any micro-batch / DP split.
        return -logprobs_bs.sum() / global_tokens, {}

    for step in range(1, cfg.train.iterations + 1):
        start = time.perf_counter()
        policy.zero_grad()
        metrics = forward_backward(policy.model, microbatches, ps, nll, vocab_size=policy.spec.vocab_size)
        stats = policy.step()
        loss = torch.tensor(sum(m["loss"] for m in metrics), device=collective_device(ps.dp_group))
        torch.distributed.all_reduce(loss, group=ps.dp_group)
        if ps.rank == 0:
            print(
                f"[sanity] step {step:3d}  loss {loss.item():.4f}  grad_norm {stats['grad_norm']:.3f}  "
                f"{time.perf_counter() - start:.2f}s"
            )
    destroy_distributed()
    return 0
