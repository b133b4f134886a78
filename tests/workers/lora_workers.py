"""Workers of tests/test_lora.py: LoRA policies at several layouts (real megatron-core, gloo, fp32).

- ``layouts``: one process's LoRA policy (adapters with random B, so every factor has a gradient)
  against the same canonical weights at another layout: logprobs, the adapters' gradients after
  megatron's reduction, what trains (adapters only) and the merged export (a model built without
  adapters from the merged HF weights gives the LoRA model's logprobs);
- ``reference``: the policy with adapters off vs a separately built frozen reference, at init and
  after optimizer steps;
- ``peft_oracle``: the adapters exported as a PEFT directory, loaded by the real ``peft`` onto the
  transformers model of the same base: its logits against the trainer's; the merged HF checkpoint
  against the trainer's too.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import CPU_JOB
from tests.workers.layout_workers import EXAMPLE, global_batch, loss_fn_for, my_microbatches

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def _policy(overrides: list[str]):
    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import init_distributed, world_size_from_env
    from grpo_megatron.training.policy import build_policy

    cfg = load_config(EXAMPLE, [*CPU_JOB, "parallel.use_distributed_optimizer=false", *LORA, *overrides])
    validate(cfg, world_size_from_env())
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    return cfg, ps, hf, build_policy(hf, cfg.model, cfg.parallel, cfg.train, ps)


@torch.no_grad()
def randomize_adapters(model: torch.nn.Module, ps: Any, std: float = 0.2) -> None:
    """Every adapter's B (canonical, seeded by its name, then this rank's slice): the same adapters at
    every layout, and a model that differs from its base."""
    from grpo_megatron.bridge.layout import adapter_tensors, canonical_shape
    from tests.helpers.weights import scatter

    for _, param, layout in adapter_tensors(model, ps):
        if not layout.canonical_name.endswith("lora_B"):
            continue
        gen = torch.Generator().manual_seed(zlib.crc32(layout.canonical_name.encode()))
        full = torch.randn(canonical_shape(param, layout, ps), generator=gen) * std
        param.copy_(scatter(full, layout, ps))


def _lora_only(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "_lora." in k}


def _trains(policy) -> dict[str, Any]:
    """What the optimizer holds and which parameters have gradients: adapters only."""
    from grpo_megatron.bridge.layout import unwrap
    from grpo_megatron.models.lora import is_lora_param

    held = [
        p
        for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
        for g in opt.param_groups
        for p in g["params"]
    ]
    params = list(unwrap(policy.model).parameters())
    return {
        "optimizer_not_lora": sum(not is_lora_param(p) for p in held),
        "optimizer_lora": sum(is_lora_param(p) for p in held),
        "lora_params": sum(is_lora_param(p) for p in params),
        "frozen_with_grad": sum(not is_lora_param(p) and p.requires_grad for p in params),
        "frozen_with_buffer": sum(not is_lora_param(p) and hasattr(p, "main_grad") for p in params),
    }


def _passes(policy, ps) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's logprobs of the layout tests' batch and the adapters' reduced gradients."""
    from grpo_megatron.bridge.layout import full_state
    from grpo_megatron.training.forward_backward import forward_backward, forward_logprobs

    batches = global_batch(policy.spec.vocab_size)
    global_tokens = sum(mb.labels_bs.numel() for mb in batches)
    mine = my_microbatches(batches, ps.dp, ps.dp_rank)
    logps = forward_logprobs(policy.model, mine, ps, vocab_size=policy.spec.vocab_size)
    policy.zero_grad()
    forward_backward(
        policy.model,
        mine,
        ps,
        loss_fn_for(global_tokens),
        vocab_size=policy.spec.vocab_size,
        with_entropy=True,
    )
    return [o.logprobs_bs for o in logps], _lora_only(full_state(policy.model, ps, grads=True))


