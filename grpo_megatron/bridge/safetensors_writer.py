"""A Hugging Face checkpoint directory written from the export stream (bridge/export.py):
``write_hf_checkpoint`` (collective) and its consumer ``SafetensorsWriter`` (atomic: everything goes
to a temporary sibling that replaces the output directory on close)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from grpo_megatron.bridge.bucket_io import Bucket
from grpo_megatron.bridge.export import export_hf_stream
from grpo_megatron.distributed.bootstrap import ParallelState


def write_hf_checkpoint(
    model: torch.nn.Module,
    ps: ParallelState,
    hf: Mapping[str, Any],
    out_dir: str | Path,
    *,
    hf_config: Mapping[str, Any] | None = None,
    extra_files: tuple[Path, ...] = (),
    bucket_bytes: int = 512 << 20,
    dst_rank: int = 0,
) -> None:
    """Collective: stream ``model`` into a Hugging Face directory that ``dst_rank`` writes atomically
    (safetensors shards, index, ``hf_config`` or ``hf`` as config.json, ``extra_files`` such as the
    tokenizer); nothing is left at ``out_dir`` if the export fails. Used by ``convert mcore-to-hf``,
    the SFT output and the trainer's final export."""
    writer = (
        SafetensorsWriter(out_dir, hf_config or hf, extra_files=extra_files) if ps.rank == dst_rank else None
    )
    stream = export_hf_stream(model, ps, hf, bucket_bytes=bucket_bytes, dst_rank=dst_rank)
    if writer is None:
        for _ in stream:  # this rank only sends its slices
            pass
        return
    with writer:
        for bucket in stream:
            writer(bucket)


class SafetensorsWriter:
    """Consumer that writes each bucket as one safetensors shard, then the index and config.json.

    Everything goes to a temporary sibling directory that replaces ``out_dir`` only in
    ``close()``, so a failed export leaves nothing half-written at ``out_dir``. Use as a context
    manager: an exception inside the block removes the temporary directory.
    """

    def __init__(
        self, out_dir: str | Path, hf_config: Mapping[str, Any], *, extra_files: tuple[Path, ...] = ()
    ) -> None:
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and any(self.out_dir.iterdir()):
            raise FileExistsError(f"{self.out_dir} exists and is not empty: choose a new output directory")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.partial-", dir=self.out_dir.parent))
        # The stream writes unquantized tensors: a source's quantization_config (a blockwise-FP8
        # checkpoint, dequantized on load by bridge/hf_loader.py) no longer describes them.
        self.hf_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
        self.extra_files = extra_files  # e.g. tokenizer files, copied as they are
        self.files: list[tuple[str, list[str], int]] = []  # (temporary file name, keys, bytes)

    def __call__(self, bucket: Bucket) -> None:
        from safetensors.torch import save_file

        name = f"part-{len(self.files):05d}.safetensors"
        save_file(dict(bucket), str(self.tmp / name), metadata={"format": "pt"})
        self.files.append(
            (name, [k for k, _ in bucket], sum(t.numel() * t.element_size() for _, t in bucket))
        )

    def close(self) -> Path:
        n = len(self.files)
        weight_map: dict[str, str] = {}
        for i, (tmp_name, keys, _) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.tmp / tmp_name, self.tmp / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {
            "metadata": {"total_size": sum(b for _, _, b in self.files)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (self.tmp / "config.json").write_text(json.dumps(self.hf_config, indent=2, sort_keys=True) + "\n")
        for path in self.extra_files:
            shutil.copy2(path, self.tmp / path.name)
        if self.out_dir.exists():
            self.out_dir.rmdir()  # empty (checked in __init__)
        os.replace(self.tmp, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
