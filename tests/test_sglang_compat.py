"""rollout/sglang/compat.py: each fix applies where its cause is, and does what it says (each check in
a fresh interpreter, as the fixes change imported modules)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_torchvision_imports_beside_the_cpu_torch_and_transformers_models_load() -> None:
    """PyPI's torchvision (a CUDA build) cannot load its ops here; the .pth make setup writes arms the
    fix in every process, so torchvision and transformers' models import."""
    out = _run(
        """
        import torch, torchvision
        from transformers import Qwen3MoeForCausalLM
        from grpo_megatron.rollout.sglang import compat
        print(compat.applied(), torch.cuda.is_available())
        """
    )
    assert out == "['torchvision_missing_ops'] False"


def test_a_config_type_transformers_has_may_be_registered_again() -> None:
    """SGLang 0.5.17 registers configs for types transformers >= 5.13 has (e.g. qwen3_asr): the
    fix lets the second registration through, and only for known types."""
    out = _run(
        """
        from transformers import AutoConfig, PretrainedConfig
        from transformers.models.qwen3_moe import Qwen3MoeConfig
        try:
            AutoConfig.register("qwen3_moe", Qwen3MoeConfig)
            before = "allowed"
        except ValueError:
            before = "refused"
        from grpo_megatron.rollout.sglang import compat
        fix = next(f for f in compat.FIXES if f.name == "transformers_config_reregistered")
        assert fix.needed()
        fix.apply()
        assert not fix.needed()  # applied once
        AutoConfig.register("qwen3_moe", Qwen3MoeConfig)
        class Fresh(PretrainedConfig):
            model_type = "grpo_megatron_fresh_type"
        AutoConfig.register("grpo_megatron_fresh_type", Fresh)
        print(before)
        """
    )
    assert out == "refused"
