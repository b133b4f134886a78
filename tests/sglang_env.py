"""Whether SGLang's real engine can run in this environment, for the tests that start one.

It needs SGLang's engine dependencies (the lock has them) and its CPU kernel library ``sgl_kernel``,
which no package index serves: ``make setup WHEELHOUSE=DIR`` installs it from a folder of wheels
(``.ci/run`` passes ../shared/wheels), ``tools/build_sgl_kernel_cpu.sh`` builds one from SGLang's
source. Without it these tests skip with that one line, unless ``GRPO_REQUIRE_SGLANG=1`` (set by
``.ci/run`` when it installed the kernels), where a missing piece fails instead.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

ENGINE_TIMEOUT_S = 420
"""One worker process: an engine start (15-30 s idle on 2 cores, several times that under load)
and its scenarios."""

HOW_TO_GET_IT = (
    "SGLang's CPU kernels (sgl_kernel) are not installed: run `make setup WHEELHOUSE=../shared/wheels` "
    "(a folder with sglang_kernel_cpu-*.whl), or build the wheel with tools/build_sgl_kernel_cpu.sh"
)


def missing_piece() -> str | None:
    """Why the real engine cannot start here, or None."""
    for module in ("sglang", "uvloop", "torchvision", "xgrammar"):
        if importlib.util.find_spec(module) is None:
            return f"SGLang's engine dependency {module} is not installed: run `make setup` (the lock has it)"
    if importlib.util.find_spec("sgl_kernel") is None:
        return HOW_TO_GET_IT
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    if "avx512_bf16" not in flags:
        return "SGLang's CPU kernels need a CPU with AVX-512 and avx512_bf16; this one has neither"
    return None


def require_sglang_engine() -> None:
    """Skip (or, with GRPO_REQUIRE_SGLANG=1, fail) unless the real engine can start."""
    why = missing_piece()
    if why is None:
        return
    if os.environ.get("GRPO_REQUIRE_SGLANG") == "1":
        pytest.fail(f"GRPO_REQUIRE_SGLANG=1 but {why}")
    pytest.skip(why)
