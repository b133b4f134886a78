"""Workers of tests/test_layouts.py: the same weights and batch at several parallel layouts.

The reference run (one process) builds the tiny Qwen3-MoE, records its canonical weights, the
per-token logprobs and entropy of a fixed batch, and the gradients of a GRPO-shaped loss. Each
layout run loads those weights into its shards, repeats the passes, gathers its gradients back
to canonical tensors and reports the largest differences.
"""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_megatron.bridge.layout import full_state
from grpo_megatron.config import load_config, validate
from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed, world_size_from_env
from grpo_megatron.models.builder import build_gpt_model
from grpo_megatron.training.forward_backward import (
    MicroBatch,
    forward_backward,
    forward_logprobs,
)
from grpo_megatron.training.packing import PackedRows
from grpo_megatron.training.policy import build_policy
from tests.helpers.dist import CPU_JOB
from tests.helpers.weights import load_full_state

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe.yaml"
ROWS = 4  # global batch rows, split over data-parallel ranks


def global_batch(vocab: int) -> list[MicroBatch]:
    """Four micro-batches (so two data-parallel ranks get two each: EP collectives need equal
    counts): two right-padded pairs of different lengths, and two packed sequences of two rows
    each (PackedSeqParams, odd lengths that exercise the sequence-parallel padding).
    """
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in (13, 13, 10, 10, 6, 6, 5, 5)]
    batches = []
    for pair in (seqs[0:2], seqs[2:4]):
        tokens = torch.stack(pair)
        weight = torch.rand(2, tokens.shape[1] - 1, generator=gen) - 0.5
        batches.append(MicroBatch(tokens[:, :-1], tokens[:, 1:], extras={"weight_bs": weight}))
    for a, b in (seqs[4:6], seqs[6:8]):
        packed = torch.cat([a, b])  # inputs: all but the last token; labels: all but the first
        rows = PackedRows((len(a), len(b) - 1))
        weight = torch.rand(2, rows.max_length, generator=gen) - 0.5  # per row, as the loss sees them
        batches.append(
            MicroBatch(
                packed[None, :-1],
                packed[None, 1:],
                position_ids_bs=rows.position_ids()[None],
                extras={"weight_bs": weight},
                packed=rows,
            )
        )
    return batches


def my_microbatches(batches: list[MicroBatch], dp: int, dp_rank: int) -> list[MicroBatch]:
    """Data parallelism: rank r takes every dp-th micro-batch."""
    return batches[dp_rank::dp]


def loss_fn_for(global_tokens: int):
    def loss_fn(logprobs_bs: torch.Tensor, entropy_bs: torch.Tensor | None, mb: MicroBatch):
        # A GRPO-shaped objective: weighted logprobs plus an entropy bonus, over the global count.
        assert entropy_bs is not None
        loss = -(mb.extras["weight_bs"] * logprobs_bs).sum() - 0.01 * entropy_bs.sum()
        return loss / global_tokens, {"tokens": torch.tensor(float(logprobs_bs.numel()))}

    return loss_fn


def run_layout(overrides: list[str], reference: dict | None) -> dict:
    """One layout: logprobs + gradients; with a reference, return the max abs differences."""
    cfg = load_config(EXAMPLE, [*CPU_JOB, "parallel.use_distributed_optimizer=false", *overrides])
    validate(cfg, world_size_from_env())
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    policy = build_policy(hf, cfg.model, cfg.parallel, cfg.train, ps)
    if reference is not None:
        load_full_state(policy.model, ps, reference["params"])
    batches = global_batch(policy.spec.vocab_size)
    global_tokens = sum(mb.labels_bs.numel() for mb in batches)
    mine = my_microbatches(batches, ps.dp, ps.dp_rank)

    logps = forward_logprobs(policy.model, mine, ps, vocab_size=policy.spec.vocab_size, with_entropy=True)
    policy.zero_grad()
    metrics = forward_backward(
        policy.model,
        mine,
        ps,
        loss_fn_for(global_tokens),
        vocab_size=policy.spec.vocab_size,
        with_entropy=True,
    )
    grads = full_state(policy.model, ps, grads=True)
    out = {
        "logprobs": [o.logprobs_bs for o in logps],
        "entropy": [o.entropy_bs for o in logps],
        "loss": sum(m["loss"] for m in metrics),
        "dp": ps.dp,
        "dp_rank": ps.dp_rank,
    }
    if reference is None:
        out |= {"params": full_state(policy.model, ps), "grads": grads}
    else:
        ref_mbs = my_microbatches(list(range(len(batches))), ps.dp, ps.dp_rank)
        out["logprob_diff"] = max(
            (a - reference["logprobs"][i]).abs().max().item()
            for a, i in zip(out["logprobs"], ref_mbs, strict=True)
        )
        out["entropy_diff"] = max(
            (a - reference["entropy"][i]).abs().max().item()
            for a, i in zip(out["entropy"], ref_mbs, strict=True)
        )
        missing = sorted(set(reference["grads"]) ^ set(grads))
        assert not missing, f"canonical names differ from the reference: {missing[:5]}"
        out["grad_diff"] = max((grads[k] - reference["grads"][k]).abs().max().item() for k in grads)
        out["grad_scale"] = max(reference["grads"][k].abs().max().item() for k in grads)
        del out["logprobs"], out["entropy"]
    destroy_distributed(keep_process_group=True)
    return out


def reference() -> dict:
    return run_layout([], None)


def layouts(layouts: dict[str, list[str]], reference: dict) -> dict:
    return {name: run_layout(overrides, reference) for name, overrides in layouts.items()}


def build_all_types(configs: dict[str, dict]) -> dict:
    """Each model_type builds from a tiny HF config and runs forward + backward (one process)."""
    results = {}
    for model_type, hf in configs.items():
        cfg = load_config(EXAMPLE, CPU_JOB)
        ps = init_distributed(cfg.parallel, seed=1)
        model, spec = build_gpt_model(hf, cfg.model, ps)
        batches = global_batch(spec.vocab_size)[:1]
        loss_fn = loss_fn_for(sum(mb.labels_bs.numel() for mb in batches))
        metrics = forward_backward(model, batches, ps, loss_fn, vocab_size=spec.vocab_size, with_entropy=True)
        grad_norm = torch.sqrt(
            sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None)
        )
        results[model_type] = {
            "loss": metrics[0]["loss"],
            "grad_norm": float(grad_norm),
            "params": sum(p.numel() for p in model.parameters()),
            "with_grad": sum(p.grad is not None for p in model.parameters()),
            "total": sum(1 for _ in model.parameters()),
        }
        destroy_distributed(keep_process_group=True)
    return results
