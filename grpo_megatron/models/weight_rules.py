"""Weight rules: how an adapter declares the Hugging Face tensors of each canonical megatron tensor.

A ``WeightRule`` ties one canonical megatron tensor (layout-independent: global layer and expert
indices, unsharded; see ``bridge/layout.py``) to the Hugging Face tensor(s) it is made of, and
names the transform. Adapters (``grpo_megatron/models/*.py``) only list rules with the constructors
below; the arithmetic of each kind (``copy``, ``glu``, ``qkv``, ``vocab``) lives one layer up, in
``bridge/transforms.py``, which reads and writes tensors by these declarations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Pure declarations (no torch): the CLI imports adapters, so `grpo-megatron --help` stays instant.

Kind = Literal["copy", "glu", "qkv", "vocab"]


@dataclass(frozen=True)
class QKVGroups:
    """Grouped-query attention geometry of a fused ``linear_qkv``."""

    heads: int  # query heads
    groups: int  # key/value heads (query groups)
    head_dim: int

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups


@dataclass(frozen=True)
class WeightRule:
    """One canonical megatron tensor and the Hugging Face tensors it maps to."""

    mcore: str  # canonical megatron name, e.g. "decoder.layers.3.self_attention.linear_qkv.weight"
    hf: tuple[str, ...]  # HF names, in the order the transform concatenates them
    kind: Kind = "copy"
    qkv: QKVGroups | None = None  # kind == "qkv" only
    vocab_size: int | None = None  # kind == "vocab" only: real (unpadded) rows
    buffer: bool = False  # a megatron buffer (e.g. the router's expert_bias), not a parameter
    export: bool = True  # False: load-only (the tied output layer is exported as the embedding)
    dtype: str | None = None
    """Exported in this dtype whatever the export's (``"float32"``: DeepSeek-V3's selection bias, which
    Hugging Face, megatron and both engines keep in fp32; in bf16 its small spread reorders top-k
    selection); None: the export's dtype."""

    def __post_init__(self) -> None:
        expected = {"copy": 1, "glu": 2, "qkv": 3, "vocab": 1}[self.kind]
        if len(self.hf) != expected:
            raise ValueError(f"{self.mcore}: kind {self.kind!r} takes {expected} HF names, got {self.hf}")
        if (self.kind == "qkv") != (self.qkv is not None):
            raise ValueError(f"{self.mcore}: qkv geometry must be given exactly for kind 'qkv'")
        if (self.kind == "vocab") != (self.vocab_size is not None):
            raise ValueError(f"{self.mcore}: vocab_size must be given exactly for kind 'vocab'")


# ---- rule constructors: what adapters call -------------------------------------------------------
def copy(mcore: str, hf: str, *, buffer: bool = False, dtype: str | None = None) -> WeightRule:
    return WeightRule(mcore, (hf,), buffer=buffer, dtype=dtype)


def glu(mcore: str, gate: str, up: str) -> WeightRule:
    return WeightRule(mcore, (gate, up), "glu")


def qkv(mcore: str, q: str, k: str, v: str, geometry: QKVGroups) -> WeightRule:
    return WeightRule(mcore, (q, k, v), "qkv", qkv=geometry)


def vocab(mcore: str, hf: str, vocab_size: int, *, export: bool = True) -> WeightRule:
    return WeightRule(mcore, (hf,), "vocab", vocab_size=vocab_size, export=export)


# ---- LoRA adapters: their rules follow from the base weight's ------------------------------------
LORA_SUFFIX = "_lora"
"""A targeted linear layer ``X`` has a sibling ``X_lora`` holding ``lora_A`` and ``lora_B`` (models/lora.py)."""


def lora_hf_name(hf_weight: str, factor: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return f"{hf_weight.removesuffix('.weight')}.{factor}.weight"


def lora_rules(base: dict[str, WeightRule], present: set[str]) -> dict[str, WeightRule]:
    """The rules of the adapters in ``present`` (canonical names ``X_lora.lora_A`` / ``lora_B``), in
    the HF order of their base weights: B's rows are the weight's rows, so B takes the base rule's
    kind (the QKV and GLU splits are row splits); A is shared by every HF tensor of a fused weight,
    and travels once, under the first one's name."""
    rules: dict[str, WeightRule] = {}
    for rule in base.values():
        if not rule.mcore.endswith(".weight"):
            continue
        stem = rule.mcore.removesuffix(".weight") + LORA_SUFFIX
        a, b = f"{stem}.lora_A", f"{stem}.lora_B"
        if a not in present:
            continue
        hf_b = tuple(lora_hf_name(h, "lora_B") for h in rule.hf)
        rules[a] = copy(a, lora_hf_name(rule.hf[0], "lora_A"))
        rules[b] = WeightRule(b, hf_b, rule.kind, qkv=rule.qkv)
    return rules
