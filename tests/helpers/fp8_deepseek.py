"""A tiny DeepSeek-V3 written by transformers (``save_pretrained``: no ``moe_layer_freq``,
``topk_method`` or ``rope_scaling``, as users' conversions write it) and quantized as the published
checkpoint is: float8 e4m3 linear weights in 128 x 128 blocks with fp32 ``weight_scale_inv``, and
``quantization_config`` in config.json. Embeddings, norms, routers and the output head stay
unquantized, as in DeepSeek-V3's files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.helpers.tiny_configs import TINY_CONFIGS
from tests.workers.sglang_workers import peaked_weights_

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo"
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
E4M3_MAX = 448.0
VOCAB = 32  # the demo tokenizer's


def quantize_blockwise(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 weights and fp32 scale_inv per block (amax / 448), as DeepSeek-V3's files hold."""
    br, bc = block
    rows, cols = -(-weight.shape[0] // br), -(-weight.shape[1] // bc)
    scale_inv = torch.empty(rows, cols)
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = weight[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            s = tile.abs().max().clamp(min=1e-12) / E4M3_MAX
            scale_inv[i, j] = s
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale_inv


def quantized_name(name: str, t: torch.Tensor) -> bool:
    """Whether DeepSeek-V3's published files hold ``name`` in float8: the 2-D projection weights."""
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")
    return t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip)


def save_fp8_deepseek(out: Path, seed: int = 0) -> Path:
    """The tiny FP8 DeepSeek-V3 checkpoint at ``out`` (``TINY_CONFIGS``' with the demo's character
    tokenizer and its 32-id vocabulary); random weights of a useful scale (peaked next-token
    distributions)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**(TINY_CONFIGS["deepseek_v3"] | {"vocab_size": VOCAB}))
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    peaked_weights_(model)
    model.save_pretrained(out, safe_serialization=True)
    tensors = {}
    for name, t in load_file(str(out / "model.safetensors")).items():
        if quantized_name(name, t):
            tensors[name], tensors[f"{name}_scale_inv"] = quantize_blockwise(t, (128, 128))
        else:
            tensors[name] = t
    for path in out.glob("*.safetensors"):
        path.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf, "quantization_config": FP8_CONFIG}, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, out / f)
    return out
