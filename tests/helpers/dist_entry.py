"""Per-rank entry used by :func:`tests.helpers.dist.run_distributed` (``python -m`` under torchrun).

argv: ``target out_dir``. Imports ``target``, calls it with the pickled kwargs and saves the
result to ``out_dir/rank{R}.pt``; on an exception it writes ``out_dir/rank{R}.error`` (the
traceback) and exits non-zero. It does not initialise the process group: the target does.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from grpo_megatron.distributed.megatron_jit import skip_fuser_when_compile_disabled

_ALLOWED_LEAVES = (torch.Tensor, float, int, bool, str, type(None))


def check_result(value: Any, where: str = "result") -> None:
    """Raise ``TypeError`` naming the path of the first value ``torch.load(weights_only=True)`` refuses."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: dict keys must be str or int, got {type(key).__name__}")
            check_result(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_result(item, f"{where}[{i}]")
    elif not isinstance(value, _ALLOWED_LEAVES):
        raise TypeError(f"{where}: {type(value).__name__} cannot be returned; use tensors, numbers, strings")


def main(argv: list[str]) -> int:
    # As in pytest (pyproject.toml's filterwarnings): a warning attributed to our own code is a bug.
    warnings.filterwarnings("error", module=r"grpo_megatron(\..*)?$")
    target, out_dir = argv[1], Path(argv[2])
    skip_fuser_when_compile_disabled()  # as the CLI does, before the target imports megatron-core
    rank = int(os.environ["RANK"])
    # For the harness to kill this rank on a timeout (torchrun puts it in a session of its own).
    (out_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    try:
        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        kwargs = pickle.loads((out_dir / "kwargs.pkl").read_bytes())
        result = func(**kwargs)
        check_result(result)
        if isinstance(result, torch.Tensor):
            result = result.detach().clone()
        torch.save(result, out_dir / f"rank{rank}.pt")
    except BaseException:
        (out_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        traceback.print_exc()
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
