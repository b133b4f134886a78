"""Workers of test_bridge.py (tiny configs: tests/helpers/tiny_configs.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.dist import CPU_JOB
from tests.helpers.tiny_configs import TINY_CONFIGS

SEQ_ROWS, SEQ_LEN = 2, 12
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe.yaml"


def batch_tokens() -> torch.Tensor:
    return torch.randint(
        0,
        TINY_CONFIGS["qwen2"]["vocab_size"],
        (SEQ_ROWS, SEQ_LEN),
        generator=torch.Generator().manual_seed(3),
    )


def reference_kwargs(model_type: str) -> dict:
    """transformers arguments of every parity reference: fp32 and the plain per-expert loop, as the CPU
    engine runs it. transformers' default expert kernel depends on what else is installed (it changed
    when triton came in with SGLang) and rounds differently (~6e-7), so a reference built with the
    default would not run the same kernels as the engine; a model loaded with these arguments does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_megatron.rollout.embedded import _supports_experts_implementation

    model_cls = AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(**TINY_CONFIGS[model_type]))]
    eager = {"experts_implementation": "eager"} if _supports_experts_implementation(model_cls) else {}
    return {"dtype": torch.float32, **eager}


def save_tiny_model(model_type: str, out_dir: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random transformers model of ``model_type`` saved as fp32 safetensors in ``out_dir``;
    returns its logits on ``batch_tokens()`` (the parity reference)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**TINY_CONFIGS[model_type])
    model = AutoModelForCausalLM.from_config(config, **reference_kwargs(model_type)).eval()
    with torch.no_grad():
        # Norm weights start at one and biases at zero: randomise them so a swapped mapping shows.
        for name, t in model.state_dict().items():
            if "norm" in name or name.endswith("bias"):
                t.copy_(torch.rand_like(t) * 0.5 + 0.75 if "norm" in name else torch.randn_like(t) * 0.1)
        tokens = batch_tokens()
        logits = model(tokens).logits.float()
    model.save_pretrained(out_dir, safe_serialization=True)
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return {"logits": logits, "logprobs": logprobs}


def _build(hf_dir: str, overrides: list[str]):
    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import init_distributed, world_size_from_env
    from grpo_megatron.models.builder import build_gpt_model

    cfg = load_config(
        EXAMPLE, [*CPU_JOB, f"model.hf_path={hf_dir}", "parallel.use_distributed_optimizer=false", *overrides]
    )
    validate(cfg, world_size_from_env())
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    model, spec = build_gpt_model(hf, cfg.model, ps)
    return model, spec, ps, hf


