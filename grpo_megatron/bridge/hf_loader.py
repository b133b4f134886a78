"""Hugging Face safetensors directory -> megatron model at any TP/PP/EP/ETP layout.

Each rank reads only the slices of the HF tensors its own shards are made of (safetensors' lazy
``get_slice``), so per-rank memory is its shard, never the whole model. The names and layout
transforms come from the architecture's adapter (``weight_rules``); where a shard sits in its
canonical tensor comes from ``bridge/layout.py``.

Quantized checkpoints: a blockwise FP8 checkpoint (DeepSeek-V3's published weights: config.json's
``quantization_config`` ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``, float8 e4m3
weights, each with a ``<name>_scale_inv`` of one fp32 scale per block) is dequantized on read,
``weight[i, j] * scale_inv[i // 128, j // 128]`` (blocks at the right and bottom edges are ragged),
exactly as DeepSeek-V3's own ``fp8_cast_bf16.py`` does; any other ``quantization_config`` (and any
float8 tensor without its scales) is refused with the fix named, never cast silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from grpo_megatron.bridge.layout import canonical_shape, local_tensors, rules_by_name, tp_group_of
from grpo_megatron.bridge.transforms import hf_shapes, read_shard
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.fileio import read_weight_map
from grpo_megatron.models.registry import get_adapter

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
"""Files copied along with config.json when they exist (the tokenizer and generation defaults)."""


class CheckpointError(ValueError):
    """A Hugging Face checkpoint that does not match the model: names the key and the file."""


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"
"""A blockwise FP8 weight ``<name>``'s scales are ``<name>_scale_inv`` (DeepSeek-V3's format)."""


def fp8_block_size(hf: Mapping[str, Any]) -> tuple[int, int] | None:
    """The (rows, columns) of one FP8 scale block under config.json's ``quantization_config``; None
    when the checkpoint is not quantized. CheckpointError for any quantization this loader cannot
    dequantize exactly."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if (
        method == "fp8"
        and isinstance(block, (list, tuple))
        and len(block) == 2
        and all(int(b) > 0 for b in block)
    ):
        return int(block[0]), int(block[1])
    what = f"quant_method={method!r}" + (f", weight_block_size={block!r}" if method == "fp8" else "")
    raise CheckpointError(
        f"config.json's quantization_config ({what}) is not supported: only blockwise FP8 (quant_method "
        "'fp8' with a 2-D weight_block_size, DeepSeek-V3's published format) is dequantized on load. "
        "Convert the checkpoint to bf16 first (e.g. DeepSeek-V3's inference/fp8_cast_bf16.py, or load it in "
        "transformers and save_pretrained it unquantized), then point model.hf_path at that directory"
    )


def dequantize_blockwise(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], offset: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """fp32 ``weight[i, j] * scale_inv[(i + r0) // br, (j + c0) // bc]`` for a 2-D slice ``weight`` of
    a blockwise-FP8 tensor that starts at row ``r0``, column ``c0`` of it (``offset``); ``scale_inv``
    holds the blocks from ``r0 // br``, ``c0 // bc`` on (ragged edge blocks: the same scale)."""
    (br, bc), (r0, c0) = block, offset
    rows = (torch.arange(weight.shape[0]) + r0) // br - r0 // br
    cols = (torch.arange(weight.shape[1]) + c0) // bc - c0 // bc
    scale = scale_inv.float()[rows][:, cols]
    return weight.float() * scale


def check_safetensors(path: Path) -> list[str]:
    """The tensor names of safetensors file ``path``; CheckpointError naming it when it is damaged
    or truncated (``fileio.safetensors_problem``)."""
    from safetensors import safe_open

    from grpo_megatron.fileio import safetensors_problem

    problem = safetensors_problem(path)
    if problem is not None:
        raise CheckpointError(problem)
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def tokenizer_files(directory: Path) -> tuple[Path, ...]:
    return tuple(directory / name for name in TOKENIZER_FILES if (directory / name).is_file())


