"""``grpo-megatron convert``: Hugging Face safetensors <-> megatron distributed checkpoints.

- ``hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N --etp N --backend gloo|nccl]``: builds the model from
  ``DIR/config.json`` at that layout (the launch's world size; torchrun for several ranks), loads
  the safetensors (each rank reads only its slices) and writes a model-only distributed
  checkpoint, which loads at any other layout. config.json and the tokenizer files are copied
  beside it, so ``mcore-to-hf`` needs no ``--hf-config`` for it.
- ``mcore-to-hf --ckpt DIR [--hf-config DIR] --out DIR [--tp ...]``: builds the model at the launch
  layout, loads the checkpoint's model (a converted one or a training checkpoint's
  ``iter_XXXXXXX``), streams it through ``bridge/export.export_hf_stream`` into safetensors shards
  with their index, config.json and the tokenizer files. ``--hf-config`` (default: the checkpoint
  directory) supplies config.json and the tokenizer. A checkpoint of a LoRA run (``model.lora``,
  recorded in its marker) is built with its adapters and written merged (``W + scale * B A``).
- ``mcore-to-peft --ckpt DIR [--hf-config DIR] --out DIR [--tp ...]``: the adapters of a LoRA run's
  checkpoint as a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``,
  ``bridge/peft_export.py``) that ``peft.PeftModel.from_pretrained`` loads onto the base model.

Outputs appear atomically: a temporary sibling directory is renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from grpo_megatron.distributed.bootstrap import ParallelState
    from grpo_megatron.models.config import LoRAConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConvertError(ValueError):
    """Bad input to a conversion: names the path or option and the fix."""


def read_hf_config(directory: str | Path, option: str) -> dict[str, Any]:
    """config.json of a Hugging Face model directory given as ``option``; ConvertError naming it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConvertError(f"{option} {directory}: no such directory")
    path = directory / "config.json"
    if not path.is_file():
        raise ConvertError(
            f"{option} {directory}: no config.json in it: point {option} at a Hugging Face model directory"
        )
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(hf, dict):
        raise ConvertError(f"{path} holds a {type(hf).__name__}, not a JSON object")
    return hf


def config_dtype(hf: dict[str, Any]) -> str:
    """The dtype config.json declares (transformers 5 writes ``dtype``, 4.x ``torch_dtype``); else float32."""
    declared = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return declared if declared in DTYPES[1:] else "float32"


def _start(
    hf_dir: Path, hf: dict[str, Any], args: argparse.Namespace, dtype: str, lora: dict[str, Any] | None = None
) -> tuple[ParallelState, GPTModel, int]:
    """Process groups at the requested layout and this rank's model shard (with ``lora``, a
    checkpoint marker's adapters: ``checkpoint/integrity.py:model_shape``)."""
    from grpo_megatron.config import model_layout_errors
    from grpo_megatron.distributed.bootstrap import init_distributed, world_size_from_env
    from grpo_megatron.distributed.config import ParallelConfig
    from grpo_megatron.models.builder import build_gpt_model
    from grpo_megatron.models.config import ModelConfig

    model_cfg = ModelConfig(hf_path=str(hf_dir), dtype=dtype)  # type: ignore[arg-type]
    parallel = ParallelConfig(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        etp=args.etp,
        use_distributed_optimizer=False,
        backend=args.backend,
    )
    world_size = world_size_from_env()
    errors = parallel.layout_errors(world_size) or model_layout_errors(model_cfg, hf, parallel)
    if errors:
        raise ConvertError("; ".join(errors).replace("parallel.", "--"))
    ps = init_distributed(parallel)
    model, spec = build_gpt_model(hf, model_cfg, ps)
    if lora:
        from grpo_megatron.models.lora import add_lora

        add_lora(model, lora_config(lora), seed=0, gated=bool(spec.transformer_config.gated_linear_unit))
    model.eval()
    return ps, model, spec.vocab_size