def _merged_matches(policy, ps, hf, cfg, logprobs: list[torch.Tensor], out_dir: str) -> float:
    """The merged HF export (W + scale B A through the export stream) loaded into a model built
    without adapters at this layout: the largest logprob difference to the LoRA model's."""
    import torch.distributed as dist

    from grpo_megatron.bridge.hf_loader import load_hf_weights
    from grpo_megatron.bridge.safetensors_writer import write_hf_checkpoint
    from grpo_megatron.models.builder import build_gpt_model
    from grpo_megatron.models.config import LoRAConfig
    from grpo_megatron.training.forward_backward import forward_logprobs

    write_hf_checkpoint(policy.model, ps, hf, Path(out_dir))
    dist.barrier()
    plain_cfg = cfg.model.__class__(**{**cfg.model.__dict__, "lora": LoRAConfig()})
    plain, _ = build_gpt_model(hf, plain_cfg, ps)
    load_hf_weights(plain, ps, out_dir, hf)
    batches = my_microbatches(global_batch(policy.spec.vocab_size), ps.dp, ps.dp_rank)
    merged = forward_logprobs(plain, batches, ps, vocab_size=policy.spec.vocab_size)
    return max((m.logprobs_bs - lp).abs().max().item() for m, lp in zip(merged, logprobs, strict=True))


def run_layout(overrides: list[str], reference: dict | None, out_dir: str) -> dict:
    from grpo_megatron.bridge.layout import full_state
    from grpo_megatron.distributed.bootstrap import destroy_distributed
    from tests.helpers.weights import load_full_state

    cfg, ps, hf, policy = _policy(overrides)
    if reference is None:
        randomize_adapters(policy.model, ps)
    else:
        load_full_state(policy.model, ps, reference["params"])
    logprobs, grads = _passes(policy, ps)
    out: dict[str, Any] = _trains(policy)
    out["merged_diff"] = _merged_matches(policy, ps, hf, cfg, logprobs, out_dir)
    if reference is None:
        out |= {"params": full_state(policy.model, ps), "grads": grads, "logprobs": logprobs}
    else:
        rows = my_microbatches(list(range(len(global_batch(policy.spec.vocab_size)))), ps.dp, ps.dp_rank)
        out["logprob_diff"] = max(
            (a - reference["logprobs"][i]).abs().max().item() for a, i in zip(logprobs, rows, strict=True)
        )
        out["names_differ"] = sorted(set(reference["grads"]) ^ set(grads))
        out["grad_diff"] = max((grads[k] - reference["grads"][k]).abs().max().item() for k in grads)
        out["grad_scale"] = min(reference["grads"][k].abs().max().item() for k in grads)
    destroy_distributed(keep_process_group=True)
    return out


def single(out_dir: str) -> dict:
    from tests.helpers.dist import init_gloo

    init_gloo()
    return run_layout([], None, out_dir)


def layouts(layouts: dict[str, list[str]], reference: dict, out_dir: str) -> dict:
    from tests.helpers.dist import init_gloo

    init_gloo()
    return {name: run_layout(o, reference, f"{out_dir}/{i}") for i, (name, o) in enumerate(layouts.items())}


def reference(overrides: list[str], steps: int) -> dict:
    """Policy with adapters off vs a separately built frozen reference (the policy's initial base
    weights): logprobs at init and after ``steps`` optimizer steps; the policy itself moves."""
    from grpo_megatron.bridge.layout import unwrap
    from grpo_megatron.distributed.bootstrap import destroy_distributed
    from grpo_megatron.models.builder import build_gpt_model
    from grpo_megatron.models.config import LoRAConfig
    from grpo_megatron.training.forward_backward import forward_logprobs
    from tests.helpers.dist import init_gloo

    init_gloo()
    cfg, ps, hf, policy = _policy(overrides)
    plain_cfg = cfg.model.__class__(**{**cfg.model.__dict__, "lora": LoRAConfig()})
    frozen, _ = build_gpt_model(hf, plain_cfg, ps)
    base = {k: v for k, v in unwrap(policy.model).state_dict().items() if "_lora." not in k}
    frozen.load_state_dict(base)
    frozen.requires_grad_(False)
    batches = my_microbatches(global_batch(policy.spec.vocab_size), ps.dp, ps.dp_rank)

    def logprobs(model: torch.nn.Module) -> torch.Tensor:
        outs = forward_logprobs(model, batches, ps, vocab_size=policy.spec.vocab_size)
        return torch.cat([o.logprobs_bs.flatten() for o in outs])

    def compare() -> dict[str, float]:
        ref = logprobs(frozen)
        with policy.reference():
            off = logprobs(policy.model)
        on = logprobs(policy.model)
        return {
            "off_vs_frozen": (off - ref).abs().max().item(),
            "on_vs_frozen": (on - ref).abs().max().item(),
        }

    out = {"init": compare()}
    for _ in range(steps):
        _passes(policy, ps)
        policy.step()
    out["after"] = compare()
    destroy_distributed(keep_process_group=True)
    return out


