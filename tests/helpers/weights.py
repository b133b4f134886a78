"""Test-only weight helpers: a full canonical state loaded into a sharded model (the reverse of
``bridge/layout.py:full_state``) and a ``Reader`` over in-memory HF tensors."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_megatron.bridge.layout import ShardLayout, shard_layouts, tp_group_of
from grpo_megatron.bridge.transforms import Reader
from grpo_megatron.distributed.bootstrap import ParallelState


def scatter(full: torch.Tensor, layout: ShardLayout, ps: ParallelState) -> torch.Tensor:
    """This rank's shard of a canonical tensor (no communication)."""
    _, size, rank = tp_group_of(layout, ps)
    if layout.partition_dim is None or size == 1:
        return full
    dim = layout.partition_dim
    halves = full.chunk(2, dim=dim) if layout.glu else (full,)
    return torch.cat([h.chunk(size, dim=dim)[rank] for h in halves], dim=dim)


@torch.no_grad()
def load_full_state(model: torch.nn.Module, ps: ParallelState, state: dict[str, torch.Tensor]) -> None:
    """Copy each rank's slice of canonical tensors into its parameters (all must be present)."""
    for name, param, layout in shard_layouts(model, ps):
        if layout.canonical_name not in state:
            raise KeyError(f"{layout.canonical_name} (local {name}) missing from the state to load")
        shard = scatter(state[layout.canonical_name], layout, ps)
        if shard.shape != param.shape:
            raise ValueError(
                f"{layout.canonical_name}: shard {tuple(shard.shape)} != param {tuple(param.shape)}"
            )
        param.copy_(shard)


def dict_reader(tensors: dict[str, torch.Tensor]) -> Reader:
    """A ``Reader`` over in-memory HF tensors (tests, engines that already hold a state dict)."""

    def read(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        if name not in tensors:
            raise KeyError(f"HF tensor {name!r} missing")
        t = tensors[name]
        return t if dim is None else t.narrow(dim, start, stop - start)

    return read


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory``."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out