def hf_to_mcore(args: argparse.Namespace) -> Path:
    """Collective: HF safetensors at ``args.hf`` -> model-only distributed checkpoint at ``args.out``."""
    import torch.distributed as dist

    from grpo_megatron.bridge.hf_loader import CheckpointError as HFCheckpointError
    from grpo_megatron.bridge.hf_loader import load_hf_weights, tokenizer_files
    from grpo_megatron.checkpoint.dist import save_model_checkpoint
    from grpo_megatron.distributed.collectives import on_rank0

    hf_dir = Path(args.hf)
    hf = read_hf_config(hf_dir, "--hf")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"--out {out} exists and is not empty: choose a new output directory")
    dtype = config_dtype(hf) if args.dtype == "auto" else args.dtype
    ps, model, vocab_size = _start(hf_dir, hf, args, dtype)
    try:
        load_hf_weights(model, ps, hf_dir, hf)
    except HFCheckpointError as exc:
        raise ConvertError(f"--hf: {exc}") from exc
    save_model_checkpoint(
        model,
        ps,
        out,
        {"source": str(hf_dir.resolve()), "model_type": hf.get("model_type"), "hf_config": "config.json"},
        vocab_size=vocab_size,
    )

    def copy_hf_files() -> None:
        # Beside the checkpoint files (no name clashes): what mcore-to-hf needs to write HF again.
        for path in (hf_dir / "config.json", *tokenizer_files(hf_dir)):
            shutil.copy2(path, out / path.name)

    on_rank0(copy_hf_files)
    dist.barrier()
    return out


def lora_config(recorded: dict[str, Any]) -> LoRAConfig:
    """The ``model.lora`` section a checkpoint's marker recorded (rank, alpha, targets)."""
    from grpo_megatron.models.config import LoRAConfig

    return LoRAConfig(
        rank=int(recorded["rank"]), alpha=float(recorded["alpha"]), targets=list(recorded["targets"])
    )


def mcore_to_peft(args: argparse.Namespace) -> Path:
    """Collective: the LoRA adapters of checkpoint ``args.ckpt`` -> PEFT adapter directory ``args.out``."""
    from grpo_megatron.bridge.peft_export import write_peft_adapter

    ps, model, hf, hf_dir, marker = _load_checkpoint(args)
    lora = marker.get("model", {}).get("lora")
    if not lora:
        raise ConvertError(
            f"--ckpt {args.ckpt}: not a LoRA run's checkpoint (its marker records no model.lora): "
            "use mcore-to-hf for its weights"
        )
    write_peft_adapter(model, ps, hf, lora_config(lora), Path(args.out), base_model=str(args.hf_config or ""))
    return Path(args.out)


def mcore_to_hf(args: argparse.Namespace) -> Path:
    """Collective: the model of checkpoint ``args.ckpt`` -> HF safetensors directory ``args.out``
    (a LoRA run's: merged)."""
    import torch.distributed as dist

    from grpo_megatron.bridge.hf_loader import tokenizer_files
    from grpo_megatron.bridge.safetensors_writer import write_hf_checkpoint

    ps, model, hf, hf_dir, marker = _load_checkpoint(args)
    dtype = marker.get("dtype", "float32") if args.dtype == "auto" else args.dtype
    hf_out = {**hf, "dtype": dtype}
    write_hf_checkpoint(
        model,
        ps,
        hf,
        Path(args.out),
        hf_config=hf_out,
        extra_files=tokenizer_files(hf_dir),
        bucket_bytes=args.bucket_mb << 20,
    )
    dist.barrier()
    return Path(args.out)