def roundtrip(
    cases: dict[str, tuple[str, list[str]]],
    refs: dict[str, dict[str, torch.Tensor]],
    bucket_bytes: int,
    write_dirs: dict[str, str] | None = None,
) -> dict:
    """For each case (HF dir, layout overrides): load HF -> megatron, export megatron -> HF on
    rank 0 and compare with the saved files bit for bit; logprobs of the batch against HF's.
    Cases named in ``write_dirs`` also stream into a ``SafetensorsWriter`` there."""
    from safetensors.torch import load_file

    from grpo_megatron.bridge.export import export_hf_stream
    from grpo_megatron.bridge.hf_loader import load_hf_weights
    from grpo_megatron.bridge.safetensors_writer import SafetensorsWriter
    from grpo_megatron.distributed.bootstrap import destroy_distributed
    from grpo_megatron.distributed.megatron_compat import applied_fixes
    from grpo_megatron.training.forward_backward import MicroBatch, forward_logprobs

    out = {}
    for case, (hf_dir, overrides) in cases.items():
        model, spec, ps, hf = _build(hf_dir, overrides)
        load_hf_weights(model, ps, hf_dir, hf)
        buckets: list[list[tuple[str, torch.Tensor]]] = []
        out_dir = (write_dirs or {}).get(case)
        if out_dir is not None and ps.rank == 0:
            with SafetensorsWriter(out_dir, hf) as writer:
                # One stream, two consumers: the comparison below and the writer.
                for bucket in export_hf_stream(model, ps, hf, bucket_bytes=bucket_bytes):
                    buckets.append(bucket)
                    writer(bucket)
        else:
            buckets.extend(export_hf_stream(model, ps, hf, bucket_bytes=bucket_bytes))
        tokens = batch_tokens()
        (lp,) = forward_logprobs(
            model, [MicroBatch(tokens[:, :-1], tokens[:, 1:])], ps, vocab_size=spec.vocab_size
        )
        # .cpu(): the references are transformers' on CPU; the job may run on CUDA (tests/test_gpu.py).
        result = {"logprob_diff": (lp.logprobs_bs.cpu() - refs[case]["logprobs"]).abs().max().item()}
        if ps.world_size == 1:
            positions = torch.arange(SEQ_LEN)[None].expand(SEQ_ROWS, -1)
            with torch.no_grad():
                logits = model(tokens.to(ps.device), positions.to(ps.device), None).cpu()
            result["logit_diff"] = (logits[..., : spec.vocab_size] - refs[case]["logits"]).abs().max().item()
        result["device"] = str(ps.device)
        result["use_te"] = spec.use_te
        result["applied_fixes"] = list(applied_fixes())
        if ps.rank == 0:
            saved = load_file(f"{hf_dir}/model.safetensors")
            exported = {name: t.cpu() for b in buckets for name, t in b}
            result |= {
                "buckets": len(buckets),
                "missing": sorted(set(saved) - set(exported)),
                "extra": sorted(set(exported) - set(saved)),
                "order_dupes": sum(len(b) for b in buckets) - len(exported),
                "shape_diff": sorted(
                    k for k in saved.keys() & exported.keys() if saved[k].shape != exported[k].shape
                ),
                "not_exact": sorted(
                    k
                    for k in saved.keys() & exported.keys()
                    if saved[k].shape == exported[k].shape and not torch.equal(saved[k], exported[k])
                ),
            }
        out[case] = result
        destroy_distributed(keep_process_group=True)
    return out


def load_errors(cases: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Load each broken checkpoint (HF dir, config dir) at world 1; return the error messages."""
    from grpo_megatron.bridge.hf_loader import load_hf_weights
    from grpo_megatron.distributed.bootstrap import destroy_distributed

    out = {}
    for case, (hf_dir, config_dir) in cases.items():
        model, _, ps, hf = _build(config_dir, [])
        try:
            load_hf_weights(model, ps, hf_dir, hf)
            out[case] = "no error"
        except Exception as e:  # the test checks type and message
            out[case] = f"{type(e).__name__}: {e}"
        destroy_distributed(keep_process_group=True)
    return out


def exported_tensors(dirs: list[str], overrides: list[str], write_dir: str) -> list[dict[str, torch.Tensor]]:
    """Load each HF dir at the layout ``overrides`` and export it again: rank 0's exported tensors per
    dir (other ranks: empty). The first dir's export is also written to ``write_dir``."""
    from grpo_megatron.bridge.export import export_hf_stream
    from grpo_megatron.bridge.hf_loader import load_hf_weights
    from grpo_megatron.bridge.safetensors_writer import write_hf_checkpoint
    from grpo_megatron.distributed.bootstrap import destroy_distributed

    out = []
    for i, hf_dir in enumerate(dirs):
        model, _, ps, hf = _build(hf_dir, overrides)
        load_hf_weights(model, ps, hf_dir, hf)
        if i == 0:
            write_hf_checkpoint(model, ps, hf, write_dir)
        buckets = list(export_hf_stream(model, ps, hf, bucket_bytes=1 << 20))
        out.append({name: t.cpu() for b in buckets for name, t in b} if ps.rank == 0 else {})
        destroy_distributed(keep_process_group=True)
    return out
