"""Throughput of the weight-export stream (``bridge/export.py``) beside its floor, in the same run.

A random Qwen3-MoE model big enough for meaningful timings (about 140 MB of fp32 weights, several
hundred HF tensors, most of them small expert matrices) is built by megatron-core and streamed to
rank 0 with ``export_hf_stream``, as the per-iteration weight sync and the mcore-to-hf converter do.

- world size 1: the floor is a plain memcpy of the same bytes: every exported tensor cloned once
  (fresh memory, bucket by bucket, as the stream hands them out);
- world size 4 (TP2 x EP2, so dense weights are TP-split and experts live on two EP ranks, each
  split over its ETP pair): the floor is the raw transport of the same bytes the way the stream
  moves them: every rank sends the bytes of the shards it owns to the destination with
  ``batch_isend_irecv``, as pre-packed messages of the bucket size, and the destination receives
  from all ranks at once (gloo on CPU). What the floor leaves out is the stream's own work: packing
  the shards at the senders and writing the HF tensors at the destination (about the world-1
  memcpy). An informational line times the other classic pattern on the same bytes: an all-gather
  of each rank's shards over its TP/ETP group, then a send of the gathered bytes from each group's
  first rank to the destination (what the stream did before it sent each byte only once).

Each measurement runs ``--repeats`` times, interleaved with its floor; the median is reported. The
last two lines print the ratios (export time / floor time: 1.00 means the stream adds nothing).

    .venv/bin/python bench/export_throughput.py [--worlds 1 4] [--repeats 5] [--bucket-mb 32]

Both worlds are launched through ``torch.distributed.run`` from this script (``--worker`` is the
per-rank entry).
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
EXAMPLE = REPO_ROOT / "examples" / "tiny_moe.yaml"
LAYOUTS = {1: [], 4: ["parallel.tp=2", "parallel.ep=2"]}
LAYOUT_NAMES = {1: "world 1", 4: "world 4 (TP2 x EP2)"}

# Qwen3-MoE, fp32: embedding + head 2 x 16 MB, 4 layers of 32 experts (3 x 0.25 MB each) and
# attention; about 140 MB and 430 HF tensors, most of them 0.25 MB.
BENCH_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 8000,  # padded to 8064 inside megatron (stripped on export)
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "num_experts": 32,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.0,
    "output_router_logits": False,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}


# ---- per-rank worker (under torch.distributed.run) ------------------------------------------------
def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _owned_shards(model: Any, ps: Any, hf: dict[str, Any]) -> list[Any]:
    """The shards this rank contributes to the export: first data-parallel copy, and one TP rank of
    tensors that TP does not split (the same bytes the stream must move, whatever its pattern)."""
    from grpo_megatron.bridge.layout import is_first_replica, local_tensors, rules_by_name, tp_group_of

    rules = rules_by_name(hf)
    owned = []
    for _, tensor, layout in local_tensors(model, ps, rules):
        rule = rules.get(layout.canonical_name)
        if rule is None or not rule.export or not is_first_replica(layout, ps):
            continue
        _, size, rank = tp_group_of(layout, ps)
        if (layout.partition_dim is not None and size > 1) or rank == 0:
            owned.append((tensor, layout))
    return owned


def _p2p_floor(ps: Any, nbytes_per_rank: list[int], message_bytes: int, dst: int) -> Any:
    """Every rank sends its ``nbytes_per_rank[rank]`` pre-packed bytes to ``dst`` in messages of at
    most ``message_bytes``; ``dst`` receives from all ranks at once."""
    import torch
    import torch.distributed as dist

    def messages(n: int) -> list[int]:
        return [min(message_bytes, n - off) for off in range(0, n, message_bytes)]

    if ps.rank == dst:
        inbox = {
            r: [torch.empty(m, dtype=torch.uint8) for m in messages(n)]
            for r, n in enumerate(nbytes_per_rank)
            if r != dst
        }
    else:
        outbox = [torch.ones(m, dtype=torch.uint8) for m in messages(nbytes_per_rank[ps.rank])]

    def run() -> None:
        if ps.rank == dst:
            ops = [dist.P2POp(dist.irecv, buf, r) for r, bufs in inbox.items() for buf in bufs]
        else:
            ops = [dist.P2POp(dist.isend, buf, dst) for buf in outbox]
        works = dist.batch_isend_irecv(ops) if ops else []
        for w in works:
            w.wait()

    return run


def _allgather_floor(ps: Any, owned: list[Any], message_bytes: int, dst: int) -> Any:
    """Each TP (dense) and ETP (expert) group all-gathers its members' shard bytes in messages of at
    most ``message_bytes``; the group's first rank sends the gathered bytes to ``dst``."""
    import torch
    import torch.distributed as dist

    from grpo_megatron.bridge.layout import tp_group_of

    plans = []
    for expert in (False, True):
        shards = [(t, lay) for t, lay in owned if lay.is_expert == expert]
        if not shards:
            # The members of a group hold the same tensors: an empty rank has an empty group.
            continue
        group, size, rank = tp_group_of(shards[0][1], ps)
        # Tensors TP does not split count on the group's first rank only: all-gather the largest share.
        n_1 = torch.tensor([sum(t.numel() * t.element_size() for t, _ in shards)])
        dist.all_reduce(n_1, op=dist.ReduceOp.MAX, group=group)
        n = int(n_1.item())
        sizes = [min(message_bytes, n - off) for off in range(0, n, message_bytes)]
        plans.append((group, size, rank, [torch.ones(m, dtype=torch.uint8) for m in sizes]))

    def run() -> None:
        sends = []
        for group, size, rank, pieces in plans:
            for piece in pieces:
                gathered = [torch.empty_like(piece) for _ in range(size)] if size > 1 else [piece]
                if size > 1:
                    dist.all_gather(gathered, piece, group=group)
                if rank == 0 and ps.rank != dst:
                    sends += [dist.isend(torch.cat(gathered), dst=dst)]
        for w in sends:
            if w is not None:  # None only for a rank outside the group
                w.wait()

    if ps.rank == dst:
        # dst learns what each group source will send it (sizes only), then receives it all.
        counts: list[Any] = [None] * ps.world_size
        dist.all_gather_object(counts, [])
        incoming = [(r, n) for r, sizes in enumerate(counts) for n in sizes]
        recv_bufs = [(r, torch.empty(n, dtype=torch.uint8)) for r, n in incoming]

        def run_dst() -> None:
            works = [dist.irecv(buf, src=r) for r, buf in recv_bufs]
            run()
            for w in works:
                if w is not None:
                    w.wait()

        return run_dst
    mine = [size * p.numel() for group, size, rank, pieces in plans if rank == 0 for p in pieces]
    dist.all_gather_object([None] * ps.world_size, mine)
    return run


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from grpo_megatron.bridge.export import ExportStream, export_hf_stream
    from grpo_megatron.bridge.export_plan import plan_export
    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed, world_size_from_env
    from grpo_megatron.models.builder import build_gpt_model

    world = world_size_from_env()
    cfg = load_config(
        EXAMPLE,
        [f"model.hf_path={args.hf_dir}", "parallel.use_distributed_optimizer=false", *LAYOUTS[world]],
    )
    validate(cfg, world)
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    model, _ = build_gpt_model(hf, cfg.model, ps)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    dst = 0

    payload: list[list[torch.Tensor]] = []

    def export(keep: bool = False) -> None:
        for bucket in export_hf_stream(model, ps, hf, bucket_bytes=bucket_bytes, dst_rank=dst):
            if keep:
                payload.append([t for _, t in bucket])

    # The weight sync plans once and reuses the plan every iteration (no metadata exchange).
    plan = plan_export(model, ps, hf, bucket_bytes=bucket_bytes, dst_rank=dst)

    def export_planned() -> None:
        for _ in ExportStream(plan):
            pass

    export(keep=True)  # warm-up; dst keeps the tensors (sizes for the floor and the byte count)
    payload_bytes = sum(t.numel() * t.element_size() for b in payload for t in b)
    if world == 1:
        sources = payload

        def floor() -> None:
            for tensors in sources:  # bucket by bucket, each clone freed with its bucket
                clones = [t.clone() for t in tensors]
                del clones

        floors = {"memcpy": floor}
    else:
        payload.clear()
        owned = _owned_shards(model, ps, hf)
        mine = sum(t.numel() * t.element_size() for t, _ in owned)
        per_rank: list[Any] = [None] * ps.world_size
        dist.all_gather_object(per_rank, mine)
        floors = {
            "send/recv to dst": _p2p_floor(ps, per_rank, bucket_bytes, dst),
            "TP all-gather + send": _allgather_floor(ps, owned, bucket_bytes, dst),
        }
        floors["send/recv to dst"]()  # warm-up of the connections
        floors["TP all-gather + send"]()

    times: dict[str, list[float]] = {"export": [], "export, plan reused": [], **{name: [] for name in floors}}
    for _ in range(args.repeats):
        times["export"].append(_timed(export))
        times["export, plan reused"].append(_timed(export_planned))
        for name, fn in floors.items():
            times[name].append(_timed(fn))
    if ps.rank == dst:
        out = {
            "world": world,
            "payload_bytes": payload_bytes,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "all_s": times,
        }
        Path(args.out).write_text(json.dumps(out))
    destroy_distributed()


