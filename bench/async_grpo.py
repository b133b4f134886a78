"""Asynchronous vs synchronous GRPO iteration time, measured in one run (issue 28's benchmark).

Both arms are the same job (examples/demo.yaml's model and task, one trainer process with one thread,
its embedded engine in a process of its own with one thread: rollout.embedded_process; with
--engine sglang the real SGLang engine, colocated) and differ only in train.max_staleness: 0 (the synchronous schedule: generate, then train) and 1 (the engine
generates iteration k+1's batch while the trainer trains iteration k). The batch is sized so that the
rollout and train phases take similar time (rollout.max_new_tokens), which is where overlapping them
pays most. Reported: each arm's mean seconds per phase and per iteration (first iterations, with
their start-up costs, and the last, with its evaluation, left out) and the ratio async / sync.

Timings on a shared machine are distorted by whatever else runs there; the ratio of two arms measured
back to back (and, with --repeats, interleaved) is what to read.

    python bench/async_grpo.py                     # ~2 minutes on 2 cores
    python bench/async_grpo.py --repeats 2 --out bench-async.json
    python bench/async_grpo.py --engine sglang --max-new-tokens 48   # the real SGLang engine; SGLang
                                                   # refuses to pass the demo model's 64-token context
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parent.parent
PHASES = ("rollout", "reward", "advantages", "train", "sync")
ENGINES = {
    "embedded": ["rollout.embedded_process=true", "rollout.embedded_process_threads=1"],
    # SGLang's scheduler is a process of its own already; synchronous, the colocated engine releases
    # its memory for training and takes it back (rollout/placement.py), asynchronous it keeps it.
    "sglang": ["rollout.engine=sglang"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_arm(run_dir: Path, max_staleness: int, args: argparse.Namespace) -> list[dict[str, float]]:
    """One training run; its metrics.jsonl records of the iterations after the run's first."""
    overrides = [
        "parallel.ep=1",
        "parallel.backend=gloo",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
        f"logging.run_dir={run_dir}",
        *ENGINES[args.engine],
        f"train.max_staleness={max_staleness}",
        f"train.iterations={args.iterations}",
        f"train.prompts_per_iteration={args.prompts}",
        f"rollout.n_samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"train.micro_batch_size={args.prompts * args.samples}",
        "data.num_train_prompts=4096",
        "data.num_eval_prompts=4",
        "rollout.probe_interval=100000",
        "checkpoint.save_interval=0",
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TORCH_COMPILE_DISABLE="1",
        WANDB_SILENT="true",
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "grpo_megatron",
        "train",
        str(REPO / "examples" / "demo.yaml"),
        *overrides,
    ]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0:
        raise SystemExit(
            f"the max_staleness={max_staleness} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    records = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    return [r for r in records if r["iteration"] >= 1]


def summarize(records: list[dict[str, float]], warmup: int) -> dict[str, float]:
    """Mean seconds per phase and per iteration (without its evaluation) over the steady iterations."""
    steady = [r for r in records[warmup:-1]]
    if not steady:
        raise SystemExit(f"no steady iterations: raise --iterations above --warmup + 1 ({warmup + 1})")
    out = {p: mean(r.get(f"time/{p}") or 0.0 for r in steady) for p in PHASES}
    out["iteration"] = mean(r["time/iteration"] - (r.get("time/eval") or 0.0) for r in steady)
    out["staleness_max"] = max(r.get("async/staleness/max") or 0.0 for r in steady)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=10, help="iterations per run (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="first iterations left out (default 2)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per iteration (default 8)")
    parser.add_argument("--samples", type=int, default=16, help="responses per prompt (default 16)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="response length: sets the rollout's share of the iteration (default 64)",
    )
    parser.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="embedded",
        help="embedded (in a process of its own, default) or sglang (the real engine, colocated)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="sync/async pairs, interleaved (default 1)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run (default 900)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    arms: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        for repeat in range(args.repeats):
            for name, staleness in (("sync", 0), ("async", 1)):
                records = run_arm(Path(tmp) / f"{name}-{repeat}", staleness, args)
                arms[name].append(summarize(records, args.warmup))
    result = {name: {k: mean(s[k] for s in runs) for k in runs[0]} for name, runs in arms.items()}
    ratio = result["async"]["iteration"] / result["sync"]["iteration"]
    print(f"{'seconds':<12}" + "".join(f"{p:>11}" for p in (*PHASES, "iteration")))
    for name, row in result.items():
        print(f"{name:<12}" + "".join(f"{row[p]:>11.3f}" for p in (*PHASES, "iteration")))
    print(
        f"iteration time async / sync = {ratio:.3f} (staleness max {result['async']['staleness_max']:.0f}); "
        f"engine {args.engine}, 1 trainer process, one thread each; a shared machine distorts both arms"
    )
    if args.out is not None:
        args.out.write_text(
            json.dumps({"ratio": ratio, **result, "args": vars(args) | {"out": str(args.out)}}, indent=1)
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
