"""The embedded rollout engine (rollout/embedded.py) beside transformers' own ``model.generate`` on
the same model, weights, prompts and batch, in the same run (issue 30: the engine at least as fast).

The default case is the demo's rollout: 16 prompts x 16 samples of 3-digit reversed addition, at most
6 new tokens, temperature 1, no top-k / top-p, EOS stops a row; the 0.9M-parameter Qwen3-MoE of
examples/demo/ in float32 on one CPU thread (the demo's OMP_NUM_THREADS=1), with the weights of a
saved cold start (``--weights``: a folder of safetensors as ``grpo_megatron sft`` exports it, e.g.
bench/overhead.py's runs/bench_overhead/sft/hf) or, without one, random weights (a random model
rarely stops early, so every call runs all the steps).

Both sides get the weights the same way the trainer gives them (``update_weights`` for the engine;
the same tensors loaded into a transformers model built with the engine's own ``model_kwargs``), and
the same sampling: ``generate(do_sample=True, temperature, top_k=0, top_p=1.0, max_new_tokens,
eos_token_id, pad_token_id)`` on left-padded prompts repeated n times. ``generate`` returns only the
tokens (what TRL's GRPOTrainer takes from it); the engine also returns each token's logprob and, for
an MoE model, its routes when ``--routes`` (routing replay on) -- the flag the fleet passes. Calls
alternate between the two; each figure is the median wall time over ``--repeats`` calls after
``--warmup`` calls of each.

    .venv/bin/python bench/embedded_vs_generate.py [--weights DIR] [--prompts 16] [--n 16] [--repeats 20]

Not a test: the numbers depend on the machine and on what else runs on it (compare the ratio).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO_ROOT / "examples" / "demo"


def load_weights(folder: Path | None) -> dict[str, torch.Tensor] | None:
    if folder is None:
        return None
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(str(path))
    if not tensors:
        raise SystemExit(f"--weights {folder}: no *.safetensors there")
    return tensors


def demo_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    from grpo_megatron.data.generators import arithmetic

    rng = random.Random(seed)
    problems = [arithmetic(rng, digits=3, reverse_answer=True, reverse_operands=True) for _ in range(count)]
    return [list(tokenizer(p.prompt)["input_ids"]) for p in problems]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=DEMO_MODEL, help="folder with config.json and the tokenizer"
    )
    parser.add_argument(
        "--weights", type=Path, default=None, help="safetensors folder (default: random weights)"
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=16, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--routes", action="store_true", help="the engine records MoE routes (routing replay on)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the demo runs 1 per rank)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_megatron.rollout.embedded import EmbeddedEngine
    from grpo_megatron.rollout.engine import SamplingParams

    torch.set_num_threads(args.threads)
    hf = json.loads((args.model / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    engine = EmbeddedEngine(hf, tokenizer=tokenizer, record_routes=args.routes)
    weights = load_weights(args.weights)
    if weights is None:
        weights = {name: t.clone() for name, t in engine.model.state_dict().items()}
    else:
        engine.update_weights(sorted(weights.items()), version=0, last=True)
    model = AutoModelForCausalLM.from_config(engine.model.config, **engine.model_kwargs).eval()
    model.load_state_dict(engine.model.state_dict())
    eos = int(hf["eos_token_id"])
    pad = int(hf.get("pad_token_id") or 0)
    prompts = demo_prompts(tokenizer, args.prompts, seed=0)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=(eos,),
        seed=1,
    )

    rows = [p for p in prompts for _ in range(args.n)]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    gen = torch.Generator().manual_seed(1)

    def run_engine() -> None:
        engine.generate(prompts, params)

    @torch.no_grad()
    def run_generate() -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=args.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
            )

    for _ in range(args.warmup):
        run_engine()
        run_generate()
    engine_s, generate_s = [], []
    for _ in range(args.repeats):
        engine_s.append(timed(run_engine))
        generate_s.append(timed(run_generate))
    e, g = statistics.median(engine_s), statistics.median(generate_s)
    weights_note = args.weights or "random weights"
    print(
        f"{args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} new tokens, {weights_note}, "
        f"{args.threads} thread(s), routes {'on' if args.routes else 'off'}; median of {args.repeats} calls"
    )
    print(f"embedded engine   {e * 1000:8.1f} ms")
    print(f"model.generate    {g * 1000:8.1f} ms")
    print(f"engine / generate = {e / g:.2f}  (<= 1.00: the engine is at least as fast)")


if __name__ == "__main__":
    main()
