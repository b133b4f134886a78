"""Per-phase time of one GRPO iteration at two model sizes, and the train phase beside a bare
megatron-core forward/backward loop over the same micro-batches, in the same run.

The job is the demo's (examples/demo.yaml: arithmetic task, 16 prompts x 16 samples, character
tokenizer, EP2 over 2 ranks, embedded transformers engine on every rank) with the KL penalty on
(k3, beta 0.02 as in ../shared/GUIDE.md section 7) so the reference pass runs too. Two sizes of its
Qwen3-MoE policy, both from random initialisation (``model.hf_overrides``):

- ``demo``: the demo's model (hidden 128, 2 layers, 4 experts top-2): 0.9M parameters;
- ``20m``:  hidden 256, 4 layers, 4 heads of 64, 8 experts top-2 of width 768: about 20M parameters
  (the 32-token vocabulary is padded to 128 inside megatron, as usual).

Each size is one ``torch.distributed.run`` launch of 2 ranks (this script with ``--worker``) that
builds the real job (``training/job.py:build_job``) and runs the trainer's own phase functions in
the order of ``training/grpo.py:run_iteration`` (itself: rollout + reward rounds, ``job.memory.to_trainer``
(onload, a no-op unless the engines share the trainer's memory or train.offload_trainer), ``build_samples`` + ``plan_update`` (advantages),
``logprob_pass`` (reference; old-policy too with ``--updates`` > 1), ``update_policy`` (train),
``sync_weights`` (sync: the export stream into the engines, row sync_stream, then the mismatch
probe), from ``training/phases/``). Evaluation, metrics and
checkpoints are not timed. The first
``--warmup`` iterations are excluded; the table shows, per phase, the median over ``--iters``
iterations of rank 0's wall time (the phases end in collectives, so ranks agree to a few ms) and of
rank 0's CPU time. On a machine shared with other work the wall times swing by 2x between
iterations; CPU time hardly moves, so it is printed beside every wall figure.

After every iteration the same micro-batches (``plan.rows`` collated once, outside the clock) go
through a bare loop on the same GPTModel + DDP + optimizer: per mini-batch ``zero_grad``, one plain
``get_forward_backward_func()`` call whose loss is megatron's own per-token cross entropy
(``GPTModel(..., labels=...)``) summed over the response tokens and divided by their global count,
then ``optimizer.step()``. What it leaves out is the GRPO bookkeeping of the train phase: collation,
our vocab-parallel logprobs with entropy, the clipped-surrogate + KL loss and its metrics, the
metric reduction, and the LR scheduler. Both are measured as tokens per second over the same
tokens (every sample's input positions, whole batch, both ranks); the last lines print the ratio
ours / bare per size (1.00 = the bookkeeping costs nothing; below 1 = ours is slower): the median of
the per-iteration wall-clock ratios, and the same from both ranks' CPU seconds.

    .venv/bin/python bench/grpo_iteration.py [--sizes demo 20m] [--warmup 1] [--iters 5] [--updates 1]

About 70 s on 2 cores (two launches of ~35 s: start-up, build, 6 iterations each).

Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO = REPO_ROOT / "examples" / "demo.yaml"
WORLD_SIZE = 2

SIZES: dict[str, dict[str, Any]] = {
    "demo": {},
    "20m": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 768,
        "moe_intermediate_size": 768,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
}

# Rows of the table, in loop order; "iteration" is the wall time of the whole timed body.
PHASES = (
    "rollout",
    "reward",
    "onload",
    "advantages",
    "ref_logprob",
    "old_logprob",
    "train",
    "sync",
    "sync_stream",
    "iteration",
)


def job_overrides(size: str, args: argparse.Namespace, run_dir: str) -> list[str]:
    """Command-line overrides of examples/demo.yaml for one bench run."""
    overrides = [
        f"logging.run_dir={run_dir}",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
        "logging.samples_interval=0",
        "checkpoint.save_interval=0",
        "data.num_train_prompts=2048",
        "data.num_eval_prompts=8",  # only the mismatch probe reads them (rollout.probe_batch of 4)
        f"train.iterations={args.warmup + args.iters}",
        f"train.updates_per_iteration={args.updates}",
        f"algorithm.kl.beta={args.kl_beta}",
    ]
    overrides += [f"model.hf_overrides.{k}={v}" for k, v in SIZES[size].items()]
    return overrides


# ---- per-rank worker (under torch.distributed.run) ------------------------------------------------
def _bare_step_func(normalizer: float) -> Any:
    """megatron forward-step function: GPTModel's own per-token cross entropy (labels given), summed
    over the response tokens and divided by ``normalizer``."""
    import torch

    from grpo_megatron.training.batching import LossInputs
    from grpo_megatron.training.packing import packed_seq_params

    def step(data_iterator: Iterator[Any], model_chunk: Any) -> tuple[Any, Any]:
        mb = next(data_iterator)
        b, s = mb.tokens_bs.shape
        if mb.packed is None:
            position_ids_bs = torch.arange(s).expand(b, s)
            loss_bs = model_chunk(mb.tokens_bs, position_ids_bs, None, labels=mb.labels_bs)
            mask_bs = LossInputs.of(mb).mask_bs
        else:  # the same packed sequence as the train phase (train.packing)
            params = packed_seq_params(mb.packed, s, mb.tokens_bs.device)
            loss_bs = model_chunk(
                mb.tokens_bs, mb.position_ids_bs, None, labels=mb.labels_bs, packed_seq_params=params
            )
            mask_bs = mb.packed.pack(LossInputs.of(mb).mask_bs)[None]

        def loss_func(output_bs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
            loss = (output_bs.float() * mask_bs).sum() / normalizer
            return loss, torch.ones((), dtype=torch.int), {"loss": loss.detach()}

        return loss_bs, loss_func

    return step


def bare_train_step(job: Any, microbatches_per_minibatch: list[list[Any]]) -> float:
    """One optimizer step per mini-batch over ready micro-batches: plain megatron-core forward/backward
    with megatron's own cross entropy, no GRPO bookkeeping (see the module docstring). Returns this
    rank's share of the loss (the last mini-batch's), a sanity check that it trained on real data."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from grpo_megatron.training.batching import LossInputs

    model, ps = job.policy.model, job.ps
    model.train()
    for microbatches in microbatches_per_minibatch:
        # The global count of response tokens: this mini-batch's loss is a token mean, as ours.
        count_1 = torch.tensor([sum(float(LossInputs.of(mb).mask_bs.sum()) for mb in microbatches)])
        if ps.dp > 1:
            dist.all_reduce(count_1, group=ps.dp_group)
        job.policy.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=_bare_step_func(max(float(count_1), 1.0)),
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=len(microbatches),
            seq_length=max(mb.tokens_bs.shape[1] for mb in microbatches),
            micro_batch_size=max(mb.tokens_bs.shape[0] for mb in microbatches),
            forward_only=False,
        )
        job.policy.optimizer.step()
    return sum(float(m["loss"]) for m in losses)


