"""Which of its two CPU paths SGLang's engine takes on this machine, and what each can serve.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) decides once per process, when it is imported
(``srt/utils/common.py``: ``cpu_has_amx_support()`` = ``torch.cpu._is_amx_tile_supported()`` and the
kernel library's ``convert_weight_packed``):

- ``intel_amx``: Xeons with AMX (``amx_tile``; the AVX-512 kernel build, which needs ``avx512_bf16``).
  Linear layers, norms and MoE run SGLang's CPU kernels (``sgl_kernel``), weights repacked after
  loading (``layers/amx_utils.py``). Serves bf16 and fp16 (an fp32 model dies at its first forward:
  ``"rmsnorm_kernel" not implemented for 'Float'``) and FP8.
- ``torch_native``: every other x86-64 CPU (AMD EPYC with AVX2 only, Xeons without AMX): plain torch,
  no kernel op called. Serves fp32, bf16 and fp16.

Attention runs ``torch_native`` on both (``launch.CPU_SERVER_ARGS``): the kernel wheel's
``extend_attention_cpu`` (19 arguments, ../shared/wheels) predates SGLang 0.5.23's intel_amx attention
backend, which passes 22.

``rollout.sglang.cpu_path=torch_native`` takes the torch-native path on an AMX machine too (an fp32
model there, or a comparison of the two paths): the engine's processes start with
``GRPO_SGLANG_AMX=hide`` and ``rollout/sglang/compat.py``'s ``sglang_amx_choice`` makes SGLang's AMX
query answer False. ``GRPO_SGLANG_AMX=pretend`` (tests only) makes it answer True on a CPU without AMX:
the engine then loads, packs, updates and checks its weights as on an AMX machine, but cannot run a
forward (the AMX kernels have no path for other CPUs).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

from grpo_megatron.rollout.sglang.compat import AMX_CHOICES, AMX_ENV

CpuPath = Literal["intel_amx", "torch_native"]
AMX_DTYPES = ("bfloat16", "float16")
"""What SGLang's intel_amx path serves (its CPU RMSNorm kernel has no fp32)."""


def amx_visible() -> bool:
    """Whether SGLang in a process started now sees AMX: ``GRPO_SGLANG_AMX``'s answer, else the CPU's."""
    choice = os.environ.get(AMX_ENV, "")
    if choice in AMX_CHOICES:
        return AMX_CHOICES[choice]
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def sglang_cpu_path(setting: str = "auto") -> CpuPath:
    """The path SGLang's CPU engine takes here under ``rollout.sglang.cpu_path=setting``: intel_amx
    where it sees AMX and the kernel library is installed (only the AVX-512 build may be, beside AMX:
    tools/sgl_kernel_wheel.py), else torch_native."""
    if setting == "torch_native":
        return "torch_native"
    return (
        "intel_amx"
        if amx_visible() and importlib.util.find_spec("sgl_kernel") is not None
        else "torch_native"
    )


def engine_amx_environment(setting: str) -> dict[str, str | None]:
    """What an engine's processes add to their environment for ``rollout.sglang.cpu_path=setting``."""
    return {AMX_ENV: "hide"} if setting == "torch_native" else {}


def cpu_path_errors(path: CpuPath, dtype: str, dtype_field: str = "model.dtype") -> list[str]:
    """Why SGLang's CPU engine cannot serve a ``dtype`` model on ``path`` (none: it can)."""
    if path != "intel_amx" or dtype in AMX_DTYPES:
        return []
    return [
        f"{dtype_field}={dtype} with rollout.engine=sglang on this CPU: it has AMX, where SGLang's CPU engine "
        f"takes its intel_amx path, which serves {' and '.join(AMX_DTYPES)} models only (its RMSNorm kernel "
        f"has no {dtype}: the engine would die at its first forward); set {dtype_field}=bfloat16, or "
        "rollout.sglang.cpu_path=torch_native for SGLang's torch-native path"
    ]
