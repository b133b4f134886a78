"""Cost of FP8 rollout's quantization in the weight sync (``rollout.weight_dtype=fp8``): the export
stream the sync runs (``bridge/export.py``, its plan reused as every sync reuses it) of the same bf16
model, once as it is (``rollout.weight_dtype=model``) and once quantizing every linear layer to
block-FP8 weight + scales where it lands (``ExportPlan.quantize``, ``bridge/fp8.py``), interleaved, in
the same run, on CPU. The same bytes leave the trainer both ways; the FP8 stream delivers about half
of them to the engines.

The bench model is ``bench/export_throughput.py``'s Qwen3-MoE (here in bf16: about 70 MB), world 1.
The last line prints the ratio (FP8 stream time / bf16 stream time).

    .venv/bin/python bench/fp8_sync.py [--repeats 5] [--bucket-mb 32]

SGLang's engine is not in the timing: on CPU it serves FP8 only on its AMX path (an AVX2-only CPU
cannot), and the load into an engine differs between the two (bench/gpu_check.py's ``sglang_fp8``
stage times the whole sync into SGLang on a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_throughput import BENCH_CONFIG, EXAMPLE, launch  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch

    from grpo_megatron.bridge.export import ExportStream
    from grpo_megatron.bridge.export_plan import plan_export
    from grpo_megatron.bridge.fp8 import Fp8Weights
    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed
    from grpo_megatron.models.builder import build_gpt_model

    cfg = load_config(
        EXAMPLE,
        [f"model.hf_path={args.hf_dir}", "parallel.use_distributed_optimizer=false", "model.dtype=bfloat16"],
    )
    validate(cfg, 1)
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    model, _ = build_gpt_model(hf, cfg.model, ps)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    plans = {
        name: plan_export(
            model, ps, hf, bucket_bytes=bucket_bytes, dst_rank=0, dtype=torch.bfloat16, quantize=quantize
        )
        for name, quantize in (("bf16", None), ("fp8", Fp8Weights()))
    }
    delivered = {}
    for name, plan in plans.items():  # warm-up, and the bytes each stream delivers
        delivered[name] = sum(t.numel() * t.element_size() for b in ExportStream(plan) for _, t in b)
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(args.repeats):
        for name, plan in plans.items():
            start = time.perf_counter()
            for _bucket in ExportStream(plan):
                pass
            times[name].append(time.perf_counter() - start)
    out = {
        "delivered_bytes": delivered,
        "quantized_tensors": sum(1 for _, _, d in plans["fp8"].manifest(0) if d == torch.float8_e4m3fn),
        "tensors": len(plans["bf16"].manifest(0)),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "all_s": times,
    }
    Path(args.out).write_text(json.dumps(out))
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=32.0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="fp8_sync_bench_") as tmp:
        hf_dir = Path(tmp) / "model"
        hf_dir.mkdir()
        (hf_dir / "config.json").write_text(json.dumps(BENCH_CONFIG | {"torch_dtype": "bfloat16"}, indent=2))
        r = launch(1, hf_dir, Path(tmp) / "fp8.json", args, script=__file__)
    bf16_s, fp8_s = r["median_s"]["bf16"], r["median_s"]["fp8"]
    sent = r["delivered_bytes"]["bf16"] / 1e6
    print(
        f"Qwen3-MoE bench model, bf16, world 1, buckets of {args.bucket_mb:g} MiB, "
        f"median of {args.repeats} runs; "
        f"{r['quantized_tensors']} of {r['tensors']} HF tensors quantized"
    )
    print(f"  bf16 stream {bf16_s * 1e3:8.1f} ms, {sent:.1f} MB delivered ({sent / 1e3 / bf16_s:.2f} GB/s)")
    print(
        f"  fp8 stream  {fp8_s * 1e3:8.1f} ms, {r['delivered_bytes']['fp8'] / 1e6:.1f} MB delivered "
        f"(the same {sent:.1f} MB of bf16 in: {sent / 1e3 / fp8_s:.2f} GB/s)"
    )
    print(f"ratio: fp8 stream / bf16 stream time = {fp8_s / bf16_s:.2f}")


if __name__ == "__main__":
    main()
