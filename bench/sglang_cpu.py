"""SGLang's real engine on CPU beside the embedded engine, on the same weights, in one run.

Two ratios (each engine timed in this process, alternating, after a warm-up):

- rollout: SGLang's generated tokens per second / the embedded engine's, for the demo's rollout
  (16 prompts x 16 samples, temperature 1, up to 6 new tokens: ``--prompts``, ``--samples``,
  ``--new-tokens``), on the demo's architecture (``--hidden`` widens it);
- sync: seconds to load one full weight version through the SGLang adapter (its colocated transport:
  flattened buckets, CPU shared memory where a GPU has CUDA IPC) / through the embedded engine's
  ``update_weights``, the same tensors in the same buckets.

    python bench/sglang_cpu.py                   # the demo's model (0.9M parameters), fp32
    python bench/sglang_cpu.py --hidden 512      # a wider one (more bytes per sync)

Needs SGLang's CPU kernels (``make setup WHEELHOUSE=...``). Prints one JSON line per measurement
and the two ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo"


def save_model(out: Path, hidden: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The demo's architecture (``hidden`` wide) with random weights, saved beside its tokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    overrides = {} if hidden == 128 else {"hidden_size": hidden, "moe_intermediate_size": 2 * hidden}
    config = AutoConfig.from_pretrained(DEMO, **overrides)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, out / name)
    return load_file(str(out / "model.safetensors"))


def buckets(weights: dict[str, torch.Tensor], count: int) -> list[list[tuple[str, torch.Tensor]]]:
    names = sorted(weights)
    step = -(-len(names) // count)
    return [[(n, weights[n]) for n in names[i : i + step]] for i in range(0, len(names), step)]


def timed_rollout(engine: Any, prompts: list[list[int]], params: Any) -> tuple[float, int]:
    start = time.perf_counter()
    groups = engine.generate(prompts, params)
    return time.perf_counter() - start, sum(len(c.token_ids) for g in groups for c in g)


def timed_sync(engine: Any, parts: list[list[tuple[str, torch.Tensor]]], version: int) -> float:
    start = time.perf_counter()
    for part in parts:
        engine.update_weights(part, version=version, last=False)
    engine.update_weights([], version=version, last=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from grpo_megatron.rollout.config import RolloutConfig
    from grpo_megatron.rollout.embedded import EmbeddedEngine
    from grpo_megatron.rollout.engine import SamplingParams
    from grpo_megatron.rollout.sglang.engine import SGLangEngine
    from grpo_megatron.rollout.sglang.launch import EngineLaunch

    dtype = getattr(torch, args.dtype)
    work = Path(tempfile.mkdtemp(prefix="sglang_cpu_bench_"))
    weights = save_model(work / "model", args.hidden, dtype)
    parts = buckets(weights, args.buckets)
    hf = json.loads((work / "model" / "config.json").read_text())
    engines = {
        "embedded": EmbeddedEngine(hf, dtype=dtype),
        "sglang": SGLangEngine(
            RolloutConfig(engine="sglang"), str(work / "model"), EngineLaunch(args.dtype, device="cpu")
        ),
    }
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(4, 24, (8,), generator=gen).tolist()] for _ in range(args.prompts)]
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.new_tokens, seed=1)
    rollout: dict[str, list[float]] = {name: [] for name in engines}
    sync: dict[str, list[float]] = {name: [] for name in engines}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, engine in engines.items():
            seconds = timed_sync(engine, parts, version=repeat)
            elapsed, tokens = timed_rollout(engine, prompts, params)
            if repeat:
                sync[name].append(seconds)
                rollout[name].append(tokens / elapsed)
                print(json.dumps({"engine": name, "repeat": repeat, "tokens_per_s": tokens / elapsed, "sync_s": seconds}))
    engines["sglang"].shutdown()
    shutil.rmtree(work, ignore_errors=True)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    median = {k: {name: statistics.median(v) for name, v in d.items()} for k, d in (("tps", rollout), ("sync", sync))}
    print(
        f"rollout tokens/s: sglang {median['tps']['sglang']:.0f} / embedded {median['tps']['embedded']:.0f} "
        f"= {median['tps']['sglang'] / median['tps']['embedded']:.2f}"
    )
    print(
        f"sync of {nbytes / 2**20:.1f} MiB: sglang {median['sync']['sglang'] * 1e3:.1f} ms / embedded "
        f"{median['sync']['embedded'] * 1e3:.1f} ms = {median['sync']['sglang'] / median['sync']['embedded']:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
