"""Block-wise FP8 weights as DeepSeek-V3's published checkpoints hold them, for engines that serve FP8
(``rollout.weight_dtype=fp8``) while the trainer stays in bf16.

Format (DeepSeek-V3's ``quantization_config``: ``quant_method: fp8``, ``fmt: e4m3``,
``activation_scheme: dynamic``, ``weight_block_size: [128, 128]``; ``FP8_QUANTIZATION_CONFIG``): a
quantized linear weight ``W`` [N, K] travels as two tensors,

- ``<name>``: ``Q = e4m3(W / s)`` [N, K], float8_e4m3fn;
- ``<name minus .weight>.weight_scale_inv``: ``s`` [ceil(N / 128), ceil(K / 128)], float32, one per
  128 x 128 block ``b``: ``s_b = max(amax_b, 1e-4) / 448`` with ``amax_b = max |W|`` over the block
  (448 = the largest finite e4m3 value), so ``W ~ Q * s`` (the name "scale_inv": the engine
  multiplies by it).

``block_quantize`` computes exactly that, in float32 on the tensor's own device, and equals SGLang's
own ``sglang.srt.layers.quantization.mxfp8_block_convert.bf16_to_block_fp8_128`` byte for byte
(tests/test_fp8_rollout.py imports it from the installed SGLang): same padding of partial blocks with
zeros, same float32 amax, clamp and division, same cast. Computed per band of block rows so a large
weight needs a float32 band, not a float32 copy of itself.

Which weights are quantized (``quantized_name``): the linear projections inside the decoder layers
(attention, dense MLPs, shared and routed experts, MLA's down- and up-projections), 2-D; everything
SGLang keeps in the model's dtype under an FP8 config stays as it is: embeddings, the output head,
norms, MoE routers and their biases (SGLang builds them unquantized: its FP8 method takes linear and
fused-MoE layers only, routers are ``ReplicatedLinear(quant_config=None)`` or plain parameters), and
whatever a checkpoint's own ``ignored_layers`` / ``modules_to_not_convert`` exclude.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

FP8_BLOCK = (128, 128)
"""Rows x columns of one scale block (DeepSeek-V3's ``weight_block_size``)."""
E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value: a block's largest |w| maps onto it."""
AMAX_FLOOR = 1e-4
"""A block's amax is clamped to at least this (an all-zero block gets a finite scale), as SGLang's
``bf16_to_block_fp8_128`` and DeepGEMM's ``per_block_cast_to_fp8`` do."""
SCALE_SUFFIX = "_scale_inv"
"""``<layer>.weight`` -> ``<layer>.weight_scale_inv`` (DeepSeek-V3's files, SGLang's parameter)."""
BAND_ELEMENTS = 1 << 24
"""Elements of the float32 band ``block_quantize`` works on at once (64 MiB): bounds its temporaries."""

FP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(FP8_BLOCK),
}
"""The ``quantization_config`` an FP8 engine starts from: DeepSeek-V3's published one."""

QUANTIZED_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "w1",
    "w2",
    "w3",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)
"""Leaf module names of the linear layers an FP8 engine holds in FP8 (Qwen2/3(-MoE), Mixtral's
experts ``w1``/``w2``/``w3``, DeepSeek-V3's MLA): the weights quantized on the way to it."""


