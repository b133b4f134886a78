"""Issue 50: SGLang's two CPU paths (rollout/sglang/cpu_path.py). Which one an engine takes follows the
CPU and ``rollout.sglang.cpu_path``; ``check`` and the engine's start refuse what the intel_amx path
cannot serve (fp32), naming both fixes; ``torch_native`` hides AMX from the engine's processes.
``GRPO_SGLANG_AMX=pretend`` stands for an AMX CPU here (SGLang's own AMX query answers True: the
same decision as on a Sapphire Rapids Xeon, whatever this machine is)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_megatron.config import load_config
from grpo_megatron.config.job import ConfigError
from grpo_megatron.config.validation import validate
from grpo_megatron.rollout.sglang.compat import AMX_ENV
from grpo_megatron.rollout.sglang.cpu_path import sglang_cpu_path
from grpo_megatron.rollout.sglang.health import EngineStartError
from grpo_megatron.rollout.sglang.launch import EngineLaunch, engine_environment

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.yaml"
KERNEL = importlib.util.find_spec("sgl_kernel") is not None
"""SGLang takes its AMX path only with its kernel library installed (`make setup WHEELHOUSE=...`)."""


def test_the_path_follows_what_sglang_sees_and_the_setting(monkeypatch) -> None:
    monkeypatch.setenv(AMX_ENV, "pretend")
    assert sglang_cpu_path() == ("intel_amx" if KERNEL else "torch_native")
    assert sglang_cpu_path("torch_native") == "torch_native"
    monkeypatch.setenv(AMX_ENV, "hide")
    assert sglang_cpu_path() == "torch_native"
    monkeypatch.delenv(AMX_ENV)
    assert sglang_cpu_path() == (
        "intel_amx" if KERNEL and torch.cpu._is_amx_tile_supported() else "torch_native"
    )


@pytest.mark.launches
@pytest.mark.skipif(
    not KERNEL, reason="SGLang takes its AMX path only with sgl_kernel: `make setup WHEELHOUSE=DIR`"
)
def test_check_refuses_an_fp32_model_on_the_amx_path_naming_both_fixes(monkeypatch) -> None:
    """The demo trains in fp32; on an AMX CPU SGLang's engine would die at its first forward."""
    monkeypatch.setenv(AMX_ENV, "pretend")
    with pytest.raises(ConfigError) as info:
        validate(load_config(DEMO, ["rollout.engine=sglang"]), 2)
    (error,) = [e for e in info.value.errors if "intel_amx" in e]
    assert error.startswith("model.dtype=float32 with rollout.engine=sglang on this CPU: it has AMX")
    assert "set model.dtype=bfloat16, or rollout.sglang.cpu_path=torch_native" in error
    validate(load_config(DEMO, ["rollout.engine=sglang", "rollout.sglang.cpu_path=torch_native"]), 2)
    validate(load_config(DEMO, ["rollout.engine=sglang", "model.dtype=bfloat16"]), 2)
    validate(load_config(DEMO, []), 2)  # the embedded engine serves fp32 anywhere
    run = subprocess.run(
        [sys.executable, "-m", "grpo_megatron", "check", str(DEMO), "rollout.engine=sglang"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(), AMX_ENV: "pretend"},
    )
    assert run.returncode == 2 and error in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]


@pytest.mark.skipif(
    not KERNEL, reason="SGLang takes its AMX path only with sgl_kernel: `make setup WHEELHOUSE=DIR`"
)
def test_an_engine_the_amx_path_cannot_serve_is_refused_before_it_starts(monkeypatch) -> None:
    """Started directly (a bench, a test, a caller that skipped check), ``start_colocated`` refuses
    before the engine starts, naming the fix, not a scheduler dying at its first forward with an
    empty reason: an fp32 model; an SGLang without weight-update sessions (before 0.5.21: the GPU
    machine's 0.5.17), in which the weights the AMX path packs cannot be updated
    (``compat.amx_packed_weights_reload``). SGLang's own Engine class, and one without sessions."""
    from grpo_megatron.rollout.sglang.launch import import_sglang, refuse_cpu_path

    sglang = import_sglang(torch.device("cpu"))[0]
    old = SimpleNamespace(
        __version__="0.5.17", Engine=type("Engine", (), {"update_weights_from_tensor": None})
    )
    monkeypatch.setenv(AMX_ENV, "pretend")
    with pytest.raises(EngineStartError, match=r"rank 3 cannot start: model.dtype=float32 .* intel_amx path"):
        refuse_cpu_path("auto", EngineLaunch("float32", device="cpu", rank=3), sglang)
    refuse_cpu_path("auto", EngineLaunch("bfloat16", device="cpu"), sglang)
    sessions = r"SGLang 0.5.17 has no weight-update sessions .*rollout.sglang.cpu_path=torch_native"
    with pytest.raises(EngineStartError, match=sessions):
        refuse_cpu_path("auto", EngineLaunch("bfloat16", device="cpu"), old)
    refuse_cpu_path("torch_native", EngineLaunch("float32", device="cpu"), old)  # no packing there


def test_the_torch_native_setting_hides_amx_from_the_engines_processes() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert engine_environment(cpu, "torch_native")[AMX_ENV] == "hide"
    assert AMX_ENV not in engine_environment(cpu, "auto") and AMX_ENV not in engine_environment(
        cuda, "torch_native"
    )


@pytest.mark.launches
@pytest.mark.skipif(
    not KERNEL, reason="SGLang takes its AMX path only with sgl_kernel: `make setup WHEELHOUSE=DIR`"
)
def test_sglangs_own_amx_query_answers_as_the_environment_says() -> None:
    """What the engine's processes decide (``cpu_has_amx_support``, imported afresh as a scheduler
    imports it) under ``hide`` and ``pretend``, on any CPU."""
    code = "from sglang.srt.utils.common import cpu_has_amx_support; print(cpu_has_amx_support())"
    seen = {}
    for choice in ("hide", "pretend"):
        run = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=180,
            env={**_env(), AMX_ENV: choice, "SGLANG_USE_CPU_ENGINE": "1"},
        )
        assert run.returncode == 0, run.stderr[-2000:]
        seen[choice] = run.stdout.strip().splitlines()[-1]
    assert seen == {"hide": "False", "pretend": "True"}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != AMX_ENV}
