"""megatron distributed checkpoints on disk: directory conventions, atomic writes, model-only checkpoints.

A checkpoint directory holds megatron's ``dist_checkpointing`` files (``metadata.json``,
``common.pt``, ``*.distcp``) plus ours; it is complete only when it holds ``grpo_checkpoint.json``
(the completion marker), written after everything else and just before the directory is renamed
from its temporary name (``<name>.tmp-<nonce>``) to its final one. Readers never take a
temporary directory or one without the marker.

Model-only checkpoints (``save_model_checkpoint``) are what ``grpo-megatron convert hf-to-mcore``
writes; ``load_model_checkpoint`` reads the model of those and of full training checkpoints,
at any parallel layout (megatron reshards on load).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpo_megatron.bridge.layout import unwrap
from grpo_megatron.checkpoint.marker import LATEST, MARKER, CheckpointError
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.distributed.collectives import on_rank0
from grpo_megatron.fileio import TMP_INFIX, write_text_atomic

FORMAT_VERSION = 1

# megatron's sharded state dict options, recorded in the checkpoint (content metadata) and used
# again on load. chained_optim_avoid_prefix: optimizer tensors are keyed by parameter, not by
# position in the chain of optimizers, so they load at another expert-parallel layout.
BASE_CONTENT_METADATA: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def keep_writer_results_in_process() -> bool:
    """megatron-core's checkpoint writer (``dist_checkpointing/strategies/filesystem_async.py``) hands a
    save's write results from the code that writes to the code that finalizes through ``_results_queue``,
    by default the queue of a multiprocessing manager it spawns at the first save
    (``_get_write_results_queue``): what an asynchronous save needs, a background process putting and the
    trainer getting. Ours are synchronous (``dist_checkpointing.save`` without ``async_sharded_save``:
    ``AsyncRequest.execute_sync`` writes in the rank), so both ends are in the rank's own process and an
    in-process queue serves them. No helper process is left for Slurm's SIGTERM to every process of a
    step to kill (the manager died of it and the next save's ``put`` raised BrokenPipeError: a preempted
    job saved nothing, issue 51 item 5), and none starts and imports torch at the first save (3 s of the
    first checkpoint of every job). False where megatron-core keeps no such queue, or one is in place."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return False
    if getattr(filesystem_async, "_results_queue", False) is not None:  # absent (False) or in place
        return False
    filesystem_async._results_queue = queue.Queue()
    return True


def load_failures() -> tuple[type[BaseException], ...]:
    """What a failed megatron/torch checkpoint load raises: torch's ``CheckpointException`` derives
    from BaseException, so ``except Exception`` alone lets it through unnamed."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def layout_of(ps: ParallelState) -> dict[str, int]:
    """The parallel layout a checkpoint was written at (recorded in its marker)."""
    return {
        "world_size": ps.world_size,
        "tp": ps.tp,
        "pp": ps.pp,
        "cp": ps.cp,
        "dp": ps.dp,
        "ep": ps.ep,
        "etp": ps.etp,
    }


def new_temporary_dir(final: Path) -> Path:
    """Create (on rank 0) and return a fresh temporary sibling ``<final>.tmp-<nonce>``, same on all ranks."""

    def make() -> str:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{final.name}{TMP_INFIX}{secrets.token_hex(4)}")
        tmp.mkdir()
        return str(tmp)

    return Path(on_rank0(make))


def finish(tmp: Path, final: Path, marker: dict[str, Any]) -> None:
    """Rank 0: write the completion marker into ``tmp``, then rename it to ``final``.

    An existing ``final`` (an earlier run's save of the same name) is moved aside first and
    removed after the rename.
    """
    write_text_atomic(tmp / MARKER, json.dumps(marker, indent=2, sort_keys=True) + "\n")
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}{TMP_INFIX}replaced-{secrets.token_hex(4)}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def model_dtype(model: torch.nn.Module) -> str:
    """Parameter dtype name ("float32", "bfloat16", ...) of ``model``."""
    return str(next(unwrap(model).parameters()).dtype).removeprefix("torch.")


def model_sharded_state_dict(model: torch.nn.Module, metadata: dict[str, Any]) -> dict[str, Any]:
    """megatron's sharded state dict of the GPTModel (inside DDP, if wrapped)."""
    return unwrap(model).sharded_state_dict(metadata=metadata)


def save_model_checkpoint(
    model: torch.nn.Module,
    ps: ParallelState,
    out_dir: str | Path,
    extra_metadata: dict[str, Any] | None = None,
    *,
    vocab_size: int,
) -> Path:
    """Collective: write the model's weights as a megatron distributed checkpoint at ``out_dir``.

    Loads at any parallel layout (``load_model_checkpoint``). Written to a temporary sibling and
    renamed, so ``out_dir`` holds either nothing or a complete checkpoint. ``extra_metadata``
    (JSON-serialisable) goes into the completion marker, with the model's shape (``vocab_size``:
    the tokenizer's, unpadded).
    """
    from megatron.core import dist_checkpointing

    out_dir = Path(out_dir)

    def check_target() -> None:
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise FileExistsError(f"{out_dir} exists and is not empty: choose a new output directory")

    on_rank0(check_target)
    tmp = new_temporary_dir(out_dir)
    metadata = dict(BASE_CONTENT_METADATA)
    keep_writer_results_in_process()
    dist_checkpointing.save(
        {"model": model_sharded_state_dict(model, metadata)}, str(tmp), content_metadata=metadata
    )
    from grpo_megatron.checkpoint.integrity import model_shape

    marker = {
        "kind": "model",
        "format_version": FORMAT_VERSION,
        "dtype": model_dtype(model),
        "model": model_shape(model, vocab_size),
        "layout": layout_of(ps),
        **(extra_metadata or {}),
    }

    def rename() -> None:
        if out_dir.exists():
            out_dir.rmdir()  # empty: checked above
        finish(tmp, out_dir, marker)

    on_rank0(rename)
    dist.barrier()
    return out_dir


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint, or the one named by its ``latest`` file."""
    path = Path(path)
    if (path / LATEST).is_file() and not (path / MARKER).is_file():
        name = (path / LATEST).read_text().strip()
        return path / name
    return path


def load_model_checkpoint(
    model: torch.nn.Module,
    ps: ParallelState,
    ckpt_dir: str | Path,
    *,
    vocab_size: int,
    model_source: str = "",
) -> dict[str, Any]:
    """Collective: load the model weights of checkpoint ``ckpt_dir`` (model-only or training) into
    ``model``, which may be built at another layout. Returns the checkpoint's marker.

    The checkpoint is verified first (``integrity.verify_checkpoint``): damaged files, unsafe
    metadata and another model's shape (``model_source`` says where this model's config came
    from) stop with a CheckpointError naming the files."""
    from megatron.core import dist_checkpointing

    from grpo_megatron.checkpoint.integrity import model_shape, verify_checkpoint

    path = resolve_checkpoint(ckpt_dir)
    shape = model_shape(model, vocab_size)
    marker = on_rank0(lambda: verify_checkpoint(path, shape=shape, source=model_source), f"checking {path}")
    metadata = dist_checkpointing.load_content_metadata(str(path)) or dict(BASE_CONTENT_METADATA)
    try:
        loaded = dist_checkpointing.load({"model": model_sharded_state_dict(model, metadata)}, str(path))
    except load_failures() as exc:
        raise CheckpointError(f"loading {path} failed: {type(exc).__name__}: {exc}") from exc
    unwrap(model).load_state_dict(loaded["model"])
    return marker
