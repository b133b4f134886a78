"""Check a checkpoint directory before anything in it is loaded: complete, intact, safe, this model.

megatron-core's loader trusts what it reads: torch's distributed-checkpoint ``.metadata`` is read with
plain ``pickle`` and its byte items (modules' ``_extra_state``) with ``torch.load(weights_only=False)``,
so a crafted checkpoint runs code on load; a truncated shard ends in a bare ``EOFError`` with no path.
``verify_checkpoint`` reads every file the load will read, on rank 0, without running anything:

- ``.metadata`` through an unpickler that builds only torch's distributed-checkpoint metadata classes,
  ``torch.Size`` and dtypes (anything else is refused, naming the class);
- every shard file the metadata points at exists, inside the directory, and holds the bytes it
  should (a truncated or missing shard names its file);
- byte items, ``common.pt``, ``trainer_state.pt`` and the RNG files load with ``weights_only=True``;
- the completion marker parses, and the model shape it records matches the model being loaded.

Every failure is a ``CheckpointError`` naming the file; ``CheckpointMismatch`` (another model's
checkpoint) is its subclass, so resume can tell "corrupt, try an older one" from "wrong model".
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch

from grpo_megatron.checkpoint.marker import CheckpointError, read_marker

DCP_METADATA = ".metadata"
TRAINER_STATE = "trainer_state.pt"
RNG_DIR = "rng"

_DCP = "torch.distributed.checkpoint"
_SAFE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (f"{_DCP}.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {(f"{_DCP}.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}
    | {(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout")}
    | {
        ("torch", str(dtype).removeprefix("torch."))
        for dtype in vars(torch).values()
        if isinstance(dtype, torch.dtype)
    }
)
"""What a torch distributed checkpoint's ``.metadata`` pickles (read from torch 2.13's writer): its
metadata dataclasses and enums, sizes and dtypes. Nothing here runs code when built."""


class CheckpointMismatch(CheckpointError):
    """A sound checkpoint of another model (shape or dtype): loading it is a config mistake."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedReader, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _SAFE_GLOBALS:
            raise CheckpointError(
                f"{self.path} asks to build {module}.{name}, which a torch distributed checkpoint's "
                "metadata never holds: refusing to unpickle it (a crafted checkpoint runs code this "
                "way). Load only checkpoints you trust"
            )
        return super().find_class(module, name)


def read_dcp_metadata(ckpt: Path) -> Any:
    """The torch distributed-checkpoint metadata of ``ckpt``, unpickled with only its own classes."""
    path = ckpt / DCP_METADATA
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing: {ckpt} is not a complete distributed checkpoint") from exc
    except Exception as exc:  # truncated or garbled: EOFError, UnpicklingError, ...
        raise CheckpointError(
            f"{path} is damaged ({type(exc).__name__}: {exc}); the checkpoint cannot load"
        ) from exc


def _load_plain(path: Path, what: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} ({what}) is missing") from exc
    except Exception as exc:
        raise CheckpointError(
            f"{path} ({what}) does not load as plain data ({type(exc).__name__}: {exc}): it is truncated, "
            "damaged or holds code"
        ) from exc


