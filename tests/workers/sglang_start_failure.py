"""An SGLang engine whose scheduler fails while it starts, through the adapter, in a process of its own.

``python -m tests.workers.sglang_start_failure WORKDIR`` saves the demo's model with its final norm
at half its width (the adapter only records the checkpoint's shapes; SGLang's weight loader, in the
scheduler, asserts on it) and starts ``SGLangEngine`` on it as a trainer rank would. The rank must end naming the
engine, its rank, host, cause and log (``EngineStartError``, exit 3 here; or, when the scheduler's
SIGQUIT comes first, ``health.sigquit_while_starting``: exit ``EXIT_ENGINE_DIED``), not be SIGKILLed
by SGLang's launch-phase handler with nothing said.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.workers.sglang_workers import save_model


def halve(path: Path, name: str) -> None:
    """Rewrite a safetensors file with tensor ``name`` cut to half its length."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors[name] = tensors[name][: tensors[name].shape[0] // 2].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})


def main(workdir: Path) -> int:
    from grpo_megatron.rollout.config import RolloutConfig
    from grpo_megatron.rollout.sglang.engine import SGLangEngine
    from grpo_megatron.rollout.sglang.health import EngineStartError
    from grpo_megatron.rollout.sglang.launch import EngineLaunch

    model = workdir / "misshapen"
    save_model(model, seed=0)
    halve(model / "model.safetensors", "model.norm.weight")
    launch = EngineLaunch("bfloat16", device="cpu", log_dir=str(workdir / "logs"))
    try:
        SGLangEngine(RolloutConfig(engine="sglang"), str(model), launch)
    except EngineStartError as exc:
        print(f"grpo-megatron: error: {exc}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
