"""Thin wrapper: ``python tools/convert_hf_to_mcore.py --hf DIR --out DIR [--tp N --pp N --ep N --etp N]``.

Same as ``grpo-megatron convert hf-to-mcore`` (see grpo_megatron/commands/convert.py); run it under
torchrun to load at a sharded layout, e.g.
``torchrun --nproc-per-node 2 tools/convert_hf_to_mcore.py --hf DIR --out DIR --ep 2``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_megatron.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-mcore", *sys.argv[1:]]))
