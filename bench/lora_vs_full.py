"""LoRA vs full-parameter training in one run: trainer step time, optimizer and gradient bytes.

One ``torch.distributed.run`` launch of 2 ranks (EP2, as the demo) builds the policy twice in the
same processes, full-parameter and with ``model.lora`` (rank ``--rank``, every linear layer of the
decoder), from the same random weights, and times ``--steps`` training steps of each (megatron's
forward/backward over the same micro-batches with a next-token loss, then the optimizer step),
alternating full and LoRA step by step so that both see the same machine load. Reported per
variant: rank 0's median step time (wall and CPU), trainable parameters, the optimizer's state
(Adam moments, plus fp32 main copies in a 16-bit model) and DDP's gradient buffers in bytes; then
the LoRA / full ratios.

    .venv/bin/python bench/lora_vs_full.py [--size demo|20m] [--rank 8] [--steps 8] [--warmup 2]

Not a test: the times depend on the machine and on what else runs on it; the bytes do not.
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
SIZES = {
    "demo": [],
    "20m": [
        "model.hf_overrides.hidden_size=256",
        "model.hf_overrides.num_hidden_layers=4",
        "model.hf_overrides.num_attention_heads=4",
        "model.hf_overrides.num_key_value_heads=4",
        "model.hf_overrides.head_dim=64",
        "model.hf_overrides.num_experts=8",
        "model.hf_overrides.moe_intermediate_size=768",
    ],
}
ROWS, SEQ = 16, 64  # global batch: 16 rows of 64 tokens, split over the 2 data-parallel ranks


def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def optimizer_bytes(policy: Any) -> int:
    """Bytes of the optimizer's state on this rank: Adam's moments and, for 16-bit models, the fp32
    main parameters (megatron's mixed-precision optimizer)."""
    total = 0
    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        total += _tensor_bytes(list(opt.optimizer.state.values()))
        total += _tensor_bytes(getattr(opt, "fp32_from_float16_groups", []))
    return total


def grad_buffer_bytes(policy: Any) -> int:
    """Bytes of megatron DDP's gradient buffers on this rank (frozen parameters get none)."""
    return sum(
        _tensor_bytes(b.grad_data) for b in [*policy.model.buffers, *policy.model.expert_parallel_buffers]
    )


def _step(policy: Any, ps: Any, tokens: Any) -> tuple[float, float]:
    from grpo_megatron.training.forward_backward import MicroBatch, forward_backward

    def nll(logprobs_bs: Any, entropy_bs: Any, mb: Any) -> tuple[Any, dict]:
        return -logprobs_bs.sum() / (ROWS * (SEQ - 1)), {}

    wall, cpu = time.perf_counter(), time.process_time()
    policy.zero_grad()
    mine = tokens[ps.dp_rank :: ps.dp]
    forward_backward(
        policy.model, [MicroBatch(mine[:, :-1], mine[:, 1:])], ps, nll, vocab_size=policy.spec.vocab_size
    )
    policy.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def worker(size: str, rank: int, steps: int, warmup: int, out: str) -> None:
    import torch

    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed
    from grpo_megatron.models.lora import trainable_parameters
    from grpo_megatron.training.policy import build_policy

    torch.set_num_threads(1)
    variants = {"full": [], "lora": [f"model.lora.rank={rank}", f"model.lora.alpha={2 * rank}"]}
    built: dict[str, Any] = {}
    ps = None
    for name, extra in variants.items():
        cfg = load_config(DEMO, ["parallel.backend=gloo", *SIZES[size], *extra])
        validate(cfg, 2)
        ps = ps or init_distributed(cfg.parallel, seed=cfg.train.seed)  # one layout, both policies
        built[name] = (ps, build_policy(cfg.model.load_hf_config(), cfg.model, cfg.parallel, cfg.train, ps))
    vocab = built["full"][1].spec.vocab_size
    tokens = torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for i in range(warmup + steps):
        for name, (ps, policy) in built.items():
            t = _step(policy, ps, tokens)
            if i >= warmup:
                times[name].append(t)
    result = {}
    for name, (_, policy) in built.items():
        trainable, total = trainable_parameters(policy.model)
        result[name] = {
            "wall_s": statistics.median(w for w, _ in times[name]),
            "cpu_s": statistics.median(c for _, c in times[name]),
            "trainable": trainable,
            "params": total,
            "optimizer_bytes": optimizer_bytes(policy),
            "grad_buffer_bytes": grad_buffer_bytes(policy),
        }
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="20m")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.size, args.rank, args.steps, args.warmup, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TORCH_COMPILE_DISABLE": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            "--worker",
            "--size",
            args.size,
            "--rank",
            str(args.rank),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--out",
            str(out),
        ]
        subprocess.run(cmd, check=True, env=env, cwd=REPO_ROOT)
        result = json.loads(out.read_text())
    print(
        f"size {args.size}, LoRA rank {args.rank} (every linear layer), EP2 on 2 ranks, {args.steps} steps of "
        f"{ROWS} x {SEQ} tokens; per rank (rank 0):"
    )
    print(
        "| variant | trainable / all params | step wall (median) | step CPU | optimizer state | gradient buffers |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in result.items():
        print(
            f"| {name} | {r['trainable']:,} / {r['params']:,} | {r['wall_s'] * 1e3:.0f} ms "
            f"| {r['cpu_s'] * 1e3:.0f} ms "
            f"| {r['optimizer_bytes'] / 2**20:.2f} MiB | {r['grad_buffer_bytes'] / 2**20:.2f} MiB |"
        )
    full, lora = result["full"], result["lora"]
    print(
        f"LoRA / full: step wall {lora['wall_s'] / full['wall_s']:.2f}, "
        f"step CPU {lora['cpu_s'] / full['cpu_s']:.2f}, "
        f"optimizer bytes {lora['optimizer_bytes'] / full['optimizer_bytes']:.3f}, "
        f"gradient bytes {lora['grad_buffer_bytes'] / full['grad_buffer_bytes']:.3f}"
    )


if __name__ == "__main__":
    main()
