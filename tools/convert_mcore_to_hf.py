"""Thin wrapper: ``python tools/convert_mcore_to_hf.py --ckpt DIR [--hf-config DIR] --out DIR [--tp N ...]``.

Same as ``grpo-megatron convert mcore-to-hf`` (see grpo_megatron/commands/convert.py); run it under
torchrun to load at a sharded layout, e.g.
``torchrun --nproc-per-node 2 tools/convert_mcore_to_hf.py --ckpt DIR --out DIR --tp 2``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_megatron.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", "mcore-to-hf", *sys.argv[1:]]))