def scale_name(weight_name: str) -> str:
    """``...o_proj.weight`` -> ``...o_proj.weight_scale_inv``."""
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: Sequence[int], block: tuple[int, int] = FP8_BLOCK) -> tuple[int, int]:
    """The scale grid of a [N, K] weight: [ceil(N / block rows), ceil(K / block columns)]."""
    n, k = shape
    return -(-n // block[0]), -(-k // block[1])


def skipped_by(name: str, ignored: Iterable[str]) -> bool:
    """Whether a checkpoint's ``ignored_layers`` / ``modules_to_not_convert`` excludes the layer of
    weight ``name``: one of them is the layer's path or a prefix of it, with or without ``model.``
    (SGLang's ``Fp8Config.from_config`` keeps both forms and matches prefixes)."""
    layer = name.removesuffix(".weight")
    for entry in ignored:
        base = entry.removeprefix("model.")
        for form in (base, f"model.{base}"):
            if layer == form or layer.startswith(form + "."):
                return True
    return False


def quantized_name(name: str, shape: Sequence[int], ignored: Iterable[str] = ()) -> bool:
    """Whether an FP8 engine holds HF tensor ``name`` of ``shape`` as FP8 weight + scales: a 2-D
    ``.weight`` of a ``QUANTIZED_PROJECTIONS`` layer inside the decoder layers, not excluded by the
    checkpoint's ``ignored``; everything else is sent as it is (module docstring)."""
    if len(shape) != 2 or not name.endswith(".weight") or ".layers." not in name:
        return False
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return leaf in QUANTIZED_PROJECTIONS and not skipped_by(name, ignored)


def block_quantize(
    weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, s)``: float8_e4m3fn ``Q`` [N, K] and float32 ``s`` [ceil(N/bn), ceil(K/bk)] with, per
    block b, ``s_b = max(amax_b, 1e-4) / 448`` and ``Q = e4m3(W / s_b)`` (module docstring), on
    ``weight``'s device. DeepSeek-V3's format (its ``fp8_cast_bf16.py`` multiplies back); equal to
    SGLang's ``bf16_to_block_fp8_128`` byte for byte. Works band by band of ``bn`` rows (partial
    blocks padded with zeros, which leave every amax as it is)."""
    if weight.dim() != 2:
        raise ValueError(f"block_quantize takes a 2-D weight, got shape {tuple(weight.shape)}")
    bn, bk = block
    n, k = weight.shape
    rows, cols = scale_shape((n, k), block)
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.empty((rows, cols), dtype=torch.float32, device=weight.device)
    band_rows = max(1, BAND_ELEMENTS // (bn * cols * bk))  # block rows per band
    for r0 in range(0, rows, band_rows):
        r1 = min(rows, r0 + band_rows)
        lo, hi = r0 * bn, min(n, r1 * bn)
        band = weight[lo:hi]
        if hi - lo == (r1 - r0) * bn and k == cols * bk and band.is_contiguous():
            # whole blocks: the amax of the tensor's own dtype (|w| and max are exact in any float
            # dtype, so its float32 value is the float32 amax), one float32 copy divided in place
            blocks = band.view(r1 - r0, bn, cols, bk)
            amax = blocks.abs().amax(dim=(1, 3), keepdim=True).to(torch.float32)
            values = blocks.to(torch.float32, copy=True)
        else:  # partial blocks at an edge: padded with zeros, which leave every amax as it is
            padded = torch.zeros(((r1 - r0) * bn, cols * bk), dtype=torch.float32, device=weight.device)
            padded[: hi - lo, :k] = band
            values = padded.view(r1 - r0, bn, cols, bk)
            amax = values.abs().amax(dim=(1, 3), keepdim=True)
        s = amax.clamp(min=AMAX_FLOOR) / E4M3_MAX
        q[lo:hi] = values.div_(s).to(torch.float8_e4m3fn).view(-1, cols * bk)[: hi - lo, :k]
        scale[r0:r1] = s.view(r1 - r0, cols)
    return q, scale


def block_dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """``Q * s`` per block in float32 (what an engine computes with): DeepSeek-V3's ``weight_dequant``."""
    n, k = q.shape
    full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * full


@dataclass(frozen=True)
class Fp8Weights:
    """Which HF tensors of an export go to the engines as FP8 weight + scales (``quantized_name``),
    and how: the block and the layers the engine's FP8 config leaves unquantized. Picklable: the
    export plan (bridge/export_plan.py) carries it."""

    block: tuple[int, int] = FP8_BLOCK
    ignored: tuple[str, ...] = ()
    """The engine's ``ignored_layers`` / ``modules_to_not_convert``."""

    @classmethod
    def of(cls, quantization_config: Mapping[str, Any] | None) -> Fp8Weights:
        """The rule an engine of ``quantization_config`` (a checkpoint's, or none: ours) holds."""
        config = quantization_config or FP8_QUANTIZATION_CONFIG
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or ()
        block = tuple(config.get("weight_block_size") or FP8_BLOCK)
        if len(block) != 2:
            raise ValueError(f"quantization_config weight_block_size={block!r}: a 2-D block is needed")
        return cls((int(block[0]), int(block[1])), tuple(ignored))

    def quantizes(self, name: str, shape: Sequence[int]) -> bool:
        return quantized_name(name, shape, self.ignored)

    def held_dtype(self, name: str, shape: Sequence[int]) -> torch.dtype | None:
        """The dtype an FP8 engine holds tensor ``name`` of ``shape`` in, judged by name alone (the
        manifest's own entries): float8 for a weight it quantizes, float32 for such a weight's scales;
        None for any other (held in the engine's dtype)."""
        if name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX)
            return torch.float32 if len(shape) == 2 and self.quantizes(weight, shape) else None
        return torch.float8_e4m3fn if self.quantizes(name, shape) else None

    def manifest(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The (name, shape, dtype) an HF tensor is sent as: itself, or its FP8 weight and its scales."""
        if not self.quantizes(name, shape):
            return [(name, shape, dtype)]
        return [
            (name, shape, torch.float8_e4m3fn),
            (scale_name(name), scale_shape(shape, self.block), torch.float32),
        ]

    def quantize(self, pieces: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``pieces`` as they are sent: each quantized tensor replaced by its FP8 weight and scales
        (new tensors on its device), the others as they are."""
        out: list[tuple[str, torch.Tensor]] = []
        for name, t in pieces:
            if self.quantizes(name, tuple(t.shape)):
                q, s = block_quantize(t, self.block)
                out += [(name, q), (scale_name(name), s)]
            else:
                out.append((name, t))
        return out
