"""Rollout time per iteration with long-tailed response lengths: synchronous vs continuous generation
with partial rollouts (training/partial.py), in one run (issue 40's benchmark, rollout phase only).

One in-process embedded engine (a dense Qwen2 of examples/demo's sizes, random weights, one thread,
a context of 512). Response lengths are drawn from a lognormal (median ``--median`` tokens,
sigma ``--sigma``, capped at ``--max-new-tokens``) and imposed as each response's own budget, the
engine's stop token standing in for them: a response "ends" at its drawn length. Both arms draw the
same lengths for the same prompts, in the same order.

- synchronous: each iteration generates its ``--prompts`` x ``--samples`` responses in one call and
  waits for the longest;
- continuous: ``PartialPool`` (the same pool and round function, ``submit_round``, the trainer's
  ``PartialRollouts`` runs) of twice as many
  groups, segments of ``--segment`` tokens, rounds until ``--prompts`` groups are complete, the
  oldest taken.

No weight update happens between iterations (the weights do not change what is timed here); the
continuous arm's first iteration fills the pool and is left out with the synchronous arm's first.
Training is not part of this measurement: the ratio is of the rollout phase only.

Measured (2026-11-28, 2 shared cores; lengths p50 17, p99 173, p99/p50 10.2; 4 prompts x 8 samples):
continuous / synchronous 1.06 and 0.84 (segments of 16, 5 and 4 iterations), 1.10 (32), 0.99 (64,
10 iterations); 8 x 4 with segments of 32: 1.09. No gain on this CPU engine; our reading, not
measured separately: a CPU decode step costs roughly in proportion to the rows in it, so waiting
behind the longest response wastes little, while every continuation recomputes its prefix. The gain
partial rollouts promise comes where a decode step costs about the same for few rows as for many
(GPUs, memory-bound) and the tail leaves slots idle; issue 40's target (continuous / synchronous
<= 0.5) is not met by this bench. bench/partial_iterations.py times whole iterations with the
rounds overlapped with training (rollout.partial.overlap), and measures the demo MoE's decode step
at 5.1 ms for 1 row vs 12.9 ms for 64: not proportional to rows.

    python bench/partial_rollout.py            # ~15 s on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from statistics import mean, median

import torch

from grpo_megatron.rollout.engine import Completion, SamplingParams
from grpo_megatron.training.partial import PartialPool, PartialResponse, collect_round, submit_round

REPO = Path(__file__).resolve().parent.parent


def make_engine() -> object:
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_megatron.rollout.embedded import EmbeddedEngine

    demo = json.loads((REPO / "examples" / "demo" / "config.json").read_text())
    dense = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    hf = {k: demo[k] for k in dense} | {"model_type": "qwen2", "max_position_embeddings": 512}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    engine = EmbeddedEngine(hf, device="cpu", dtype=torch.float32)
    names = sorted(n for n in model.state_dict() if n in engine.expected_tensors())
    engine.update_weights([(n, model.state_dict()[n]) for n in names], version=1, last=True)
    return engine


class Lengths:
    """Each response's drawn length, by (group serial, sample), and each group's prompt."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def length(self, serial: int, sample: int) -> int:
        rng = random.Random(serial * 1009 + sample)
        a = self.args
        return max(1, min(a.max_new_tokens, round(math.exp(rng.gauss(math.log(a.median), a.sigma)))))

    def prompt(self, serial: int) -> list[int]:
        rng = random.Random(-1 - serial)
        return [rng.randrange(3, 32) for _ in range(8)]


def synchronous(engine: object, lengths: Lengths, args: argparse.Namespace) -> list[float]:
    seconds = []
    for it in range(args.iterations):
        serials = range(it * args.prompts, (it + 1) * args.prompts)
        rows = [lengths.prompt(s) for s in serials for _ in range(args.samples)]
        budgets = tuple(lengths.length(s, j) for s in serials for j in range(args.samples))
        params = SamplingParams(n=1, max_new_tokens=max(budgets), max_new_tokens_each=budgets, seed=it)
        start = time.perf_counter()
        engine.generate(rows, params)  # type: ignore[attr-defined]
        seconds.append(time.perf_counter() - start)
    return seconds


def drawn_lengths(
    engine: object, want: dict[int, int], segment: int
) -> Callable[
    [list[tuple[int, PartialResponse]], list[list[int]], SamplingParams], Callable[[], list[list[Completion]]]
]:
    """A segment round's ``Submit`` straight to ``engine`` where each response's drawn length (``want``,
    by its id) stands in for a stop token: each row's budget is min(segment, what is left of it), and
    its segment ends with "stop" once it is reached."""

    def submit(
        rows: list[tuple[int, PartialResponse]], inputs: list[list[int]], params: SamplingParams
    ) -> Callable[[], list[list[Completion]]]:
        budgets = tuple(min(segment, want[id(r)] - len(r.token_ids)) for _, r in rows)
        params = dataclasses.replace(params, max_new_tokens=max(budgets), max_new_tokens_each=budgets)
        segments = engine.generate(inputs, params)  # type: ignore[attr-defined]
        for (_, r), (one,) in zip(rows, segments, strict=True):
            if len(r.token_ids) + len(one.token_ids) >= want[id(r)]:
                one.finish_reason = "stop"
        return lambda: segments

    return submit


def continuous(engine: object, lengths: Lengths, args: argparse.Namespace) -> tuple[list[float], list[int]]:
    pool = PartialPool(
        args.samples, args.segment, args.max_new_tokens, max_staleness=1_000_000, size=2 * args.prompts
    )
    seconds, rounds_per_it = [], []
    for it in range(args.iterations):
        start = time.perf_counter()
        pool.top_up(list(range(pool.next_serial, pool.next_serial + pool.missing())))  # index = serial
        want = {
            id(g.responses[j]): lengths.length(g.serial, j) for g in pool.groups for j in range(args.samples)
        }
        rounds = 0
        while pool.unfinished() and (rounds == 0 or pool.complete() < args.prompts):
            params = SamplingParams(n=1, seed=it * 1000 + rounds)
            collect_round(
                pool, submit_round(pool, lengths.prompt, drawn_lengths(engine, want, args.segment), params)
            )
            rounds += 1
        pool.take(args.prompts)
        seconds.append(time.perf_counter() - start)
        rounds_per_it.append(rounds)
    return seconds, rounds_per_it


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--median", type=float, default=16.0, help="median response length (tokens)")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (1.0: p99/p50 about 10)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--segment", type=int, default=16, help="rollout.partial.segment_tokens")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = Lengths(args)
    drawn = sorted(
        lengths.length(s, j) for s in range(args.iterations * args.prompts) for j in range(args.samples)
    )
    p50, p99 = median(drawn), drawn[min(len(drawn) - 1, int(0.99 * len(drawn)))]
    engine = make_engine()
    sync = synchronous(engine, lengths, args)
    cont, rounds = continuous(engine, lengths, args)
    result = {
        "lengths": {"p50": p50, "p99": p99, "p99/p50": p99 / p50, "max": drawn[-1]},
        "sync_s_per_iteration": mean(sync[1:]),
        "continuous_s_per_iteration": mean(cont[1:]),
        "continuous/sync": mean(cont[1:]) / mean(sync[1:]),
        "continuous_rounds_per_iteration": mean(rounds[1:]),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
