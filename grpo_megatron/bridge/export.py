"""Streaming export: megatron shards -> Hugging Face-named full tensors, in byte-budgeted buckets.

This is the resharding core: the per-iteration weight sync to rollout engines, the mcore-to-hf
converter and the tests all consume the same stream.

How a tensor travels (every rank walks the same global list of canonical tensors, in the
adapter's HF order, so the collectives line up):
1. the ranks holding it in the first data-parallel replica all-gather it over their TP group
   (ETP group for experts): ``bridge/layout.gather``;
2. that group's TP rank 0 (the *source*) sends it point to point to the destination rank, unless
   it is the destination. This covers both the EP gather (expert E lives on one EP rank) and the
   PP hand-off (a layer lives on one stage);
3. the destination turns it into HF tensors (``transforms.to_hf``) and adds them to the bucket;
   a full bucket is yielded (handed to the consumer) and dropped.
Only the destination materialises full tensors beyond one gathered tensor per TP group; its
extra memory is one bucket plus one tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.bridge.hf_loader import canonical_shape, local_tensors, rules_by_name
from grpo_megatron.bridge.layout import gather, is_first_replica, tp_group_of
from grpo_megatron.bridge.transforms import to_hf
from grpo_megatron.distributed.bootstrap import ParallelState

Bucket = list[tuple[str, torch.Tensor]]
Consumer = Callable[[Bucket], None]


@torch.no_grad()
def export_hf_stream(
    model: torch.nn.Module,
    ps: ParallelState,
    hf: Mapping[str, Any],
    *,
    bucket_bytes: int = 512 << 20,
    dst_rank: int = 0,
    dtype: torch.dtype | None = None,
) -> Iterator[Bucket]:
    """Yield buckets of (HF name, full CPU tensor) on ``dst_rank``; other ranks yield nothing but
    must iterate the generator to the end (they take part in the collectives).

    ``bucket_bytes``: a bucket is yielded once it holds at least this many bytes (a tensor is
    never split). ``dtype``: cast on export (None keeps the training dtype).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    rules = rules_by_name(hf)
    mine: dict[str, tuple[torch.Tensor, Any]] = {}
    announced: list[tuple[str, tuple[int, ...], str]] = []
    for _, tensor, layout in local_tensors(model, ps, rules):
        if not is_first_replica(layout, ps):
            continue
        mine[layout.canonical_name] = (tensor, layout)
        if tp_group_of(layout, ps)[2] == 0:
            announced.append((layout.canonical_name, canonical_shape(tensor, layout, ps), str(tensor.dtype)))
    # Metadata only (names, shapes, dtypes): who sources which tensor.
    everyone: list[list[tuple[str, tuple[int, ...], str]] | None] = [None] * ps.world_size
    dist.all_gather_object(everyone, announced)
    source: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
    for rank, entries in enumerate(everyone):
        for canonical, shape, dt in entries or []:
            source.setdefault(canonical, (rank, shape, getattr(torch, dt.removeprefix("torch."))))
    unmapped = sorted(set(source) - set(rules))
    missing = sorted(r.mcore for r in rules.values() if r.mcore not in source and r.export)
    if unmapped or missing:
        raise RuntimeError(
            f"model and {hf.get('model_type')} adapter disagree: megatron tensors without a rule "
            f"{unmapped[:5]}, rules without a megatron tensor {missing[:5]}"
        )

    bucket: Bucket = []
    filled = 0
    for rule in rules.values():
        if not rule.export:
            continue
        src, shape, src_dtype = source[rule.mcore]
        full = None
        if rule.mcore in mine:
            tensor, layout = mine[rule.mcore]
            full = gather(tensor, layout, ps)  # a collective of this tensor's TP/ETP group
        if src != dst_rank:
            if ps.rank == src:
                dist.send(full.contiguous(), dst=dst_rank)
            elif ps.rank == dst_rank:
                full = torch.empty(shape, dtype=src_dtype, device=ps.device)
                dist.recv(full, src=src)
        if ps.rank != dst_rank:
            continue
        assert full is not None
        for hf_name, t in to_hf(rule, full):
            t = t.to(device="cpu", dtype=dtype or t.dtype).contiguous().clone()
            bucket.append((hf_name, t))
            filled += t.numel() * t.element_size()
        if filled >= bucket_bytes:
            yield bucket
            bucket, filled = [], 0
    if bucket:
        yield bucket


def export_hf(
    model: torch.nn.Module,
    ps: ParallelState,
    hf: Mapping[str, Any],
    consumer: Consumer,
    *,
    bucket_bytes: int = 512 << 20,
    dst_rank: int = 0,
    dtype: torch.dtype | None = None,
) -> None:
    """Run the export stream on every rank; ``consumer(bucket)`` is called on ``dst_rank``."""
    for bucket in export_hf_stream(model, ps, hf, bucket_bytes=bucket_bytes, dst_rank=dst_rank, dtype=dtype):
        consumer(bucket)


class SafetensorsWriter:
    """Consumer that writes each bucket as one safetensors shard, then the index and config.json.

    Everything goes to a temporary sibling directory that replaces ``out_dir`` only in
    ``close()``, so a failed export leaves nothing half-written at ``out_dir``. Use as a context
    manager: an exception inside the block removes the temporary directory.
    """

    def __init__(self, out_dir: str | Path, hf_config: Mapping[str, Any], *, extra_files: tuple[Path, ...] = ()) -> None:
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and any(self.out_dir.iterdir()):
            raise FileExistsError(f"{self.out_dir} exists and is not empty: choose a new output directory")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.partial-", dir=self.out_dir.parent))
        self.hf_config = dict(hf_config)
        self.extra_files = extra_files  # e.g. tokenizer files, copied as they are
        self.files: list[tuple[str, list[str], int]] = []  # (temporary file name, keys, bytes)

    def __call__(self, bucket: Bucket) -> None:
        from safetensors.torch import save_file

        name = f"part-{len(self.files):05d}.safetensors"
        save_file(dict(bucket), str(self.tmp / name), metadata={"format": "pt"})
        self.files.append((name, [k for k, _ in bucket], sum(t.numel() * t.element_size() for _, t in bucket)))

    def close(self) -> Path:
        n = len(self.files)
        weight_map: dict[str, str] = {}
        for i, (tmp_name, keys, _) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.tmp / tmp_name, self.tmp / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {"metadata": {"total_size": sum(b for _, _, b in self.files)}, "weight_map": dict(sorted(weight_map.items()))}
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
