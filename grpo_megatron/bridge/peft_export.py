"""LoRA adapters -> a PEFT adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``,
which ``peft.PeftModel.from_pretrained`` loads onto the transformers model of the same base.

The adapters travel through the export stream (``export_hf_stream(adapters=True)``: any layout, to
rank 0) under their base weights' HF names (``models/weight_rules.py:lora_rules``); here they take
PEFT's names and layouts for transformers 5:

- attention projections: ``target_modules`` (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; MLA's
  ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``), keys
  ``base_model.model.<module>.lora_A.weight`` [r, in] / ``lora_B.weight`` [out, r]; megatron's fused
  ``linear_qkv`` (and GLU ``linear_fc1``) adapter shares one A, so each HF projection gets that A and
  its rows of B (the update ``B A`` of each is exactly the fused one's rows);
- routed experts: transformers 5 holds them as fused 3-D parameters (``mlp.experts.gate_up_proj``
  [E, 2I, H], ``down_proj`` [E, H, I]), so they go by ``target_parameters``: PEFT's ``ParamWrapper``
  keeps ``lora_A`` [E r, in] (expert e's A in rows e r .. e r + r) and ``lora_B`` [out, r E] (expert e's
  B in columns k E + e), ``peft/tuners/lora/layer.py:ParamWrapper.get_delta_weight``; two targeted
  parameters of one module nest, the first (``gate_up_proj``, in the module's parameter order) inside:
  ``experts.base_layer.lora_A.weight``, the second outside: ``experts.lora_A.weight``;
- an MoE model's other MLP projections (shared experts, dense layers) also go by
  ``target_parameters`` (``<module>.weight``, 2-D): PEFT 0.21 on transformers 5 rewrites every target
  *module* named ``gate_proj`` / ``up_proj`` / ``down_proj`` of an MoE model onto the fused experts
  (``peft/utils/transformers_weight_conversion.py:_convert_peft_config_moe``), which would drop them.

``lora_dropout`` is written as 0: PEFT refuses dropout on parameter targets, and it changes nothing
at inference.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.bridge.export import export_hf_stream
from grpo_megatron.bridge.layout import rules_by_name
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.models.config import LoRAConfig, num_routed_experts
from grpo_megatron.models.weight_rules import WeightRule, lora_hf_name

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.(?P<e>\d+)\.[^.]+$")
_MLP_PROJ = re.compile(r"\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")


def write_peft_adapter(
    model: torch.nn.Module,
    ps: ParallelState,
    hf: Mapping[str, Any],
    lora: LoRAConfig,
    out_dir: str | Path,
    *,
    base_model: str = "",
    bucket_bytes: int = 256 << 20,
) -> None:
    """Collective: the adapters of ``model`` (any layout) as a PEFT adapter directory at ``out_dir``,
    written by rank 0 into a temporary sibling and renamed when complete."""
    from safetensors.torch import save_file

    from grpo_megatron.fileio import TMP_INFIX

    tensors: dict[str, torch.Tensor] = {}
    for bucket in export_hf_stream(model, ps, hf, bucket_bytes=bucket_bytes, adapters=True):
        tensors.update(bucket)
    if ps.rank == 0:
        state, targets = peft_state(hf, tensors)
        out = Path(out_dir)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(
                f"{out} exists and is not empty: choose a new directory for the PEFT adapter"
            )
        tmp = out.with_name(out.name + TMP_INFIX + "peft")
        tmp.mkdir(parents=True)
        # A fused weight's projections share one A: each key gets a copy of its own (safetensors refuses shared memory).
        save_file(
            {k: v.clone().contiguous() for k, v in state.items()},
            str(tmp / WEIGHTS_NAME),
            metadata={"format": "pt"},
        )
        (tmp / CONFIG_NAME).write_text(json.dumps(adapter_config(lora, targets, base_model), indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty: checked above
        tmp.rename(out)
    dist.barrier()


def adapter_config(lora: LoRAConfig, targets: dict[str, list[str]], base_model: str) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for these adapters (``targets``: target_modules, target_parameters)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": targets["target_modules"] or None,
        "target_parameters": targets["target_parameters"] or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def peft_state(
    hf: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """PEFT's adapter state dict and targets from the stream's tensors (``<HF weight>.lora_A.weight`` /
    ``lora_B.weight``, A under the first HF tensor of a fused weight only)."""
    state: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    params: list[str] = []
    experts: dict[str, dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
    moe = num_routed_experts(dict(hf)) > 0
    for rule in rules_by_name(hf).values():
        a = tensors.get(lora_hf_name(rule.hf[0], "lora_A"))
        if a is None:
            continue
        for name, b in _projections(rule, tensors):
            module = name.removesuffix(".weight")
            match = _EXPERT.match(module)
            if match is not None:  # routed expert e: gathered into the fused parameter below
                fused = "gate_up_proj" if rule.kind == "glu" else "down_proj"
                per_expert = experts.setdefault(match["experts"], {}).setdefault(fused, {})
                e = int(match["e"])
                b = torch.cat([per_expert[e][1], b]) if e in per_expert else b  # gate, then up
                per_expert[e] = (a, b)
                continue
            if moe and _MLP_PROJ.search(module):  # shared experts, dense layers: by parameter
                params.append(module + ".weight")
            else:
                modules.append(module)
            state[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a
            state[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
    for prefix, by_param in experts.items():
        for param, key in _nesting(prefix, sorted(by_param, key=["gate_up_proj", "down_proj"].index)):
            a_stack, b_stack = _stack_experts(by_param[param])
            state[f"{PEFT_PREFIX}{key}.lora_A.weight"] = a_stack
            state[f"{PEFT_PREFIX}{key}.lora_B.weight"] = b_stack
            params.append(f"{prefix}.{param}")
    return state, {"target_modules": modules, "target_parameters": params}


def _projections(rule: WeightRule, tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """(HF weight name, its rows of B) for each HF tensor of ``rule``'s weight."""
    return [(name, tensors[lora_hf_name(name, "lora_B")]) for name in rule.hf]


def _nesting(prefix: str, fused: list[str]) -> list[tuple[str, str]]:
    """(parameter, PEFT module key) of the targeted fused parameters of one experts module: wrapped in
    the module's parameter order, each wrapper around the previous one (``base_layer``)."""
    return [(param, prefix + ".base_layer" * (len(fused) - 1 - i)) for i, param in enumerate(fused)]


def _stack_experts(
    per_expert: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ParamWrapper layout of E experts' (A_e [r, in], B_e [out, r]): A [E r, in] (row blocks),
    B [out, r E] (column k E + e = B_e[:, k])."""
    experts = [per_expert[e] for e in sorted(per_expert)]
    a = torch.cat([a for a, _ in experts], dim=0)
    b = torch.stack([b for _, b in experts], dim=0)  # [E, out, r]
    return a, b.permute(1, 2, 0).reshape(b.shape[1], -1)