class WallCpuTimer:
    """``training/timing.py:PhaseTimer``'s interface (``with timer(name):``, accumulating), recording both
    wall seconds and this process's CPU seconds (``time.process_time``: all its threads; the reward
    pool's worker processes are not in it). CPU time is what another job on a shared machine does not
    inflate, so it gives the steadier ratio."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - wall
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - cpu


def one_iteration(job: Any, source: Any, probe: Any, it: int, timer: WallCpuTimer) -> tuple[Any, Any]:
    """The trainer's own iteration (``training/grpo.py:run_iteration``: evaluation and bookkeeping left
    out), timed by ``timer``; returns (samples, plan). ``timer.wall["sync_stream"]`` is the export
    stream's share of the sync phase (the fleet's own ``sync/seconds``; the rest is the probe)."""
    from grpo_megatron.training.grpo import run_iteration

    with timer("iteration"):
        result = run_iteration(job, source, probe, it, timer)
    timer.wall["sync_stream"] = result.metrics["sync/seconds"]
    return result.samples, result.plan


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import destroy_distributed, world_size_from_env
    from grpo_megatron.planner.model_states import total_params
    from grpo_megatron.training.batching import collate
    from grpo_megatron.training.grpo import job_probe
    from grpo_megatron.training.job import build_job
    from grpo_megatron.training.sources import group_source

    cfg = load_config(DEMO, job_overrides(args.size, args, args.run_dir))
    validate(cfg, world_size_from_env())
    job = build_job(cfg, with_reference=cfg.algorithm.kl.enabled)
    try:
        sampler = job.make_sampler()
        probe = job_probe(job)
        job.sync_engines(0, probe)  # the engines start from the trainer's weights
        source = group_source(job, sampler, None)  # the run's own source of scored groups
        source.start(0)
        skipped = [] if job.reference is not None or job.reference_is_base else ["ref_logprob"]
        if job.fleet.placement is None or not job.fleet.placement.swaps_engine_memory:
            skipped.append("onload")  # nothing moves (rollout/placement.py's phases)
        if not (cfg.train.updates_per_iteration > 1 and cfg.train.old_logprobs == "trainer"):
            skipped.append("old_logprob")
        records: list[dict[str, Any]] = []
        for it in range(1, args.warmup + args.iters + 1):
            timer = WallCpuTimer()
            dist.barrier()
            samples, plan = one_iteration(job, source, probe, it, timer)
            # The same micro-batches as the train phase, collated outside the clock.
            microbatches = [
                [collate(samples, r, job.pad_id, packed=plan.packed) for r in rows] for rows in plan.rows
            ]
            dist.barrier()
            with timer("bare_train"):
                bare_loss = bare_train_step(job, microbatches)
            per_rank: list[Any] = [None] * job.ps.world_size
            dist.all_gather_object(per_rank, ({k: timer.cpu[k] for k in ("train", "bare_train")}, bare_loss))
            records.append(
                {
                    "iteration": it,
                    "warmup": it <= args.warmup,
                    "wall_s": timer.wall,
                    "cpu_s": timer.cpu,
                    "train_cpu_s_all_ranks": sum(c["train"] for c, _ in per_rank),
                    "bare_cpu_s_all_ranks": sum(c["bare_train"] for c, _ in per_rank),
                    "bare_loss": sum(loss for _, loss in per_rank),
                    "tokens": sum(s.length for s in samples),
                    "samples": len(samples),
                    "local_microbatches": sum(len(m) for m in microbatches),
                }
            )
        if job.ps.rank == 0:
            result = {"size": args.size, "params": total_params(job.hf), "skipped": skipped}
            Path(args.out).write_text(json.dumps(result | {"records": records}))
    finally:
        job.close()
    destroy_distributed()


# ---- driver --------------------------------------------------------------------------------------
def launch(size: str, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One 2-rank run of ``size``; returns rank 0's records."""
    out = tmp / f"{size}.json"
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        TORCH_COMPILE_DISABLE="1",
        WANDB_SILENT="true",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(WORLD_SIZE),
        __file__,
        "--worker",
        "--size",
        size,
        "--out",
        str(out),
        "--run-dir",
        str(tmp / f"run_{size}"),
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
        "--updates",
        str(args.updates),
        "--kl-beta",
        str(args.kl_beta),
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0 or not out.is_file():
        sys.exit(
            f"size {size} failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    result = json.loads(out.read_text())
    result["launch_s"] = time.perf_counter() - start
    return result


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over the measured (non-warm-up) iterations."""
    measured = [r for r in result["records"] if not r["warmup"]]

    def median(get: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(get(r) for r in measured)

    def median_of(where: str, key: str) -> float:
        return statistics.median(r[where].get(key, 0.0) for r in measured)

    names = sorted({k for r in measured for k in r["wall_s"]})
    wall_ratios = [r["wall_s"]["bare_train"] / r["wall_s"]["train"] for r in measured]
    return {
        "wall_ms": {k: median_of("wall_s", k) * 1e3 for k in names},
        "cpu_ms": {k: median_of("cpu_s", k) * 1e3 for k in names if k in measured[0]["cpu_s"]},
        "tokens": median(lambda r: r["tokens"]),
        "samples": measured[0]["samples"],
        "microbatches": measured[0]["local_microbatches"],
        "ours_tps": median(lambda r: r["tokens"] / r["wall_s"]["train"]),
        "bare_tps": median(lambda r: r["tokens"] / r["wall_s"]["bare_train"]),
        "wall_ratio": statistics.median(wall_ratios),
        "wall_ratios": wall_ratios,
        "cpu_ratio": median(lambda r: r["bare_cpu_s_all_ranks"] / r["train_cpu_s_all_ranks"]),
        "bare_loss": median(lambda r: r["bare_loss"]),
        "skipped": result["skipped"],
    }


def print_report(results: dict[str, dict[str, Any]], args: argparse.Namespace, wall_s: float) -> None:
    summaries = {size: summarize(r) for size, r in results.items()}
    first = next(iter(summaries.values()))
    print(
        f"GRPO iteration: examples/demo.yaml at EP2 on {WORLD_SIZE} ranks (1 thread each), "
        f"{first['samples']} responses per iteration, KL beta {args.kl_beta:g}, {args.updates} update(s); "
        f"median of {args.iters} iterations after {args.warmup} warm-up"
    )
    print("ms per phase, wall clock / rank 0's CPU time (the reward pool's workers not included)")
    width = 20
    headers = [f"{s} ({results[s]['params'] / 1e6:.1f}M params)" for s in summaries]
    print(f"{'phase':<14}" + "".join(f"{h:>{width}}" for h in headers))
    for phase in (*PHASES, "bare_train"):
        cells = []
        for s in summaries.values():
            if phase in s["skipped"] or phase not in s["wall_ms"]:
                cells.append(f"{'-':>{width}}")
            else:
                cpu = f"{s['cpu_ms'][phase]:>7.1f}" if phase in s["cpu_ms"] else f"{'-':>7}"
                cells.append(f"{s['wall_ms'][phase]:>{width - 9}.1f} /{cpu}")
        print(f"{phase:<14}" + "".join(cells))
    print(f"{'tokens/iter':<14}" + "".join(f"{s['tokens']:>{width}.0f}" for s in summaries.values()))
    print(f"{'launch (s)':<14}" + "".join(f"{r['launch_s']:>{width}.1f}" for r in results.values()))
    print(f"total wall time {wall_s:.0f} s")
    print("train phase vs a bare megatron-core forward/backward + optimizer step on the same micro-batches")
    print("(tokens/s over the whole batch, both ranks, wall clock; CPU: both ranks' CPU seconds bare / ours)")
    for size, s in summaries.items():
        print(
            f"  {size:<5} ours {s['ours_tps']:7.0f} tok/s  bare {s['bare_tps']:7.0f} tok/s"
            f"  CPU {s['cpu_ratio']:.2f}"
            f"  ({s['microbatches']} micro-batch(es) per rank; bare cross entropy {s['bare_loss']:.2f})"
        )
    for size, s in summaries.items():
        each = " ".join(f"{r:.2f}" for r in s["wall_ratios"])
        print(
            f"ratio {size} ({results[size]['params'] / 1e6:.1f}M): train tokens/s ours / bare = "
            f"{s['wall_ratio']:.2f} wall (iterations: {each}), {s['cpu_ratio']:.2f} CPU time"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--warmup", type=int, default=1, help="iterations excluded from the medians")
    parser.add_argument("--iters", type=int, default=5, help="measured iterations")
    parser.add_argument("--updates", type=int, default=1, help="train.updates_per_iteration")
    parser.add_argument("--kl-beta", type=float, default=0.02, help="algorithm.kl.beta (0: no reference)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per launch")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grpo_iter_bench_") as tmp:
        results = {size: launch(size, Path(tmp), args) for size in args.sizes}
    print_report(results, args, time.perf_counter() - start)


if __name__ == "__main__":
    main()
