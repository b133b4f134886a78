"""Workers of tests/test_packing.py: the same rows as padded and as packed micro-batches.

Each layout builds the tiny Qwen3-MoE, lays out one batch of odd-length rows both ways through
the trainer's own batching (``rank_microbatches`` + ``collate``), runs the logprob pass and a
forward-backward of a GRPO-shaped loss, and reports the largest per-row differences of logprobs,
entropy and gradients between the two.
"""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_megatron.bridge.layout import full_state
from grpo_megatron.config import load_config, validate
from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed, world_size_from_env
from grpo_megatron.training.batching import collate, make_sample, rank_microbatches
from grpo_megatron.training.forward_backward import MicroBatch, forward_backward, forward_logprobs
from grpo_megatron.training.policy import build_policy
from tests.helpers.dist import CPU_JOB
from tests.helpers.weights import load_full_state

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe.yaml"
# Odd prompt + response lengths, long-tailed: rows of a micro-batch differ a lot in length.
LENGTHS = ((5, 16), (3, 2), (7, 9), (4, 1), (6, 13), (3, 4), (5, 7), (2, 3))


def samples_for(vocab: int):
    gen = torch.Generator().manual_seed(11)
    out = []
    for n_prompt, n_response in LENGTHS:
        ids = torch.randint(0, vocab, (n_prompt + n_response,), generator=gen).tolist()
        out.append(
            make_sample(
                ids[:n_prompt], ids[n_prompt:], [-1.0] * n_response, float(torch.randn(1, generator=gen))
            )
        )
    return out


def loss_fn_for(global_tokens: float):
    def loss_fn(logprobs_bs: torch.Tensor, entropy_bs: torch.Tensor | None, mb: MicroBatch):
        assert entropy_bs is not None
        e = mb.extras
        per_token_bs = e["advantages_b"][:, None] * logprobs_bs + 0.01 * entropy_bs
        loss = -(per_token_bs * e["mask_bs"]).sum() / global_tokens
        return loss, {"tokens": e["mask_bs"].sum()}

    return loss_fn


def row_logprobs(policy, samples, ps, *, packed: bool) -> tuple[list, list, dict]:
    """This rank's micro-batches of ``samples`` (3 rows each, packed or right-padded), and every row's
    logprobs and entropy over its own length: ``(rows, micro-batches, {row: (logprobs, entropy)})``."""
    rows = rank_microbatches(
        [s.length for s in samples],
        range(len(samples)),
        dp_size=ps.dp,
        dp_rank=ps.dp_rank,
        micro_batch_size=3,
        max_tokens=None,
        packing=packed,
    )
    mbs = [collate(samples, r, 0, packed=packed) for r in rows]
    outs = forward_logprobs(policy.model, mbs, ps, vocab_size=policy.spec.vocab_size, with_entropy=True)
    per_row = {}
    for r, o in zip(rows, outs, strict=True):
        for b, i in enumerate(r):
            n = samples[i].length
            per_row[i] = (o.logprobs_bs[b, :n].clone(), o.entropy_bs[b, :n].clone())
    return rows, mbs, per_row


def run_layout(overrides: list[str]) -> dict:
    cfg = load_config(EXAMPLE, [*CPU_JOB, "parallel.use_distributed_optimizer=false", *overrides])
    validate(cfg, world_size_from_env())
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    policy = build_policy(cfg.model.load_hf_config(), cfg.model, cfg.parallel, cfg.train, ps)
    vocab = policy.spec.vocab_size
    samples = samples_for(vocab)
    global_tokens = float(sum(s.mask_s.sum() for s in samples))
    results = {}
    for packed in (False, True):
        rows, mbs, per_row = row_logprobs(policy, samples, ps, packed=packed)
        policy.zero_grad()
        metrics = forward_backward(
            policy.model, mbs, ps, loss_fn_for(global_tokens), vocab_size=vocab, with_entropy=True
        )
        results[packed] = (per_row, full_state(policy.model, ps, grads=True), sum(m["loss"] for m in metrics))
    (pad_rows, pad_grads, pad_loss), (pack_rows, pack_grads, pack_loss) = results[False], results[True]
    assert set(pad_rows) == set(pack_rows) and pad_rows, "both layouts must cover this rank's rows"
    out = {
        "logprob_diff": max((pad_rows[i][0] - pack_rows[i][0]).abs().max().item() for i in pad_rows),
        "entropy_diff": max((pad_rows[i][1] - pack_rows[i][1]).abs().max().item() for i in pad_rows),
        "grad_diff": max((pad_grads[k] - pack_grads[k]).abs().max().item() for k in pad_grads),
        "grad_scale": max(g.abs().max().item() for g in pad_grads.values()),
        "loss_diff": abs(pad_loss - pack_loss),
    }
    destroy_distributed(keep_process_group=True)
    return out


def layouts(layouts: dict[str, list[str]]) -> dict:
    return {name: run_layout(overrides) for name, overrides in layouts.items()}


def cp_run(overrides: list[str], reference: dict | None) -> dict:
    """Packed rows at a layout (context parallel or not): per-row logprobs, entropy and gradients;
    with a reference (the one-process run), the weights come from it and the differences are returned."""
    cfg = load_config(EXAMPLE, [*CPU_JOB, "parallel.use_distributed_optimizer=false", *overrides])
    validate(cfg, world_size_from_env())
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    policy = build_policy(cfg.model.load_hf_config(), cfg.model, cfg.parallel, cfg.train, ps)
    if reference is not None:
        load_full_state(policy.model, ps, reference["params"])
    vocab = policy.spec.vocab_size
    samples = samples_for(vocab)
    global_tokens = float(sum(s.mask_s.sum() for s in samples))
    rows, mbs, per_row = row_logprobs(policy, samples, ps, packed=True)
    # Right-padded micro-batches (the mismatch probe's kind) run too, as rows of their padded length.
    padded_outs = forward_logprobs(policy.model, [collate(samples, r, 0) for r in rows], ps, vocab_size=vocab)
    padded_rows = {
        i: o.logprobs_bs[b, : samples[i].length]
        for r, o in zip(rows, padded_outs, strict=True)
        for b, i in enumerate(r)
    }
    policy.zero_grad()
    forward_backward(policy.model, mbs, ps, loss_fn_for(global_tokens), vocab_size=vocab, with_entropy=True)
    grads = full_state(policy.model, ps, grads=True)
    if reference is None:
        out = {"params": full_state(policy.model, ps), "grads": grads, "rows": per_row}
    else:
        ref_rows = reference["rows"]
        out = {
            "logprob_diff": max((per_row[i][0] - ref_rows[i][0]).abs().max().item() for i in per_row),
            "entropy_diff": max((per_row[i][1] - ref_rows[i][1]).abs().max().item() for i in per_row),
            "grad_diff": max((grads[k] - reference["grads"][k]).abs().max().item() for k in grads),
            "grad_scale": max(g.abs().max().item() for g in grads.values()),
            "padded_rows_logprob_diff": max(
                (padded_rows[i] - ref_rows[i][0]).abs().max().item() for i in padded_rows
            ),
            "rows_seen": len(per_row),
        }
    destroy_distributed(keep_process_group=True)
    return out


def cp_reference() -> dict:
    return cp_run([], None)


def cp_layouts(layouts: dict[str, list[str]], reference: dict) -> dict:
    return {name: cp_run(overrides, reference) for name, overrides in layouts.items()}
