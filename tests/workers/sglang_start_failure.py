"""An SGLang engine whose scheduler fails while it starts, through the adapter, in a process of its own.

``python -m tests.workers.sglang_start_failure WORKDIR`` saves the demo's model with its weight file
cut short after the header (the adapter reads the header; SGLang's loader, in the scheduler, fails
on the data) and starts ``SGLangEngine`` on it as a trainer rank would. The rank must end naming the
engine, its rank, host, cause and log (``EngineStartError``, exit 3 here; or, when the scheduler's
SIGQUIT comes first, ``health.sigquit_while_starting``: exit ``EXIT_ENGINE_DIED``), not be SIGKILLed
by SGLang's launch-phase handler with nothing said.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

from tests.workers.sglang_workers import save_model


def cut_after_header(path: Path, keep: int = 64) -> None:
    """Keep a safetensors file's header and ``keep`` bytes of its data."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(raw[: 8 + header_len + keep])


def main(workdir: Path) -> int:
    from grpo_megatron.rollout.config import RolloutConfig
    from grpo_megatron.rollout.sglang.engine import SGLangEngine
    from grpo_megatron.rollout.sglang.health import EngineStartError
    from grpo_megatron.rollout.sglang.launch import EngineLaunch

    model = workdir / "cut"
    save_model(model, seed=0)
    cut_after_header(model / "model.safetensors")
    launch = EngineLaunch("bfloat16", device="cpu", log_dir=str(workdir / "logs"))
    try:
        SGLangEngine(RolloutConfig(engine="sglang"), str(model), launch)
    except EngineStartError as exc:
        print(f"grpo-megatron: error: {exc}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