def _load_checkpoint(
    args: argparse.Namespace,
) -> tuple[ParallelState, GPTModel, dict[str, Any], Path, dict[str, Any]]:
    """Collective: the model of checkpoint ``args.ckpt`` built at the launch's layout (with the
    adapters its marker records) and loaded; with its HF config, that config's directory and the marker."""
    from grpo_megatron.checkpoint.dist import load_model_checkpoint, resolve_checkpoint
    from grpo_megatron.checkpoint.marker import CheckpointError, read_marker

    if not Path(args.ckpt).is_dir():
        raise ConvertError(f"--ckpt {args.ckpt}: no such directory")
    ckpt = resolve_checkpoint(args.ckpt)
    try:
        marker = read_marker(ckpt)
    except CheckpointError as exc:
        raise ConvertError(f"--ckpt: {exc}") from exc
    hf_dir = Path(args.hf_config) if args.hf_config else ckpt
    hf = read_hf_config(hf_dir, "--hf-config" if args.hf_config else "--hf-config (default: --ckpt)")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"--out {out} exists and is not empty: choose a new output directory")
    dtype = marker.get("dtype", "float32") if args.dtype == "auto" else args.dtype
    ps, model, vocab_size = _start(hf_dir, hf, args, dtype, lora=(marker.get("model") or {}).get("lora"))
    try:
        load_model_checkpoint(
            model, ps, ckpt, vocab_size=vocab_size, model_source=f"--hf-config {hf_dir / 'config.json'}"
        )
    except (CheckpointError, RuntimeError) as exc:  # RuntimeError: rank 0's CheckpointError, on the others
        raise ConvertError(str(exc)) from exc
    return ps, model, hf, hf_dir, marker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``convert`` subcommand's two directions and their options."""
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    to_mcore = sub.add_parser(
        "hf-to-mcore",
        help="HF safetensors -> megatron distributed checkpoint (loads at any layout)",
        description="HF safetensors -> megatron distributed checkpoint (loads at any layout)",
    )
    to_mcore.add_argument("--hf", required=True, metavar="DIR", help="Hugging Face model directory")
    to_mcore.add_argument("--out", required=True, metavar="DIR", help="new checkpoint directory")
    to_hf = sub.add_parser(
        "mcore-to-hf",
        help="megatron checkpoint (converted or training iter_XXXXXXX) -> HF safetensors",
        description="megatron checkpoint (converted or training iter_XXXXXXX) -> HF safetensors",
    )
    to_hf.add_argument(
        "--ckpt", required=True, metavar="DIR", help="checkpoint directory (or one with `latest`)"
    )
    to_hf.add_argument(
        "--hf-config",
        metavar="DIR",
        default=None,
        help="directory with config.json and tokenizer files (default: --ckpt, where hf-to-mcore put them)",
    )
    to_hf.add_argument("--out", required=True, metavar="DIR", help="new HF model directory")
    to_hf.add_argument(
        "--bucket-mb", type=int, default=512, help="safetensors shard size in MiB (default 512)"
    )
    to_peft = sub.add_parser(
        "mcore-to-peft",
        help="a LoRA run's checkpoint -> PEFT adapter (adapter_config.json + adapter_model.safetensors)",
        description="a LoRA run's checkpoint -> PEFT adapter (adapter_config.json + adapter_model.safetensors)",
    )
    to_peft.add_argument(
        "--ckpt", required=True, metavar="DIR", help="checkpoint directory (or one with `latest`)"
    )
    to_peft.add_argument(
        "--hf-config",
        metavar="DIR",
        default=None,
        help="the base model's directory (config.json; default: --ckpt); written as the "
        "adapter's base_model_name_or_path",
    )
    to_peft.add_argument("--out", required=True, metavar="DIR", help="new PEFT adapter directory")
    for p in (to_mcore, to_hf, to_peft):
        p.add_argument("--tp", type=int, default=1, help="tensor parallel size of this launch (default 1)")
        p.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
        p.add_argument("--ep", type=int, default=1, help="expert parallel size (default 1)")
        p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
        p.add_argument(
            "--backend",
            choices=("auto", "gloo", "nccl"),
            default="auto",
            help="torch.distributed backend and device: gloo = CPU, nccl = CUDA; auto = nccl when CUDA "
            "is available (default auto)",
        )
        p.add_argument(
            "--dtype",
            choices=DTYPES,
            default="auto",
            help="model dtype; auto = config.json's (hf-to-mcore) or the checkpoint's (mcore-to-hf)",
        )


def main(args: argparse.Namespace) -> int:
    """Run one conversion; errors in the input give exit code 2 and a message naming it."""
    import sys

    from grpo_megatron.distributed.bootstrap import destroy_distributed

    run = {"hf-to-mcore": hf_to_mcore, "mcore-to-hf": mcore_to_hf, "mcore-to-peft": mcore_to_peft}[
        args.direction
    ]
    try:
        out = run(args)
    except ConvertError as exc:
        print(f"grpo-megatron convert {args.direction}: error: {exc}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"[convert] {args.direction}: wrote {out}", flush=True)
    destroy_distributed()
    return 0


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``convert`` arguments alone (for tools/ wrappers and tests)."""
    parser = argparse.ArgumentParser(prog="grpo-megatron convert")
    add_arguments(parser)
    return parser.parse_args(argv)
