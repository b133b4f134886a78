"""Model section of the job config: which Hugging Face model to build and how.

Only the standard library here: the config must load (and the CLI answer `--help`) without torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# Hugging Face `model_type` values the model builder accepts. One place, so the model registry can
# replace it later without touching the validation code.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "mixtral")

# config.json keys that hold the number of routed experts, by model family:
# qwen3_moe / qwen2_moe: num_experts, deepseek_v3: n_routed_experts, mixtral: num_local_experts.
EXPERT_COUNT_KEYS: tuple[str, ...] = ("num_experts", "n_routed_experts", "num_local_experts")

# LoRA targets (model.lora.targets): where in the model, and which of megatron's linear layers there.
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "attention": (
        "linear_qkv",
        "linear_proj",  # grouped-query attention (Qwen, Mixtral)
        # multi-latent attention (DeepSeek-V3): linear_q_proj when q_lora_rank is unset
        "linear_q_proj",
        "linear_q_down_proj",
        "linear_q_up_proj",
        "linear_kv_down_proj",
        "linear_kv_up_proj",
    ),
    "experts": ("linear_fc1", "linear_fc2"),  # routed experts: one adapter per expert
    "shared_experts": ("linear_fc1", "linear_fc2"),  # DeepSeek-V3's shared experts
    "dense_mlp": (
        "linear_fc1",
        "linear_fc2",
    ),  # dense layers' MLPs (dense models, DeepSeek-V3's first layers)
}


def lora_place(canonical: str) -> tuple[str, str] | None:
    """(group, linear) of a canonical megatron weight a LoRA target can name, else None:
    ``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight`` -> ("experts", "linear_fc1")."""
    parts = canonical.split(".")
    if len(parts) < 5 or parts[:2] != ["decoder", "layers"] or parts[-1] != "weight":
        return None
    where, linear = ".".join(parts[3:-2]), parts[-2]
    if where == "self_attention":
        group = "attention"
    elif where.startswith("mlp.experts.local_experts."):
        group = "experts"
    elif where == "mlp.shared_experts":
        group = "shared_experts"
    elif where == "mlp":
        group = "dense_mlp"
    else:
        return None
    return (group, linear) if linear in LORA_GROUPS[group] else None


@dataclass
class LoRAConfig:
    """LoRA adapters on megatron-core's linear layers (``model.lora``): the base weights stay frozen
    (no gradients, no optimizer state) and each targeted layer computes ``W x + scale * B (A x)``,
    ``scale = alpha / rank``; the reference model is the policy with its adapters off. ``rank`` 0:
    full-parameter training."""

    rank: int = 0
    """Adapter rank r (A: [r, in], B: [out, r]); 0 turns LoRA off."""
    alpha: float = 32.0
    """Scale numerator: the update is (alpha / rank) * B A, as in PEFT."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training passes only); 0 keeps the passes deterministic."""
    targets: list[str] = field(default_factory=lambda: list(LORA_GROUPS))
    """Where adapters go: a group (attention, experts, shared_experts, dense_mlp: every linear layer
    of it) or group.linear (e.g. attention.linear_qkv, experts.linear_fc2); the default: every linear
    layer of the decoder (not the embedding, router or output layer)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targeted(self, group: str, linear: str) -> bool:
        """Whether ``linear`` (a megatron module name) in ``group`` gets an adapter."""
        return self.enabled and (group in self.targets or f"{group}.{linear}" in self.targets)

    def validate(self) -> None:
        errors = []
        if self.rank < 0:
            errors.append(f"model.lora.rank={self.rank} must be >= 0 (0 = full-parameter training)")
        if self.enabled and self.alpha <= 0:
            errors.append(f"model.lora.alpha={self.alpha} must be > 0 (the update is alpha / rank * B A)")
        if not 0.0 <= self.dropout < 1.0:
            errors.append(f"model.lora.dropout={self.dropout} must be in [0, 1)")
        valid = [*LORA_GROUPS, *(f"{g}.{name}" for g, names in LORA_GROUPS.items() for name in names)]
        unknown = [t for t in self.targets if t not in valid]
        if unknown:
            errors.append(
                f"model.lora.targets: unknown {unknown}; use groups {list(LORA_GROUPS)} or group.linear, "
                f"e.g. attention.linear_qkv, experts.linear_fc1"
            )
        if self.enabled and not self.targets:
            errors.append("model.lora.targets is empty: name at least one group, e.g. [attention, experts]")
        if errors:
            raise ValueError("\n".join(errors))


@dataclass
class ModelConfig:
    """The policy model: a Hugging Face model directory plus how megatron-core should build it."""

    hf_path: str
    """Directory holding config.json (and possibly weights and tokenizer). A relative path in a YAML
    file resolves against that file's directory; one given as a command-line override, against the
    current directory."""
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    """Values that replace config.json keys, e.g. {num_hidden_layers: 2} to shrink a model; nested
    mappings merge key by key ({rope_scaling: {factor: 2}} keeps the other rope_scaling keys)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter and compute dtype of the trained model (optimizer state stays float32)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding/output vocabulary to a multiple of this (times TP), as megatron does."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer implementation: auto = TransformerEngine when importable, else megatron's local spec."""
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens travel to their experts across the expert-parallel group."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss weight; 0 keeps the RL loss pure."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: trades compute for memory in the backward pass."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (rank 0, the default: full-parameter training)."""

    def config_json_path(self) -> Path:
        return Path(self.hf_path) / "config.json"

    def load_hf_config(self) -> dict[str, Any]:
        """Read config.json from `hf_path` and apply `hf_overrides` on top."""
        path = self.config_json_path()
        if not path.is_file():
            raise ValueError(
                f"model.hf_path={self.hf_path!r}: no config.json at {display_path(path)}; "
                "set model.hf_path to a Hugging Face model directory that contains config.json"
            )
        try:
            hf_config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(
                f"model.hf_path={self.hf_path!r}: {display_path(path)} is not valid JSON ({e}); "
                "fix the file or point model.hf_path elsewhere"
            ) from e
        if not isinstance(hf_config, dict):
            raise ValueError(
                f"model.hf_path={self.hf_path!r}: {display_path(path)} holds a "
                f"{type(hf_config).__name__}, not a JSON object; point model.hf_path at a model directory"
            )
        return merge_overrides(hf_config, self.hf_overrides)

    def validate(self) -> None:
        """Checks that need only this section; checks against config.json live in grpo_megatron.config."""
        errors = []
        if not self.hf_path:
            errors.append("model.hf_path is empty: set it to a directory holding config.json")
        if self.make_vocab_size_divisible_by < 1:
            errors.append(
                f"model.make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be >= 1 "
                "(128 is megatron's default)"
            )
        if self.moe_aux_loss_coeff < 0:
            errors.append(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0 (0 disables it)")
        try:
            self.lora.validate()
        except ValueError as e:
            errors.append(str(e))
        if errors:
            raise ValueError("\n".join(errors))


def merge_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` applied: mappings merge recursively, anything else replaces."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def num_routed_experts(hf_config: dict[str, Any]) -> int:
    """Number of routed experts in a Hugging Face config; 0 for a dense model."""
    for key in EXPERT_COUNT_KEYS:
        value = hf_config.get(key)
        if value:
            return int(value)
    return 0


def display_path(path: str | os.PathLike[str]) -> str:
    """`path` relative to the current directory when it lies below it (shorter messages), else as is."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
