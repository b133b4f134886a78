"""Thin wrapper: ``python tools/verify_hf.py CONFIG [section.key=value ...] [--tol 1e-4]``.

Same as ``grpo-megatron verify`` (see grpo_megatron/commands/verify.py); run it under torchrun to
verify a sharded layout, e.g.
``torchrun --nproc-per-node 2 tools/verify_hf.py examples/tiny_moe.yaml model.hf_path=DIR parallel.tp=2``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_megatron.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))
