"""Workers of test_export.py: the export stream to a destination other than rank 0, with a cast on
export, and ``broadcast_bucket``, on real megatron-core models (random init) over gloo."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.dist import CPU_JOB

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe.yaml"


def stream_and_broadcast(hf_dir: str, layouts: dict[str, list[str]], bucket_bytes: int) -> dict:
    """For each layout: export to rank 0 (fp32), to rank 1 (fp32) and to rank 1 (bf16); then rank 0
    broadcasts its fp32 buckets to rank 1 (and an empty bucket). Returns, per layout, what each rank
    received: ``{"dst0": ..., "dst1": ..., "dst1_bf16": ..., "broadcast": ..., "buckets": n}``."""
    import torch.distributed as dist

    from grpo_megatron.bridge.bucket_io import broadcast_bucket
    from grpo_megatron.bridge.export import ExportStream, export_hf_stream
    from grpo_megatron.bridge.export_plan import plan_export
    from grpo_megatron.config import load_config
    from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed, world_size_from_env
    from grpo_megatron.models.builder import build_gpt_model

    out: dict = {}
    for name, overrides in layouts.items():
        cfg = load_config(
            EXAMPLE, [*CPU_JOB, f"model.hf_path={hf_dir}", "parallel.use_distributed_optimizer=false", *overrides]
        )
        cfg.validate(world_size_from_env())
        ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
        hf = cfg.model.load_hf_config()
        model, _ = build_gpt_model(hf, cfg.model, ps)

        dst0, dst1, dst1_bf16 = (
            list(export_hf_stream(model, ps, hf, bucket_bytes=bucket_bytes, dst_rank=dst, dtype=dtype))
            for dst, dtype in ((0, None), (1, None), (1, torch.bfloat16))
        )
        # A plan made once serves later exports (the weight sync reuses it every iteration).
        plan = plan_export(model, ps, hf, bucket_bytes=bucket_bytes, dst_rank=1)
        replanned = [list(ExportStream(plan)) for _ in range(2)]
        count = torch.tensor([len(dst0)])
        dist.broadcast(count, src=0)  # rank 1 learns how many buckets to receive
        received = [broadcast_bucket(dst0[i] if ps.rank == 0 else None, 0) for i in range(int(count))]
        empty = broadcast_bucket([] if ps.rank == 0 else None, 0, dist.group.WORLD)
        result = {"broadcast": [dict(b) for b in received], "empty": len(empty)}
        if ps.rank == 0:
            result |= {"dst0": dict(kv for b in dst0 for kv in b), "buckets": len(dst0)}
        else:
            result |= {
                "dst1": dict(kv for b in dst1 for kv in b),
                "dst1_bf16": dict(kv for b in dst1_bf16 for kv in b),
                "dst1_buckets": len(dst1),
                "dst1_planned": [dict(kv for b in r for kv in b) for r in replanned],
                # A yielded tensor owns its memory (a consumer may keep one alone).
                "owns_memory": all(
                    t.untyped_storage().nbytes() == t.numel() * t.element_size() for b in dst1 for _, t in b
                ),
            }
        out[name] = result
        destroy_distributed(keep_process_group=True)
    return out
