"""The config.json an SGLang engine reads: the checkpoint's, made something SGLang starts from (pure
functions, then written into an engine-side folder beside the engine's logs when anything changes).

- a ``quantization_config`` is removed: the engine holds the trainer's dequantized weights, starting
  from dummy ones that the first sync fills; with ``rollout.weight_dtype=fp8`` it is kept (a block-FP8
  checkpoint's) or set (DeepSeek-V3's published one, ``bridge/fp8.py:FP8_QUANTIZATION_CONFIG``): the
  engine holds FP8 weights, from dummy ones the first sync fills with weight + scales;
- a DeepSeek-V3 written by transformers gets the published ``moe_layer_freq``, ``topk_method`` and
  ``scoring_func`` and, without any rope scaling, an identity YaRN (factor 1) that SGLang's CPU MLA
  needs.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_megatron.bridge.fp8 import FP8_QUANTIZATION_CONFIG, Fp8Weights

DEEPSEEK_PUBLISHED_DEFAULTS: dict[str, Any] = {
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
}
"""Fields of DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3) that SGLang's DeepSeek model
reads as attributes (``srt/models/deepseek_v2.py``: ``config.moe_layer_freq``, ``config.topk_method``,
``config.scoring_func``) but transformers' ``DeepseekV3Config`` does not write (its routing is always
that: sigmoid scores, top-k with the ``e_score_correction_bias``, every layer after the dense ones MoE)."""

DEEPSEEK_MODEL_TYPES = ("deepseek_v3",)


def identity_yarn(max_position: int) -> dict[str, Any]:
    """A YaRN rope scaling of factor 1: the plain rotary embedding, as a scaling (factor 1 makes YaRN's
    interpolated and extrapolated frequencies equal and both of its mscales 1). SGLang's CPU MLA
    rotary embedding (``srt/layers/rotary_embedding/factory.py:get_rope_cpu``) asserts a
    ``rope_scaling`` and supports only DeepSeek's YaRN; a DeepSeek-V3 config written by transformers
    without one would not start there."""
    return {
        "rope_type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": max_position,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


def engine_config(hf_config: Mapping[str, Any], fp8: bool = False) -> tuple[dict[str, Any], list[str]]:
    """``(the config.json SGLang is started from, what differs from the checkpoint's and why)``:

    - without ``fp8``, a ``quantization_config`` is removed: SGLang would build float8 layers from it
      and the weight sync's bf16 tensors would be cast into them beside the checkpoint's stale scales;
      the engine starts unquantized, with dummy weights that the first sync fills
      (``colocated_server_args``);
    - with ``fp8`` (``rollout.weight_dtype=fp8``) the engine starts quantized: a block-FP8 checkpoint's
      ``quantization_config`` is kept, any other model gets DeepSeek-V3's published one
      (``FP8_QUANTIZATION_CONFIG``); the sync sends weight + scales (``bridge/fp8.py``);
    - DeepSeek-V3: the published fields transformers does not write (``DEEPSEEK_PUBLISHED_DEFAULTS``)
      and, without any rope scaling, ``identity_yarn``.
    Empty list: the checkpoint's config serves as it is."""
    config, changes = dict(hf_config), []
    if fp8 and config.get("quantization_config") is None:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
        changes.append(
            "quantization_config: block-wise FP8 (rollout.weight_dtype=fp8; the sync sends weight + scales)"
        )
    elif not fp8 and config.pop("quantization_config", None) is not None:
        changes.append("quantization_config removed (the engine holds the trainer's dequantized weights)")
    if config.get("model_type") in DEEPSEEK_MODEL_TYPES:
        for key, value in DEEPSEEK_PUBLISHED_DEFAULTS.items():
            if key not in config:
                config[key] = value
                changes.append(f"{key}={value!r} (DeepSeek-V3's published value; SGLang reads it)")
        rope = config.get("rope_parameters") or {}
        if not config.get("rope_scaling") and rope.get("rope_type", "default") == "default":
            yarn = identity_yarn(int(config.get("max_position_embeddings", 4096)))
            if "rope_parameters" in config:
                config["rope_parameters"] = {**rope, **yarn}
            else:
                config["rope_scaling"] = yarn
            changes.append(
                "rope scaling: YaRN of factor 1, the plain rotary embedding (SGLang's CPU MLA needs one)"
            )
    return config, changes


def quantized(hf_config: Mapping[str, Any]) -> bool:
    return hf_config.get("quantization_config") is not None


def starts_on_dummy(hf_config: Mapping[str, Any], weights_on_disk: bool, fp8: bool) -> bool:
    """Whether an engine starts on dummy weights (``load_format=dummy``) that the run's first sync, before
    any generation, fills: no weight files, a quantized checkpoint (started unquantized: its float8
    files are never read), or FP8 serving (``fp8``: the sync sends the trainer's weights quantized)."""
    return not weights_on_disk or quantized(hf_config) or fp8


def engine_fp8(fp8: bool, hf_config: Mapping[str, Any]) -> Fp8Weights | None:
    """Which tensors an engine of ``rollout.weight_dtype=fp8`` (``fp8``) holds as FP8 weight + scales,
    by the quantization config it is started with (``engine_config``); None: it holds none."""
    return Fp8Weights.of(hf_config.get("quantization_config")) if fp8 else None


def write_engine_model(model_path: str | os.PathLike, config: Mapping[str, Any], directory: Path) -> Path:
    """``directory`` made the model folder SGLang reads: ``config`` as its config.json, every other file
    of ``model_path`` linked (tokenizer, weights, code; not ``hf_quant_config.json``). Returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    for source in Path(model_path).resolve().iterdir():
        if source.name in ("config.json", "hf_quant_config.json") or not source.is_file():
            continue
        link = directory / source.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(source)
    tmp = directory / "config.json.tmp"
    tmp.write_text(json.dumps(dict(config), indent=1))
    tmp.replace(directory / "config.json")
    return directory


def engine_model_path(
    model_path: str,
    hf_config: Mapping[str, Any],
    log_dir: str | os.PathLike | None,
    rank: int,
    fp8: bool = False,
) -> tuple[str, list[str]]:
    """Where SGLang reads the model from: ``model_path`` itself, or an engine-side folder in ``log_dir``
    (the engine's logs; None: the system's temporary directory) when its config needs
    ``engine_config``'s changes (``fp8``: ``rollout.weight_dtype=fp8``); and those changes."""
    config, changes = engine_config(hf_config, fp8)
    if not changes:
        return model_path, []
    base = Path(log_dir or tempfile.gettempdir())
    folder = write_engine_model(model_path, config, base / f"engine-model-rank{rank}-{os.getpid()}")
    return str(folder), changes


def read_hf_config(model_path: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