class HFCheckpoint:
    """Lazy reader of a safetensors checkpoint directory (single file or sharded with an index).

    Files are opened on first use and kept open until ``close()`` (or the ``with`` block ends).
    """

    def __init__(self, directory: str | Path, *, fp8_block: tuple[int, int] | None = None) -> None:
        self.directory = Path(directory)
        self.fp8_block = fp8_block
        """Scale block of a blockwise-FP8 checkpoint (``fp8_block_size``): float8 weights are
        dequantized on read; None: a float8 tensor is refused."""
        index = self.directory / INDEX_NAME
        single = self.directory / SINGLE_NAME
        if index.is_file():
            try:
                self.weight_map: dict[str, str] = read_weight_map(index)
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
        elif single.is_file():
            self.weight_map = dict.fromkeys(check_safetensors(single), SINGLE_NAME)
        else:
            raise CheckpointError(
                f"{self.directory}: neither {INDEX_NAME} nor {SINGLE_NAME} found: point at a Hugging Face "
                "model directory saved with safetensors (save_pretrained(..., safe_serialization=True))"
            )
        self._open: dict[str, Any] = {}

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def _slice(self, name: str) -> Any:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing from the checkpoint")
        file = self.weight_map[name]
        if file not in self._open:
            path = self.directory / file
            if not path.is_file():
                raise CheckpointError(
                    f"{self.directory}: shard file {file!r} (holding {name!r}) does not exist"
                )
            from safetensors import safe_open

            check_safetensors(path)
            handle = safe_open(str(path), framework="pt")
            self._open[file] = handle.__enter__()
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def file_of(self, name: str) -> str:
        return self.weight_map.get(name, "?")

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        """Rows/columns ``start:stop`` of ``name`` along ``dim`` (``None``: all of it); only those
        bytes are read. A blockwise-FP8 weight comes back dequantized (fp32), reading only the
        scale blocks the slice covers."""
        sl = self._slice(name)
        raw = sl[:] if dim is None else sl[tuple([slice(None)] * dim + [slice(start, stop)])]
        if raw.dtype not in FP8_DTYPES:
            return raw
        return self._dequantize(name, raw, dim, start, stop)

    def _dequantize(
        self, name: str, raw: torch.Tensor, dim: int | None, start: int, stop: int
    ) -> torch.Tensor:
        where = f"{self.directory}: tensor {name!r} in {self.file_of(name)} is {raw.dtype}"
        if self.fp8_block is None:
            raise CheckpointError(
                f"{where} but config.json has no blockwise FP8 quantization_config: its scales are unknown, "
                "and casting it would give wrong weights. Convert the checkpoint to bf16 first"
            )
        scale_name = name + SCALE_SUFFIX
        if raw.dim() != 2 or scale_name not in self.weight_map:
            raise CheckpointError(
                f"{where} with no 2-D block scales {scale_name!r}: it cannot be dequantized"
            )
        full = self.shape(name)
        block = self.fp8_block
        blocks = tuple(-(-n // b) for n, b in zip(full, block, strict=True))
        if self.shape(scale_name) != blocks:
            raise CheckpointError(
                f"{self.directory}: {scale_name!r} has shape {list(self.shape(scale_name))}, but {list(full)} weights "
                f"in {list(block)} blocks need {list(blocks)}: quantization_config.weight_block_size and the file disagree"
            )
        offset = [0, 0]
        scale_index: list[slice] = [slice(None), slice(None)]
        if dim is not None:
            offset[dim] = start
            scale_index[dim] = slice(start // block[dim], -(-stop // block[dim]))
        scale = self._slice(scale_name)[tuple(scale_index)]
        return dequantize_blockwise(raw, scale, block, (offset[0], offset[1]))


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module, ps: ParallelState, hf_dir: str | Path, hf: Mapping[str, Any]
) -> None:
    """Fill this rank's shards of ``model`` (built from ``hf`` at layout ``ps``) from ``hf_dir``.

    Every parameter must have a rule and every HF tensor it needs must exist with the expected
    shape; errors name the tensor, the file and the fix. Blockwise-FP8 weights are dequantized
    (module docstring); other quantized checkpoints are refused.
    """
    rules = rules_by_name(hf)
    with HFCheckpoint(hf_dir, fp8_block=fp8_block_size(hf)) as ckpt:
        # First check every name and shape (metadata only), so a bad checkpoint fails before any
        # parameter changes; then read and copy one shard at a time (peak memory: one shard).
        plan = []
        for name, target, layout in local_tensors(model, ps, rules):
            rule = rules.get(layout.canonical_name)
            if rule is None:
                raise CheckpointError(
                    f"megatron tensor {layout.canonical_name} (local {name}) has no HF mapping in the "
                    f"{get_adapter(hf).model_type} adapter: add a rule to its weight_rules"
                )
            full_shape = canonical_shape(target, layout, ps)
            for hf_name, expected in zip(rule.hf, hf_shapes(rule, full_shape), strict=True):
                got = ckpt.shape(hf_name)
                if got != expected:
                    raise CheckpointError(
                        f"{hf_dir}: tensor {hf_name!r} in {ckpt.file_of(hf_name)} has shape {list(got)}, but "
                        f"the model built from config.json expects {list(expected)} (for {layout.canonical_name}): "
                        "the config.json and the weights disagree"
                    )
            plan.append((rule, target, layout, full_shape))
        for rule, target, layout, full_shape in plan:
            _, size, rank = tp_group_of(layout, ps)
            shard = read_shard(rule, ckpt.read, full_shape, layout.partition_dim, size, rank)
            if tuple(shard.shape) != tuple(target.shape):  # a bug of ours, not of the checkpoint
                raise RuntimeError(
                    f"{layout.canonical_name}: read {tuple(shard.shape)}, shard is {tuple(target.shape)}"
                )
            target.copy_(shard.to(dtype=target.dtype, device=target.device))