# ---- driver --------------------------------------------------------------------------------------
def launch(
    world: int,
    hf_dir: Path,
    out: Path,
    args: argparse.Namespace,
    script: str = __file__,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run ``script --worker`` on ``world`` processes (torchrun) and read the JSON it writes to ``out``;
    ``extra``: more worker flags (bench/sync_throughput.py runs its own worker through this)."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        TORCH_COMPILE_DISABLE="1",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        script,
        "--worker",
        "--hf-dir",
        str(hf_dir),
        "--out",
        str(out),
        "--repeats",
        str(args.repeats),
        "--bucket-mb",
        str(args.bucket_mb),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0 or not out.is_file():
        sys.exit(
            f"world {world} failed (exit code {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4], choices=sorted(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=32.0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    results = {}
    with tempfile.TemporaryDirectory(prefix="export_bench_") as tmp:
        hf_dir = Path(tmp) / "model"
        hf_dir.mkdir()
        (hf_dir / "config.json").write_text(json.dumps(BENCH_CONFIG, indent=2))
        for world in args.worlds:
            results[world] = launch(world, hf_dir, Path(tmp) / f"world{world}.json", args)

    print(f"Qwen3-MoE bench model, fp32, buckets of {args.bucket_mb:g} MiB, median of {args.repeats} runs")
    ratios = []
    for world, r in results.items():
        mb = r["payload_bytes"] / 1e6
        print(f"{LAYOUT_NAMES[world]}: {mb:.1f} MB payload")
        export_s = r["median_s"]["export"]
        for name, seconds in r["median_s"].items():
            print(f"  {name:22s} {seconds * 1e3:8.1f} ms  {mb / 1e3 / seconds:6.2f} GB/s")
        floor_name = "memcpy" if world == 1 else "send/recv to dst"
        floor_s = r["median_s"][floor_name]
        ratios.append((world, floor_name, export_s / floor_s, r["median_s"]["export, plan reused"] / floor_s))
    for world, floor_name, ratio, planned in ratios:
        print(
            f"ratio {LAYOUT_NAMES[world]}: export / {floor_name} floor time = {ratio:.2f} "
            f"(plan reused, as the weight sync does: {planned:.2f})"
        )


if __name__ == "__main__":
    main()
