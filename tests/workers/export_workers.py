"""Workers of test_export.py: the export stream to a destination other than rank 0, with a cast on
export, on real megatron-core models (random init) over gloo."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.dist import CPU_JOB

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe.yaml"


def stream_to_each_rank(hf_dir: str, layouts: dict[str, list[str]], bucket_bytes: int) -> dict:
    """For each layout: export to rank 0 (fp32), to rank 1 (fp32) and to rank 1 (bf16), to rank 1
    twice more with one plan, and to rank 1 in bf16 quantized to block FP8 as it lands (the weight
    sync's landing). Returns, per layout, what each rank received: ``{"dst0": ..., "buckets": n}`` on
    rank 0, ``{"dst1": ..., "dst1_bf16": ..., "dst1_planned": ..., "dst1_fp8": [(name, tensor)],
    "fp8_manifest": ...}`` on rank 1."""
    from grpo_megatron.bridge.assemble import Landing
    from grpo_megatron.bridge.export import ExportStream, export_hf_stream
    from grpo_megatron.bridge.export_plan import plan_export
    from grpo_megatron.bridge.fp8 import Fp8Weights
    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import destroy_distributed, init_distributed, world_size_from_env
    from grpo_megatron.models.builder import build_gpt_model

    out: dict = {}
    for name, overrides in layouts.items():
        cfg = load_config(
            EXAMPLE,
            [*CPU_JOB, f"model.hf_path={hf_dir}", "parallel.use_distributed_optimizer=false", *overrides],
        )
        validate(cfg, world_size_from_env())
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
        # FP8 engines (rollout.weight_dtype=fp8): a bf16 export quantized where it lands, as the weight
        # sync runs it (borrowed views, every round handed on; each tensor copied before the next).
        fp8_plan = plan_export(
            model, ps, hf, bucket_bytes=bucket_bytes, dst_rank=1, dtype=torch.bfloat16, quantize=Fp8Weights()
        )
        fp8 = [
            [(n, t.clone()) for n, t in bucket]
            for bucket in ExportStream(fp8_plan, Landing(torch.device("cpu"), borrow=True))
        ]
        result: dict = {}
        if ps.rank == 0:
            result |= {"dst0": dict(kv for b in dst0 for kv in b), "buckets": len(dst0)}
        else:
            result |= {
                "dst1": dict(kv for b in dst1 for kv in b),
                "dst1_bf16": dict(kv for b in dst1_bf16 for kv in b),
                "dst1_buckets": len(dst1),
                "dst1_planned": [dict(kv for b in r for kv in b) for r in replanned],
                "dst1_fp8": [kv for b in fp8 for kv in b],
                "fp8_manifest": [(n, list(shape), str(d)) for n, shape, d in fp8_plan.manifest(1)],
                # A yielded tensor owns its memory (a consumer may keep one alone).
                "owns_memory": all(
                    t.untyped_storage().nbytes() == t.numel() * t.element_size() for b in dst1 for _, t in b
                ),
            }
        out[name] = result
        destroy_distributed(keep_process_group=True)
    return out


def router_bias_to_an_engine(hf_dir: str) -> dict:
    """A bf16 trainer (TP2) exports to a bf16 embedded engine on rank 0 with bf16 as the export dtype;
    the routers' fp32 expert biases are set to values bf16 cannot hold. Rank 0 returns the trainer's
    biases (``trainer``), what the stream delivered (``exported``) and what the engine holds
    (``engine``), by HF name."""
    from grpo_megatron.bridge.export import ExportStream
    from grpo_megatron.bridge.export_plan import plan_export
    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import init_distributed, world_size_from_env
    from grpo_megatron.models.builder import build_gpt_model
    from grpo_megatron.rollout.embedded import EmbeddedEngine

    cfg = load_config(
        EXAMPLE,
        [
            *CPU_JOB,
            f"model.hf_path={hf_dir}",
            "parallel.use_distributed_optimizer=false",
            "parallel.tp=2",
            "model.dtype=bfloat16",
        ],
    )
    validate(cfg, world_size_from_env())
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    model, _ = build_gpt_model(hf, cfg.model, ps)
    trainer = {}
    for layer in model.decoder.layers:
        bias = getattr(layer.mlp, "router", None) and layer.mlp.router.expert_bias
        if bias is not None:
            bias.copy_(0.5 + 1e-4 * torch.arange(bias.numel(), dtype=torch.float32))  # a few bf16 ULPs wide
            trainer[f"model.layers.{layer.layer_number - 1}.mlp.gate.e_score_correction_bias"] = bias.clone()
    plan = plan_export(model, ps, hf, bucket_bytes=1 << 20, dst_ranks=(0,), dtype=torch.bfloat16)
    engine = EmbeddedEngine(hf, dtype=torch.bfloat16) if ps.rank == 0 else None
    if engine is not None:
        assert engine.check_manifest(plan.manifest(0), 1) == []
    exported = {}
    for bucket in ExportStream(plan):
        exported |= {k: t.clone() for k, t in bucket if k in trainer}
        if engine is not None:
            engine.update_weights(bucket, version=1, last=False)
    if engine is None:
        return {}
    engine.update_weights([], version=1, last=True)
    live = engine.model.state_dict()
    return {"trainer": trainer, "exported": exported, "engine": {k: live[k].clone() for k in trainer}}
