"""Published FP8 checkpoints (DeepSeek-V3's format: float8 e4m3 weights in blocks, one fp32
``weight_scale_inv`` per block, ``quantization_config`` in config.json) load dequantized, exactly,
or are refused naming the fix; never cast without their scales (bridge/hf_loader.py).

The checkpoints are written here in that format from a tiny random transformers model; the
reference is the same weights dequantized block by block in plain loops and saved unquantized.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_megatron.bridge.hf_loader import CheckpointError, HFCheckpoint, fp8_block_size
from tests.helpers.dist import run_distributed
from tests.helpers.fp8_deepseek import quantize_blockwise
from tests.workers.bridge_workers import save_tiny_model


def dequantize_by_loops(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    br, bc = block
    out = q.float()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * br : (i + 1) * br, j * bc : (j + 1) * bc] *= scale_inv[i, j]
    return out


def _write(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def test_reads_dequantize_every_slice_exactly_with_ragged_edge_blocks(tmp_path: Path) -> None:
    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, scale_inv = quantize_blockwise(weight, (128, 128))  # 3 x 2 blocks, the last ones ragged
    _write(tmp_path, {"w.weight": q, "w.weight_scale_inv": scale_inv}, {"quantization_config": FP8_CONFIG})
    reference = dequantize_by_loops(q, scale_inv, (128, 128))
    assert (reference - weight).abs().max() < 0.1 * weight.abs().max()  # the format, not the loader
    with HFCheckpoint(tmp_path, fp8_block=fp8_block_size({"quantization_config": FP8_CONFIG})) as ckpt:
        assert torch.equal(ckpt.read("w.weight", None, 0, 0), reference)
        for dim, start, stop in ((0, 100, 260), (0, 256, 300), (1, 50, 190), (1, 128, 200), (0, 0, 1)):
            expected = reference.narrow(dim, start, stop - start)
            assert torch.equal(ckpt.read("w.weight", dim, start, stop), expected), (dim, start, stop)
        assert ckpt.read("w.weight_scale_inv", None, 0, 0).dtype == torch.float32  # not float8: as stored


def test_unsupported_quantization_and_unscaled_fp8_are_refused_naming_the_fix(tmp_path: Path) -> None:
    for quant in (
        {"quant_method": "gptq", "bits": 4},
        {"quant_method": "fp8"},
        {"quant_method": "fp8", "weight_block_size": [128]},
    ):
        with pytest.raises(CheckpointError, match="Convert the checkpoint to bf16 first"):
            fp8_block_size({"quantization_config": quant})
    q, scale_inv = quantize_blockwise(torch.randn(8, 8), (4, 4))
    _write(tmp_path, {"w.weight": q, "v.weight": q.clone()}, {})
    with (
        HFCheckpoint(tmp_path) as ckpt,
        pytest.raises(CheckpointError, match="no blockwise FP8 quantization_config"),
    ):
        ckpt.read("w.weight", None, 0, 0)
    with (
        HFCheckpoint(tmp_path, fp8_block=(4, 4)) as ckpt,
        pytest.raises(CheckpointError, match="v.weight_scale_inv"),
    ):
        ckpt.read("v.weight", 0, 0, 4)
    _write(tmp_path, {"w.weight": q, "w.weight_scale_inv": scale_inv[:1]}, {})
    with (
        HFCheckpoint(tmp_path, fp8_block=(4, 4)) as ckpt,
        pytest.raises(CheckpointError, match="weight_block_size"),
    ):
        ckpt.read("w.weight", None, 0, 0)


def _quantized_pair(src: Path, fp8_dir: Path, ref_dir: Path, block: tuple[int, int]) -> int:
    """``fp8_dir``: ``src`` with its linear weights in DeepSeek-V3's FP8 format; ``ref_dir``: the same
    weights dequantized by loops, unquantized config. Returns how many tensors were quantized."""
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    fp8, ref = {}, {}
    for name, t in tensors.items():
        linear = (
            t.dim() == 2
            and "norm" not in name
            and "embed" not in name
            and "lm_head" not in name
            and not name.endswith("mlp.gate.weight")
        )
        if linear:
            q, s = quantize_blockwise(t, block)
            fp8 |= {name: q, name + "_scale_inv": s}
            ref[name] = dequantize_by_loops(q, s, block)
        else:
            fp8[name] = ref[name] = t
    fp8_config = config | {"quantization_config": FP8_CONFIG | {"weight_block_size": list(block)}}
    _write(fp8_dir, fp8, fp8_config)
    _write(ref_dir, ref, config)
    return len(fp8) - len(ref)


@pytest.mark.launches
def test_a_tiny_fp8_deepseek_v3_loads_equal_to_its_dequantized_reference_at_tp2(tmp_path: Path) -> None:
    save_tiny_model("deepseek_v3", tmp_path / "src")
    # 16 x 16 blocks: the tiny model's 32-, 48-, 61- and 96-wide tensors span several, some ragged.
    quantized = _quantized_pair(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", (16, 16))
    assert quantized > 10
    per_rank = run_distributed(
        "tests.workers.bridge_workers:exported_tensors",
        2,
        timeout_s=240,
        dirs=[str(tmp_path / "fp8"), str(tmp_path / "ref")],
        overrides=["parallel.tp=2"],
        write_dir=str(tmp_path / "exported"),
    )
    fp8, ref = per_rank[0]
    assert fp8.keys() == ref.keys() and not any(k.endswith("_scale_inv") for k in fp8)
    assert all(torch.equal(fp8[k], ref[k]) for k in ref), [k for k in ref if not torch.equal(fp8[k], ref[k])][
        :4
    ]
    # The export writes unquantized tensors, so its config.json no longer claims FP8.
    written = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert "quantization_config" not in written and written["model_type"] == "deepseek_v3"
    shutil.rmtree(tmp_path / "src")
