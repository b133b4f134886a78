"""Where an iteration of the demo's GRPO goes besides training: per phase its mean wall time and its
ratio to the train phase of the same run, and the whole iteration / train ratio (issue 30).

The job is the demo's (examples/demo.yaml: 3-digit reversed addition, 16 prompts x 16 samples, the
0.9M-parameter Qwen3-MoE of examples/demo/, EP2 over 2 ranks, embedded engine, sandboxed reward
workers) started from a saved SFT cold start, as ``make demo`` starts its GRPO. The cold start is
``--cold-start`` (default runs/bench_overhead/sft/hf); when it is absent this script first makes it
with the demo's own SFT command (examples/demo.sh, same seed), a few minutes on 2 cores, and keeps it
for the next runs. Then one ``torchrun`` launch of ``grpo_megatron train`` for ``--iters`` iterations
(``train.iterations`` set to it: the learning-rate schedule is shorter than the demo's, which does
not change what a phase costs; evaluation only before the first and after the last iteration).

The figures are the trainer's own: the ``time/<phase>`` keys of metrics.jsonl (training/grpo.py's
PhaseTimer; rank 0's wall clock). The first ``--warmup`` iterations are left out. "iteration" is
``time/iteration`` less ``time/eval`` (the last iteration evaluates); "other" is what the named phases
leave of it (metrics, samples, checkpoint bookkeeping). ``sync`` is split by whether that iteration's
sync ran the mismatch probe (``rollout.probe_interval``): "sync (probe)" and "sync (no probe)" are
means over those iterations only, "sync" the mean over all.

    .venv/bin/python bench/overhead.py [--iters 60] [--warmup 3] [key=value overrides for train ...]

Not a test: the numbers depend on the machine and on what else runs on it (compare ratios of one run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO = REPO_ROOT / "examples" / "demo.yaml"
# Rows in loop order (training/grpo.py:run_iteration); phases a run never timed are left out.
PHASES = ("rollout", "reward", "onload", "advantages", "ref_logprob", "old_logprob", "train", "sync")


def torchrun(python: str, *args: str, log: Path) -> float:
    """Run ``grpo_megatron <args>`` on 2 local ranks as examples/demo.sh does; its wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1", "WANDB_SILENT": "true"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "grpo_megatron",
        *args,
    ]
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}); its output: {log}")
    return time.perf_counter() - start


def ensure_cold_start(python: str, cold_start: Path, seed: int) -> None:
    """The demo's SFT cold start in ``cold_start`` (its safetensors), made once."""
    if any(cold_start.glob("*.safetensors")):
        return
    run_dir = cold_start.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[overhead] making the demo's cold start in {cold_start} (once)", flush=True)
    seconds = torchrun(
        python,
        "sft",
        str(DEMO),
        f"train.seed={seed}",
        f"logging.run_dir={run_dir}",
        f"sft.output_dir={cold_start}",
        log=run_dir / "sft.log",
    )
    print(f"[overhead] cold start made in {seconds:.0f} s", flush=True)


def read_iterations(metrics_path: Path, warmup: int) -> list[dict[str, Any]]:
    """metrics.jsonl's training iterations (1, 2, ...) after the first ``warmup``."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["iteration"] > warmup and r.get("time/iteration") is not None]


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def breakdown(rows: list[dict[str, Any]]) -> list[tuple[str, float, int]]:
    """(row name, mean seconds, iterations averaged) for the table, "iteration" last."""
    for r in rows:
        r["time/iteration_net"] = float(r["time/iteration"]) - float(r.get("time/eval") or 0.0)
        named = sum(float(r.get(f"time/{p}") or 0.0) for p in PHASES)
        r["time/other"] = r["time/iteration_net"] - named
    table: list[tuple[str, float, int]] = []
    for phase in PHASES:
        mean = _mean(rows, f"time/{phase}")
        if mean is None or (phase != "train" and mean < 1e-4):
            continue
        table.append((phase, mean, len(rows)))
        if phase == "sync":
            probed = [r for r in rows if r.get("mismatch/probe_tokens") is not None]
            plain = [r for r in rows if r.get("mismatch/probe_tokens") is None]
            for name, subset in (("sync (probe)", probed), ("sync (no probe)", plain)):
                if subset:
                    table.append((name, _mean(subset, "time/sync") or 0.0, len(subset)))
    table.append(("other", _mean(rows, "time/other") or 0.0, len(rows)))
    table.append(("iteration", _mean(rows, "time/iteration_net") or 0.0, len(rows)))
    return table


def print_table(table: list[tuple[str, float, int]]) -> None:
    train = next(mean for name, mean, _ in table if name == "train")
    print(f"{'phase':<17} {'mean s':>8} {'/ train':>8} {'iters':>6}")
    for name, mean, n in table:
        print(f"{name:<17} {mean:8.4f} {mean / train:8.2f} {n:6d}")
    iteration = table[-1][1]
    print(f"iteration / train = {iteration / train:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=60, help="GRPO iterations to run")
    parser.add_argument("--warmup", type=int, default=3, help="first iterations left out of the means")
    parser.add_argument("--seed", type=int, default=1234, help="train.seed of the cold start and of GRPO")
    parser.add_argument(
        "--cold-start",
        type=Path,
        default=REPO_ROOT / "runs" / "bench_overhead" / "sft" / "hf",
        help="the demo's SFT export (made here when it holds no safetensors)",
    )
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "bench_overhead" / "grpo")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the ranks")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for the GRPO run")
    args = parser.parse_args()
    if args.iters <= args.warmup:
        parser.error("--iters must exceed --warmup")
    ensure_cold_start(args.python, args.cold_start.resolve(), args.seed)
    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    seconds = torchrun(
        args.python,
        "train",
        str(DEMO),
        f"train.seed={args.seed}",
        f"train.iterations={args.iters}",
        "train.eval_interval=0",
        f"logging.run_dir={run_dir}",
        f"model.hf_path={args.cold_start.resolve()}",
        "logging.wandb_mode=disabled",
        *args.overrides,
        log=run_dir.parent / "grpo.log",
    )
    rows = read_iterations(run_dir / "metrics.jsonl", args.warmup)
    print(
        f"[overhead] {args.iters} iterations in {seconds:.0f} s (launch, build and 2 evaluations included); "
        f"means over iterations {args.warmup + 1}-{args.iters}"
    )
    print_table(breakdown(rows))


if __name__ == "__main__":
    main()
