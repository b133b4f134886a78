"""What ``rollout.true_on_policy`` costs: the same GRPO job with the switch off (the embedded engine, a
transformers model with a KV cache, and the trainer in its plain numerics) and on (the trainer's own
model generates, every prefix recomputed per decoded token, every product and attention
batch-invariant), one after the other in one run, for the demo's model and a wider one.

Each job: ``examples/demo.yaml`` on 2 ranks (EP2), bf16, random weights with a length reward (so that
every update moves them), ``--iterations`` iterations; per job the medians over iterations 2.. of
``time/rollout`` (and the rollout's response tokens per second of it) and ``time/train``, and the
largest ``mismatch/logprob_abs_diff_max`` of the run. Ratios are switch on / switch off.

    .venv/bin/python bench/true_on_policy.py [--iterations 6] [--skip-wide]

Not a test: the figures depend on the machine and its load (compare the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "train.prompts_per_iteration=8",
    "rollout.n_samples_per_prompt=8",
    "data.num_train_prompts=256",
    "data.num_eval_prompts=8",
    "train.micro_batch_size=32",
    "train.eval_interval=0",
    "logging.wandb_mode=disabled",
    "logging.progress_bar=false",
    "parallel.backend=gloo",
    "model.dtype=bfloat16",
    "train.lr=1e-3",
    "reward.components=[{name: len, function: length, kwargs: {target_chars: 6}}]",
]
WIDE = [
    "model.hf_overrides.hidden_size=512",
    "model.hf_overrides.intermediate_size=1024",
    "model.hf_overrides.moe_intermediate_size=512",
    "model.hf_overrides.num_hidden_layers=4",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(run_dir: Path, overrides: list[str], iterations: int) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "grpo_megatron",
        "train",
        str(REPO / "examples" / "demo.yaml"),
        *COMMON,
        f"train.iterations={iterations}",
        f"logging.run_dir={run_dir}",
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", WANDB_SILENT="true")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"job failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]


def summary(records: list[dict]) -> dict[str, float]:
    later = records[1:] or records
    tokens = [r["response_len/mean"] * 8 * 8 / r["time/rollout"] for r in later]
    return {
        "rollout_s": statistics.median(r["time/rollout"] for r in later),
        "rollout_tokens_per_s": statistics.median(tokens),
        "train_s": statistics.median(r["time/train"] for r in later),
        "mismatch_max": max(r.get("mismatch/logprob_abs_diff_max", float("nan")) for r in records),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--skip-wide", action="store_true")
    args = parser.parse_args()
    models: dict[str, list[str]] = {"demo": []} | ({} if args.skip_wide else {"wide": WIDE})
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_true_on_policy_") as tmp:
        for name, extra in models.items():
            got = {}
            for switch in ("false", "true"):
                records = run_job(
                    Path(tmp) / f"{name}-{switch}",
                    [*extra, f"rollout.true_on_policy={switch}"],
                    args.iterations,
                )
                got[switch] = summary(records)
                print(json.dumps({"model": name, "true_on_policy": switch, **got[switch]}), flush=True)
            off, on = got["false"], got["true"]
            rows.append((name, off, on))
    print(
        "\n| model | rollout tokens/s off | on | on/off | train step s off | on | on/off "
        "| mismatch max off | on |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, off, on in rows:
        print(
            f"| {name} | {off['rollout_tokens_per_s']:.0f} | {on['rollout_tokens_per_s']:.0f} | "
            f"{on['rollout_tokens_per_s'] / off['rollout_tokens_per_s']:.2f} | {off['train_s']:.2f} | "
            f"{on['train_s']:.2f} | {on['train_s'] / off['train_s']:.2f} | {off['mismatch_max']:.3g} | "
            f"{on['mismatch_max']:.3g} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
