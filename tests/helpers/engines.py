"""Tiny embedded engines and the transformers weights they load (tests/test_rollout.py,
tests/test_async.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny_configs import tiny_hf_config
from tests.workers.bridge_workers import save_tiny_model


def saved_model(model_type: str, tmp_path: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """A random transformers model saved with save_pretrained: (its tensors on disk, its logits)."""
    from safetensors.torch import load_file

    ref = save_tiny_model(model_type, tmp_path / model_type, seed=0)
    return load_file(str(tmp_path / model_type / "model.safetensors")), ref


def tiny_engine(model_type: str, **kwargs: Any) -> Any:
    """An ``EmbeddedEngine`` of ``model_type``'s tiny config."""
    from grpo_megatron.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(tiny_hf_config(model_type), **kwargs)


def load_weights(engine: Any, saved: dict[str, torch.Tensor], version: int = 1) -> None:
    """``saved`` into ``engine`` as ``version``, in two buckets."""
    names = sorted(saved)
    engine.update_weights([(n, saved[n]) for n in names[:7]], version=version, last=False)
    engine.update_weights([(n, saved[n]) for n in names[7:]], version=version, last=True)


def write_config(path: Path, config: dict) -> str:
    """A model folder holding only ``config`` as its config.json."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