def _check_shards(ckpt: Path, metadata: Any) -> None:
    """Every storage item's file exists inside ``ckpt`` and is long enough; byte items are plain data."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    sizes: dict[str, int] = {}
    byte_items = {
        fqn for fqn, item in metadata.state_dict_metadata.items() if isinstance(item, BytesStorageMetadata)
    }
    for index, info in metadata.storage_data.items():
        name = str(info.relative_path)
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(
                f"{ckpt / DCP_METADATA} points outside the checkpoint ({name!r}): refusing it"
            )
        shard = ckpt / name
        if name not in sizes:
            if not shard.is_file():
                raise CheckpointError(f"{shard} is missing (listed in {ckpt / DCP_METADATA})")
            sizes[name] = shard.stat().st_size
        end = int(info.offset) + int(info.length)
        if sizes[name] < end:
            raise CheckpointError(
                f"{shard} is truncated: {sizes[name]} bytes, but {index.fqn} ends at byte {end}"
            )
        if index.fqn in byte_items:
            with open(shard, "rb") as f:
                f.seek(int(info.offset))
                raw = f.read(int(info.length))
            if getattr(info, "transform_descriptors", None):
                continue  # compressed by a storage transform: torch decodes it; nothing we can read here
            try:
                torch.load(io.BytesIO(raw), weights_only=True)
            except Exception as exc:
                raise CheckpointError(
                    f"{shard}: item {index.fqn} is not plain data ({type(exc).__name__}); refusing to load "
                    "it (a crafted checkpoint runs code this way)"
                ) from exc


def verify_checkpoint(
    ckpt: str | Path, *, shape: dict[str, Any] | None = None, source: str = ""
) -> dict[str, Any]:
    """Rank 0: check checkpoint ``ckpt`` as the module docstring says; return its marker.

    ``shape``: the model about to be loaded (``model_shape``); compared with the one the marker
    records (checkpoints written before markers recorded it skip this), ``source`` saying where it
    came from in the message.
    """
    ckpt = Path(ckpt)
    try:
        marker = read_marker(ckpt)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{ckpt}/grpo_checkpoint.json is damaged ({exc}); the checkpoint cannot load"
        ) from exc
    if not isinstance(marker, dict):
        raise CheckpointError(f"{ckpt}/grpo_checkpoint.json holds no JSON object; the checkpoint cannot load")
    saved = marker.get("model")
    if shape is not None and isinstance(saved, dict):
        # LoRA adapters (model.lora) are part of the model: with them on either side, they must agree.
        keys = [k for k in shape if k in saved] + (
            ["lora"] if "lora" in saved and "lora" not in shape else []
        )
        differ = {k: (saved.get(k), shape.get(k)) for k in keys if saved.get(k) != shape.get(k)}
        if differ:
            shown = ", ".join(f"{k} {a} in the checkpoint vs {b}" for k, (a, b) in differ.items())
            raise CheckpointMismatch(
                f"{ckpt} holds another model than {source or 'the configured one'}: {shown}. Point at "
                "the checkpoint of this model, or at this checkpoint's model config"
            )
    try:
        json.loads((ckpt / "metadata.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{ckpt / 'metadata.json'} is missing or damaged ({exc})") from exc
    _check_shards(ckpt, read_dcp_metadata(ckpt))
    if (ckpt / "common.pt").exists():
        _load_plain(ckpt / "common.pt", "megatron's common state")
    if marker.get("kind") == "train":
        state = _load_plain(ckpt / TRAINER_STATE, "trainer state")
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{ckpt / TRAINER_STATE} holds a {type(state).__name__}, not the trainer state"
            )
        for rank in range(int(marker.get("layout", {}).get("world_size", 0))):
            _load_plain(ckpt / RNG_DIR / f"rank_{rank:05d}.pt", f"rank {rank}'s RNG state")
    return marker


def model_shape(model: torch.nn.Module, vocab_size: int) -> dict[str, Any]:
    """What a checkpoint must agree on to load into ``model``: recorded in the marker at save.
    ``vocab_size``: the tokenizer's vocabulary (ModelSpec.vocab_size), not the padded one, which
    changes with TP and megatron reshards."""
    from grpo_megatron.bridge.layout import unwrap

    gpt = unwrap(model)
    config = gpt.config
    return {
        "hidden_size": int(config.hidden_size),
        "num_layers": int(config.num_layers),
        "num_experts": int(config.num_moe_experts or 0),
        "vocab_size": int(vocab_size),
        "dtype": str(next(gpt.parameters()).dtype).removeprefix("torch."),
        **({"lora": dict(gpt.lora_shape)} if getattr(gpt, "lora_shape", None) else {}),
    }
