"""Weight sync (``RolloutFleet.sync_weights``: manifest check, then the transfer into every engine)
beside its floor, in the same run, on the bench model of ``bench/export_throughput.py``.

- world 1: one embedded engine; the floor is a memcpy of the same bytes (every HF tensor copied into
  a tensor allocated beforehand: the copy alone, no allocation or first-touch page faults);
- world 4 (``--world4``: TP2 x EP2 by default, or PP2 x EP2; ``per_dp_rank``: 2 engines): the floor is the raw point-to-point transfer of
  the same bytes over the same (source, engine) pairs as the sync's plan (``ExportPlan.pair_bytes``),
  every pair's bytes as pre-packed messages of the bucket size, all posted at once.

It also prints the planner's estimate (``planner/sync.py``) of the world-4 sync fed with the link
and copy speeds measured here (the floor's bytes per second of its busiest rank, the memcpy rate).

    .venv/bin/python bench/sync_throughput.py [--repeats 5] [--bucket-mb 512] [--world4 tp2ep2|pp2ep2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_throughput import BENCH_CONFIG, EXAMPLE, launch  # noqa: E402

WORLD4 = {
    # every large tensor split by TP: the engine re-lays every byte (nothing lands in place)
    "tp2ep2": ["parallel.tp=2", "parallel.ep=2"],
    # whole tensors per stage: most bytes can be received straight into the engine's weights
    "pp2ep2": ["parallel.pp=2", "parallel.ep=2"],
}
"""World-4 layouts with 2 engines (``per_dp_rank``); ``--world4`` picks one."""


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from grpo_megatron.bridge.export import export_hf_stream
    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed, world_size_from_env
    from grpo_megatron.models.builder import build_gpt_model
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.job import engine_spec

    world = world_size_from_env()
    cfg = load_config(
        EXAMPLE,
        [
            f"model.hf_path={args.hf_dir}",
            "parallel.use_distributed_optimizer=false",
            *(WORLD4[args.world4] if world == 4 else []),
        ],
    )
    validate(cfg, world)
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    model, _ = build_gpt_model(hf, cfg.model, ps)
    # The bucket size a user gets (rollout.sync_bucket_mb, 512 MiB) unless --bucket-mb says otherwise.
    bucket_bytes = int((args.bucket_mb or cfg.rollout.sync_bucket_mb) * (1 << 20))
    fleet = RolloutFleet.build(engine_spec(cfg), hf, ps)
    version = [0]
    last: dict[str, float] = {}

    def sync() -> None:
        version[0] += 1
        last.update(fleet.sync_weights(model, version[0], bucket_bytes=bucket_bytes))

    sync()  # warm-up; makes the plan
    plan = fleet.weights.export_plan
    assert plan is not None
    payload = sum(item.hf_bytes for item in plan.items)
    pairs = plan.pair_bytes
    sent = [0] * world
    recv = [0] * world
    for (s, d), n in pairs.items():
        sent[s] += n
        recv[d] += n
    if world == 1:
        tensors = [t for b in export_hf_stream(model, ps, hf, bucket_bytes=bucket_bytes) for _, t in b]
        copies = [t.clone() for t in tensors]  # allocated (and touched) once: the floor is the copy alone

        def floor() -> None:
            for dst, src in zip(copies, tensors, strict=True):
                dst.copy_(src)
    else:

        def chunks(n: int) -> list[int]:
            return [min(bucket_bytes, n - off) for off in range(0, n, bucket_bytes)]

        outbox = [
            (d, torch.ones(m, dtype=torch.uint8))
            for (s, d), n in pairs.items()
            if s == ps.rank
            for m in chunks(n)
        ]
        inbox = [
            (s, torch.empty(m, dtype=torch.uint8))
            for (s, d), n in pairs.items()
            if d == ps.rank
            for m in chunks(n)
        ]

        def floor() -> None:
            ops = [dist.P2POp(dist.isend, b, d) for d, b in outbox] + [
                dist.P2POp(dist.irecv, b, s) for s, b in inbox
            ]
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()

        floor()  # warm-up of the connections
        tiny = [(d, torch.ones(1, dtype=torch.uint8)) for (s, d) in pairs if s == ps.rank]
        tiny_in = [(s, torch.empty(1, dtype=torch.uint8)) for (s, d) in pairs if d == ps.rank]

        def ping() -> None:  # one wait of the same pairs with nothing to move: the latency per wait
            ops = [dist.P2POp(dist.isend, b, d) for d, b in tiny] + [
                dist.P2POp(dist.irecv, b, s) for s, b in tiny_in
            ]
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()

        latency = statistics.median(_timed(ping) for _ in range(20))
        many_out = [(d, torch.ones(1, dtype=torch.uint8)) for d, _ in tiny for _ in range(64)]
        many_in = [(s, torch.empty(1, dtype=torch.uint8)) for s, _ in tiny_in for _ in range(64)]

        def ping64() -> None:  # 64 times the messages of one wait: the overhead per message
            ops = [dist.P2POp(dist.isend, b, d) for d, b in many_out]
            ops += [dist.P2POp(dist.irecv, b, s) for s, b in many_in]
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()

        per_rank_messages = max(1, len(tiny) + len(tiny_in))
        message_s = max(0.0, statistics.median(_timed(ping64) for _ in range(10)) - latency)
        message_s /= 63 * per_rank_messages
    # What the planner's model counts per rank: waits (rounds + the sync's two all-reduces) and the
    # bytes copied on the rank (packed at a sender; written into the live weights at an engine, where
    # the transport received them elsewhere than in place).
    rounds = sum(len(b) for b in plan.buckets)
    packed = sum(m.nbytes for r in plan.sends for m in r if not m.direct)
    messages = sum(len(r) for r in plan.sends + plan.recvs)
    mine: list[Any] = [None] * world
    dist.all_gather_object(mine, (rounds + 2, packed, messages))
    times: dict[str, list[float]] = {"sync": [], "floor": []}
    for _ in range(args.repeats):
        times["sync"].append(_timed(sync))
        times["floor"].append(_timed(floor))
    if ps.rank == 0:
        out = {
            "world": world,
            "payload_bytes": payload,
            "engines": fleet.num_engines,
            "sent": sent,
            "received": recv,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "all_s": times,
            "bucket_mb": bucket_bytes / (1 << 20),
            "waits": [m[0] for m in mine],
            "packed": [m[1] for m in mine],
            "messages": [m[2] for m in mine],
            "latency_s": latency if world > 1 else 0.0,
            "message_s": message_s if world > 1 else 0.0,
            "in_place_bytes": last["sync/in_place_bytes"],
        }
        Path(args.out).write_text(json.dumps(out))
    fleet.shutdown()
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=0.0, help="0: rollout.sync_bucket_mb's default")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--world4", choices=sorted(WORLD4), default="tp2ep2", help="the world-4 layout")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from grpo_megatron.planner.sync import RankBytes, transfer_seconds

    with tempfile.TemporaryDirectory(prefix="sync_bench_") as tmp:
        hf_dir = Path(tmp) / "model"
        hf_dir.mkdir()
        (hf_dir / "config.json").write_text(json.dumps(BENCH_CONFIG, indent=2))
        results = {
            w: launch(w, hf_dir, Path(tmp) / f"world{w}.json", args, __file__, ("--world4", args.world4))
            for w in (1, 4)
        }

    bucket_mb = results[1]["bucket_mb"]
    print(f"Qwen3-MoE bench model, fp32, buckets of {bucket_mb:g} MiB, median of {args.repeats} runs")
    for world, r in results.items():
        mb = r["payload_bytes"] / 1e6
        floor = "memcpy" if world == 1 else "raw send/recv over the plan's pairs"
        layout = f" {args.world4}" if world == 4 else ""
        print(
            f"world {world}{layout}, {r['engines']} engine(s), {mb:.1f} MB per engine; bytes sent per rank {r['sent']}"
        )
        for name, seconds in r["median_s"].items():
            print(f"  {name:6s} {seconds * 1e3:8.1f} ms")
        print(
            f"ratio world {world}: sync / {floor} = {r['median_s']['sync'] / r['median_s']['floor']:.2f} "
            f"({r['in_place_bytes'] / 1e6:.1f} MB received straight into an engine's weights)"
        )
    # The planner's model fed this machine's speeds: the memcpy rate, and the busiest rank's rate
    # through the raw transfer (its larger direction).
    w1, w4 = results[1], results[4]
    copy_gbps = w1["payload_bytes"] / w1["median_s"]["floor"] / 1e9
    busiest = max(max(s, r) for s, r in zip(w4["sent"], w4["received"], strict=True))
    link_gbps = busiest / w4["median_s"]["floor"] / 1e9
    ranks = [
        # copied: packed at a sender (slices too small to travel alone); at an engine rank every byte
        # of the model not received in place written into the live weights once (at TP2 x EP2 every
        # large tensor is split, so none is received in place).
        RankBytes(s, r, p + (w4["payload_bytes"] - w4["in_place_bytes"] if r else 0), waits, n)
        for s, r, p, waits, n in zip(
            w4["sent"], w4["received"], w4["packed"], w4["waits"], w4["messages"], strict=True
        )
    ]
    predicted = transfer_seconds(ranks, link_gbps, copy_gbps, w4["latency_s"], w4["message_s"])
    print(
        f"planner model, world 4 (measured here: link {link_gbps:.2f} GB/s, copy {copy_gbps:.2f} GB/s, "
        f"{w4['latency_s'] * 1e3:.2f} ms per wait x {max(w4['waits'])}, {w4['message_s'] * 1e6:.0f} us per "
        f"message x {max(w4['messages'])}): "
        f"predicted {predicted * 1e3:.1f} ms, measured {w4['median_s']['sync'] * 1e3:.1f} ms "
        f"(measured / predicted = {w4['median_s']['sync'] / predicted:.2f})"
    )


if __name__ == "__main__":
    main()
