"""Prompt datasets, templates, offline tokenizers, the resumable sampler and procedural tasks.

The names below are imported lazily (PEP 562): importing ``grpo_megatron.data`` (as the job config
does for ``data.config``) loads neither transformers nor numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo_megatron.data.datasets import (
        PromptDatasets,
        SFTDatasets,
        build_prompt_datasets,
        build_sft_dataset,
        load_prompt_datasets,
        load_sft_datasets,
        render_prompt,
    )
    from grpo_megatron.data.generators import GENERATORS, Problem, generate_splits
    from grpo_megatron.data.records import DataError, DataStats, PromptRecord, SFTRecord
    from grpo_megatron.data.sampler import PromptSampler
    from grpo_megatron.data.tokenizer import build_char_tokenizer, load_tokenizer

_EXPORTS: dict[str, str] = {
    "PromptRecord": "records",
    "SFTRecord": "records",
    "DataStats": "records",
    "DataError": "records",
    "PromptDatasets": "datasets",
    "SFTDatasets": "datasets",
    "build_prompt_datasets": "datasets",
    "build_sft_dataset": "datasets",
    "load_prompt_datasets": "datasets",
    "load_sft_datasets": "datasets",
    "render_prompt": "datasets",
    "GENERATORS": "generators",
    "Problem": "generators",
    "generate_splits": "generators",
    "PromptSampler": "sampler",
    "build_char_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}

__all__ = [
    "DataError",
    "DataStats",
    "GENERATORS",
    "Problem",
    "PromptDatasets",
    "PromptRecord",
    "PromptSampler",
    "SFTDatasets",
    "SFTRecord",
    "build_char_tokenizer",
    "build_prompt_datasets",
    "build_sft_dataset",
    "generate_splits",
    "load_prompt_datasets",
    "load_sft_datasets",
    "load_tokenizer",
    "render_prompt",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"grpo_megatron.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'grpo_megatron.data' has no attribute {name!r}")
