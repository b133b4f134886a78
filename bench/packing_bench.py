"""Train-phase throughput and activation memory, packed vs padded micro-batches, in one run.

The batch has the long tail of R1-Zero responses, scaled to this machine: response lengths drawn
from a lognormal whose median is ``--max-response / 6``, capped at ``--max-response``, after prompts
of ``--prompt`` tokens (random token ids: the update's cost does not depend on what the tokens say).
The job is examples/demo.yaml at world 1 with the ``20m`` policy of bench/grpo_iteration.py (hidden
256, 4 layers, 8 experts top-2) from random initialisation, micro-batches filled to
``train.max_tokens_per_micro_batch`` (``--budget``). The batch is one data-parallel rank's share.

The padded baseline is the trainer's own (``train.packing=false``): rows sorted longest first and
cut at ``rows x longest <= budget``, which already keeps padding low when the budget holds few rows;
the gain of packing is bounded by ``1 / (1 - padding_frac)`` of the padded plan, plus what fewer
micro-batches and per-row attention save. The first line prints both padding fractions.

Each iteration runs the trainer's own ``phases/advantages.py:plan_update`` +
``phases/train.py:update_policy`` (GRPO loss without KL, one optimizer step; no routing taps: the
synthetic responses carry no engine routes) on that batch twice, once per ``train.packing`` setting, alternating which goes
first; tokens/s counts the real (unpadded) tokens. Activation memory is what autograd saves for the
backward pass (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once while it is
alive): its peak over the train phase, per 1k real tokens of the mean micro-batch (on CPU there is no
allocator peak to read; on CUDA ``torch.cuda.max_memory_allocated`` is printed beside it). The last
lines print the ratios packed / padded.

    .venv/bin/python bench/packing_bench.py [--samples 64] [--max-response 512] [--iters 3]

About 3 minutes on 2 cores. Not a test: the numbers depend on the machine and what else runs on it.
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
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO = REPO_ROOT / "examples" / "demo.yaml"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_iteration import SIZES  # noqa: E402

# grpo_iteration.py's 20M policy, with positions for the long sequences here
POLICY_20M = {**SIZES["20m"], "max_position_embeddings": 4096}


class SavedActivations:
    """Bytes autograd holds for backward: each saved storage counted once while any graph holds it."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}

    def hooks(self) -> Any:
        import torch

        meter = self

        class Held:
            def __init__(self, t: torch.Tensor) -> None:
                self.t = t
                self.key = t.untyped_storage().data_ptr()
                if meter._refs.get(self.key, 0) == 0:
                    meter.live += t.untyped_storage().nbytes()
                    meter.peak = max(meter.peak, meter.live)
                meter._refs[self.key] = meter._refs.get(self.key, 0) + 1
                self.nbytes = t.untyped_storage().nbytes()

            def __del__(self) -> None:
                meter._refs[self.key] -= 1
                if meter._refs[self.key] == 0:
                    del meter._refs[self.key]
                    meter.live -= self.nbytes

        return torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.t)


def synthetic_samples(args: argparse.Namespace, vocab: int) -> list[Any]:
    import torch

    from grpo_megatron.training.batching import make_sample

    gen = torch.Generator().manual_seed(0)
    median = args.max_response / 6
    lengths = (torch.randn(args.samples, generator=gen) * args.sigma).exp() * median
    samples = []
    for n in lengths.round().clamp(1, args.max_response).long().tolist():
        ids = torch.randint(3, vocab, (args.prompt + n,), generator=gen).tolist()
        advantage = float(torch.randn(1, generator=gen))
        samples.append(make_sample(ids[: args.prompt], ids[args.prompt :], [-1.0] * n, advantage))
    return samples