def peft_oracle(cases: dict[str, tuple[str, list[str]]], out_dir: str) -> dict:
    """Per case (HF dir, layout): the trainer's logits with random adapters, the PEFT adapter it exports
    loaded by peft onto transformers' model of that base, and the merged HF checkpoint loaded by
    transformers: the largest logit differences (rank 0)."""
    import torch.distributed as dist

    from grpo_megatron.bridge.hf_loader import load_hf_weights
    from grpo_megatron.bridge.peft_export import write_peft_adapter
    from grpo_megatron.bridge.safetensors_writer import write_hf_checkpoint
    from grpo_megatron.distributed.bootstrap import destroy_distributed
    from tests.helpers.dist import init_gloo

    init_gloo()
    out = {}
    for i, (case, (hf_dir, overrides)) in enumerate(cases.items()):
        cfg, ps, hf, policy = _policy([f"model.hf_path={hf_dir}", *overrides])
        load_hf_weights(policy.model, ps, hf_dir, hf)
        randomize_adapters(policy.model, ps, std=0.5)
        logits = _trainer_logits(policy, ps)
        adapter_dir, merged_dir = Path(out_dir) / f"{i}-peft", Path(out_dir) / f"{i}-merged"
        write_peft_adapter(policy.model, ps, hf, cfg.model.lora, adapter_dir, base_model=hf_dir)
        write_hf_checkpoint(policy.model, ps, hf, merged_dir)
        dist.barrier()
        if ps.rank == 0:
            out[case] = _transformers_side(hf_dir, adapter_dir, merged_dir, logits)
        destroy_distributed(keep_process_group=True)
    return out


def _trainer_logits(policy, ps) -> torch.Tensor:
    """The trainer's full-vocabulary logits of the bridge tests' batch (gathered over TP)."""
    from tests.workers.bridge_workers import SEQ_LEN, SEQ_ROWS, batch_tokens

    tokens = batch_tokens()
    positions = torch.arange(SEQ_LEN)[None].expand(SEQ_ROWS, -1)
    with torch.no_grad():
        logits = policy.model(tokens, positions, None, runtime_gather_output=True)
    return logits[..., : policy.spec.vocab_size].float()


def _transformers_side(
    hf_dir: str, adapter_dir: Path, merged_dir: Path, logits: torch.Tensor
) -> dict[str, Any]:
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from grpo_megatron.bridge.peft_export import WEIGHTS_NAME
    from tests.workers.bridge_workers import batch_tokens, reference_kwargs

    tokens = batch_tokens()
    model_type = AutoModelForCausalLM.from_pretrained(hf_dir).config.model_type
    kwargs = reference_kwargs(model_type)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs).eval()
    with torch.no_grad():
        base_logits = base(tokens).logits.float()
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        peft_logits = peft_model(tokens).logits.float()
    saved = load_file(str(adapter_dir / WEIGHTS_NAME))
    loaded = {k: v for k, v in get_peft_model_state_dict(peft_model).items()}
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), **kwargs).eval()
    with torch.no_grad():
        merged_logits = merged(tokens).logits.float()
    return {
        "peft_diff": (peft_logits - logits).abs().max().item(),
        "merged_diff": (merged_logits - logits).abs().max().item(),
        "adapter_effect": (base_logits - logits).abs().max().item(),
        "keys_differ": sorted(set(saved) ^ set(loaded)),
        "values_differ": sorted(
            k for k in saved.keys() & loaded.keys() if not torch.equal(saved[k], loaded[k])
        ),
        "tensors": len(saved),
    }
