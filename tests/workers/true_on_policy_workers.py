"""Workers of tests/test_true_on_policy.py: the policy engine's behaviour logprobs against the trainer's
forward of the same responses, at one layout per call, for several architectures.

Each run builds the tiny model of a ``model_type`` in bf16 with batch-invariant attention, gives it
random weights, generates with ``training/policy_engine.py`` (every rank together, each data-parallel
replica its own prompts), then computes the trainer's logprobs of the responses as a training pass
does (every response of the replica packed into one micro-batch, under ``BatchInvariantMode``), and
counts the response tokens whose two logprobs differ in any bit. Then the weights move (an Adam-like
step of random direction) and the same again: exactness must hold at any weights.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from grpo_megatron.config import load_config
from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed
from grpo_megatron.models.batch_invariant import BatchInvariantMode, key_width
from grpo_megatron.models.builder import build_gpt_model
from grpo_megatron.rollout.engine import SamplingParams
from grpo_megatron.rollout.policy_engine import policy_generate
from grpo_megatron.training.forward_backward import MicroBatch, TrainerForward, forward_logprobs
from grpo_megatron.training.packing import PackedRows
from tests.helpers.dist import CPU_JOB
from tests.helpers.tiny_configs import tiny_hf_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe.yaml"
PROMPT_LEN, NEW_TOKENS, N = 7, 9, 3


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Random weights of a useful scale (norms near 1), drawn alike on every rank: what is replicated
    (norms under tensor parallelism, dense weights over data-parallel ranks) must be equal, as training
    keeps it; a shard then holds the same values as its peers' (no comparison crosses layouts)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * (
                0.1 if "norm" in name else 2.0 / p.shape[-1] ** 0.5
            )
            p.copy_((noise + 1.0 if "norm" in name else noise).to(p.dtype))


def _step_(model: torch.nn.Module, seed: int) -> None:
    """The weights moved as by an update: each a small random step away."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * 0.01).to(p.dtype))


def _trainer_logprobs(
    model: torch.nn.Module,
    ps,
    sequences: list[list[int]],
    vocab: int,
    *,
    invariant: bool = True,
    params: SamplingParams | None = None,
) -> torch.Tensor:
    """The trainer's logprobs ``[B, S]`` of each sequence's tokens after its first, all sequences
    packed into one micro-batch (a training pass's layout)."""
    rows = PackedRows(tuple(len(s) - 1 for s in sequences))
    tokens_t = torch.tensor([t for s in sequences for t in s[:-1]])
    labels_t = torch.tensor([t for s in sequences for t in s[1:]])
    mb = MicroBatch(tokens_t[None], labels_t[None], position_ids_bs=rows.position_ids()[None], packed=rows)
    with BatchInvariantMode() if invariant else contextlib.nullcontext():
        (out,) = forward_logprobs(
            model,
            [mb],
            ps,
            vocab_size=vocab,
            temperature=params.temperature if params else 1.0,
            truncation=params.truncation if params else None,
        )
    return out.logprobs_bs


def compare(
    model_type: str,
    overrides: list[str],
    temperature: float = 1.0,
    invariant: bool = True,
    sampling: dict | None = None,
) -> dict:
    """Generate, then score with the trainer, twice (two sets of weights): bitwise mismatches.
    ``invariant`` False (the control): the trainer's pass in the model's plain numerics (SDPA, plain
    products), as without the switch. ``sampling``: more ``SamplingParams`` (top-k / top-p / min-p: the
    trainer's pass then takes the same truncation)."""
    cfg = load_config(
        EXAMPLE, [*CPU_JOB, "model.dtype=bfloat16", "parallel.use_distributed_optimizer=false", *overrides]
    )
    ps = init_distributed(cfg.parallel, seed=1)
    hf = tiny_hf_config(model_type)
    model, spec = build_gpt_model(hf, cfg.model, ps, key_length=key_width(PROMPT_LEN + NEW_TOKENS))
    plain = build_gpt_model(hf, cfg.model, ps)[0] if not invariant else None
    gen = torch.Generator().manual_seed(100 + ps.dp_rank)
    prompts = [
        torch.randint(3, spec.vocab_size, (PROMPT_LEN - i % 3,), generator=gen).tolist() for i in range(3)
    ]
    out = {"tokens": 0, "mismatches": [], "max_abs": 0.0, "finished": 0}
    _randomize_(model, seed=5)
    for version in range(2):  # random weights, then a step away from them
        if version:
            _step_(model, seed=1000)
        base = {
            "n": N,
            "temperature": temperature,
            "max_new_tokens": NEW_TOKENS,
            "seed": 11 + ps.dp_rank,
            "stop_token_ids": (2,),
        }
        params = SamplingParams(**(base | (sampling or {})))
        forward = TrainerForward(model, ps, spec.vocab_size)
        groups = policy_generate(forward.last_logits, ps, prompts, params, vocab_size=spec.vocab_size)
        completions = [(p, c) for p, g in zip(prompts, groups, strict=True) for c in g]
        if plain is not None:
            plain.load_state_dict(model.state_dict())
        trainer_bs = _trainer_logprobs(
            plain or model,
            ps,
            [p + c.token_ids for p, c in completions],
            spec.vocab_size,
            invariant=invariant,
            params=params,
        )
        bad = 0
        for b, (p, c) in enumerate(completions):
            mine = trainer_bs[b, len(p) - 1 : len(p) - 1 + len(c.token_ids)].tolist()
            bad += sum(x != y for x, y in zip(mine, c.logprobs, strict=True))
            out["max_abs"] = max(
                out["max_abs"], max(abs(x - y) for x, y in zip(mine, c.logprobs, strict=True))
            )
            out["tokens"] += len(c.token_ids)
            out["finished"] += c.finish_reason == "stop"
        out["mismatches"].append(bad)
    destroy_distributed(keep_process_group=True)
    return out


def compare_all(runs: dict[str, tuple]) -> dict:
    """Several (model type, layout, invariant[, sampling]) runs in one launch."""
    return {
        name: compare(run[0], run[1], invariant=run[2], sampling=run[3] if len(run) > 3 else None)
        for name, run in runs.items()
    }