def worker(args: argparse.Namespace) -> None:
    import torch

    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import destroy_distributed, world_size_from_env
    from grpo_megatron.training.job import build_job
    from grpo_megatron.training.phases.advantages import plan_update
    from grpo_megatron.training.phases.logprob import PassSettings
    from grpo_megatron.training.phases.train import GRPOLoss, update_policy
    from grpo_megatron.training.route_replay import RoutingReplay

    overrides = [
        f"logging.run_dir={args.run_dir}",
        "logging.wandb_mode=disabled",
        "logging.progress_bar=false",
        "checkpoint.save_interval=0",
        "parallel.ep=1",
        "data.num_train_prompts=64",
        "data.num_eval_prompts=8",
        f"train.max_tokens_per_micro_batch={args.budget}",
        *(f"model.hf_overrides.{k}={v}" for k, v in POLICY_20M.items()),
    ]
    cfg = load_config(DEMO, overrides)
    validate(cfg, world_size_from_env())
    job = build_job(cfg, with_reference=False)
    alg = job.cfg.algorithm
    loss = GRPOLoss(alg, 0.0, alg.loss_norm_len or job.cfg.rollout.max_new_tokens, old_from_engine=False)
    passes = PassSettings(
        job.ps,
        job.pad_id,
        job.policy.spec.vocab_size,
        job.cfg.rollout.temperature,
        RoutingReplay(alg.routing_replay, job.ps, None),
    )
    try:
        samples = synthetic_samples(args, job.policy.spec.vocab_size)
        real_tokens = sum(s.length for s in samples)
        records = []
        for it in range(args.warmup + args.iters):
            order = (False, True) if it % 2 == 0 else (True, False)
            for packing in order:
                job.cfg.train.packing = packing
                plan = plan_update(job.cfg.train, alg, job.ps, samples)
                meter = SavedActivations()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                wall, cpu = time.perf_counter(), time.process_time()
                with meter.hooks():
                    metrics = update_policy(job.policy, samples, plan, loss, passes, measure_routing=False)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                microbatches = len(plan.all_rows)
                records.append(
                    {
                        "warmup": it < args.warmup,
                        "packing": packing,
                        "wall_s": wall,
                        "cpu_s": cpu,
                        "tokens": real_tokens,
                        "microbatches": microbatches,
                        "padding_frac": metrics["batch/padding_frac"],
                        "tokens_per_microbatch": metrics["batch/tokens_per_microbatch"],
                        "peak_saved_bytes": meter.peak,
                        "real_tokens_per_microbatch": real_tokens / microbatches,
                        "cuda_peak_bytes": torch.cuda.max_memory_allocated()
                        if torch.cuda.is_available()
                        else None,
                        "loss": metrics["loss/policy"],
                    }
                )
        lengths = sorted(len(s.tokens_s) - args.prompt + 1 for s in samples)
        summary = {
            "records": records,
            "response_median": lengths[len(lengths) // 2],
            "response_max": lengths[-1],
        }
        Path(args.out).write_text(json.dumps(summary))
    finally:
        job.close()
    destroy_distributed()


def launch(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TORCH_COMPILE_DISABLE="1", WANDB_SILENT="true")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        __file__,
        "--worker",
        "--out",
        str(out),
        "--run-dir",
        str(tmp / "run"),
        "--samples",
        str(args.samples),
        "--prompt",
        str(args.prompt),
        "--max-response",
        str(args.max_response),
        "--sigma",
        str(args.sigma),
        "--budget",
        str(args.budget),
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0 or not out.is_file():
        sys.exit(
            f"the bench failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return json.loads(out.read_text())


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    measured = [r for r in result["records"] if not r["warmup"]]
    by_mode = {p: [r for r in measured if r["packing"] is p] for p in (False, True)}

    def med(p: bool, key: str) -> float:
        return statistics.median(r[key] for r in by_mode[p])

    print(
        f"train phase, {args.samples} responses: lognormal lengths (sigma {args.sigma}), median "
        f"{result['response_median']} / max {result['response_max']} tokens after a {args.prompt}-token prompt; "
        f"budget {args.budget} tokens per micro-batch; 20M-parameter Qwen3-MoE, world 1, {args.threads} thread(s); "
        f"median of {args.iters} iterations after {args.warmup} warm-up"
    )
    stats = {}
    for p, name in ((False, "padded"), (True, "packed")):
        tps = statistics.median(r["tokens"] / r["wall_s"] for r in by_mode[p])
        cpu_tps = statistics.median(r["tokens"] / r["cpu_s"] for r in by_mode[p])
        mib_per_k = statistics.median(
            r["peak_saved_bytes"] / 2**20 / (r["real_tokens_per_microbatch"] / 1000) for r in by_mode[p]
        )
        stats[p] = (tps, cpu_tps, mib_per_k)
        cuda = by_mode[p][0]["cuda_peak_bytes"]
        print(
            f"  {name}: {tps:8.0f} tok/s (CPU time: {cpu_tps:8.0f} tok/s)  {med(p, 'microbatches'):.0f} micro-batches, "
            f"{med(p, 'tokens_per_microbatch'):.0f} tokens each, padding_frac {med(p, 'padding_frac'):.3f}; "
            f"peak activations {med(p, 'peak_saved_bytes') / 2**20:.1f} MiB = {mib_per_k:.2f} MiB per 1k real tokens"
            + ("" if cuda is None else f"; CUDA peak {cuda / 2**20:.0f} MiB")
        )
    wall_ratios = []
    for p_rec, d_rec in zip(by_mode[True], by_mode[False], strict=True):
        wall_ratios.append(d_rec["wall_s"] / p_rec["wall_s"])
    print(
        f"tokens/s packed / padded: {stats[True][0] / stats[False][0]:.2f} (per iteration: "
        + " ".join(f"{r:.2f}" for r in wall_ratios)
        + f"); CPU time {stats[True][1] / stats[False][1]:.2f}"
    )
    print(f"activation memory per 1k real tokens packed / padded: {stats[True][2] / stats[False][2]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--max-response", type=int, default=512)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the response lengths")
    parser.add_argument("--budget", type=int, default=8192, help="train.max_tokens_per_micro_batch")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--run-dir")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = launch(args, Path(tmp))
    report(result, args)
    print(f"total wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
