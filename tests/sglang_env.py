"""Whether SGLang's real engine can run in this environment, for the tests that start one.

It needs SGLang's engine dependencies (the lock has them) and its CPU kernel library ``sgl_kernel``,
which no package index serves: ``make setup WHEELHOUSE=DIR`` installs the wheel of DIR built for this
CPU (``tools/sgl_kernel_wheel.py`` chooses by the CPU's flags; ``.ci/run`` passes ../shared/wheels),
``tools/build_sgl_kernel_cpu.sh`` builds one from SGLang's source. Whether the engine can run is read
from the installed kernel's build (its version's local tag) against this CPU's flags, never from a
fixed list: the real-engine tests run wherever an installed kernel fits.

Where no kernel for this CPU is installed they skip with one line naming the CPU, the wheels present
and how to build one. ``GRPO_REQUIRE_SGLANG=1`` (set by ``make test`` when it installed a wheel for
this CPU) turns a missing piece into a failure, except that no wheel fitting this CPU exists: a CPU
that cannot run any kernel present is not a failure of the change under test. A fitting kernel
installed and the engine not starting always fails.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_TIMEOUT_S = 420
"""One worker process: an engine start (15-30 s idle on 2 cores, several times that under load)
and its scenarios."""

REAL_ENGINE_TESTS = (
    "tests/test_sglang_real.py",
    "tests/test_sglang_train.py",
    "tests/test_gpu_check.py::test_the_sglang_engine_stage",
)
"""The tests that start SGLang's real engine (the closing note of tests/conftest.py counts them)."""


def cpu_path_of(nodeid: str, machine: str) -> str:
    """The SGLang CPU path a real-engine test runs on a machine whose engines take ``machine``
    (rollout/sglang/cpu_path.py): test_sglang_train.py's fp32 jobs take torch_native everywhere; the
    AMX layout test takes intel_amx everywhere, where the CPU has no AMX only as far as a CPU without
    it can (``GRPO_SGLANG_AMX=pretend``: weight layouts, no forward)."""
    if nodeid.startswith("tests/test_sglang_train.py"):
        return "torch_native"
    if "intel_amx_path" in nodeid and machine != "intel_amx":
        return "intel_amx layouts (pretend)"
    return machine


def _load_wheel_tool() -> ModuleType:
    """tools/sgl_kernel_wheel.py, by its path (tools/ is no package; the Makefile runs it as a script)."""
    name = "sgl_kernel_wheel"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "sgl_kernel_wheel.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


kernel_wheel = _load_wheel_tool()


def wheelhouse() -> str:
    """The folder of kernel wheels ``make test`` set up from (its WHEELHOUSE), else ../shared/wheels."""
    return os.environ.get("GRPO_KERNEL_WHEELHOUSE") or str(ROOT.parent / "shared" / "wheels")


@dataclasses.dataclass(frozen=True)
class Missing:
    """Why the real engine cannot start here: ``why`` is the one line a skip shows."""

    why: str
    cpu_cannot: bool
    """No kernel wheel present fits this CPU: a skip even under GRPO_REQUIRE_SGLANG=1."""


def missing_piece(cpuinfo: str | None = None, folder: str | None = None) -> Missing | None:
    """Why the real engine cannot start here (this CPU, the installed kernel, ``folder``'s wheels), or None."""
    for module in ("sglang", "uvloop", "torchvision", "xgrammar"):
        if importlib.util.find_spec(module) is None:
            return Missing(
                f"SGLang's engine dependency {module} is not installed: run `make setup` (the lock has it)",
                False,
            )
    cpuinfo = kernel_wheel.read_cpuinfo() if cpuinfo is None else cpuinfo
    folder = wheelhouse() if folder is None else folder
    flags = kernel_wheel.cpu_flags(cpuinfo)
    found = kernel_wheel.installed()
    problem = kernel_wheel.installed_problem(flags, *found) if found else "none is installed"
    if problem is None:
        return None
    fitting = kernel_wheel.choose(flags, kernel_wheel.wheels_in(folder))
    cpu = f"{kernel_wheel.cpu_model(cpuinfo)}, {kernel_wheel.isa_level(flags)}"
    if found:
        state = f"the installed {found[0]} {found[1]} cannot run on this CPU ({cpu}): {problem}"
    else:
        state = f"none is installed for this CPU ({cpu})"
    if fitting is not None:
        how = f"`make setup WHEELHOUSE={folder}` installs {fitting.path.name} for it"
    else:
        how = f"{kernel_wheel.wheels_line(folder, flags)}; {kernel_wheel.how_to_build(flags)}"
    return Missing(f"SGLang's CPU kernels (sgl_kernel): {state}; {how}", fitting is None)


def require_sglang_engine() -> None:
    """Skip (or, with GRPO_REQUIRE_SGLANG=1 and a kernel for this CPU at hand, fail) unless the real
    engine can start."""
    missing = missing_piece()
    if missing is None:
        from tests.helpers import tier

        tier.require_mark("SGLang's real engine")
        return
    if os.environ.get("GRPO_REQUIRE_SGLANG") == "1" and not missing.cpu_cannot:
        pytest.fail(f"GRPO_REQUIRE_SGLANG=1 but {missing.why}")
    pytest.skip(missing.why)


def closing_note(stats: dict[str, list], seconds: float, cpuinfo: str | None = None) -> str | None:
    """The suite's last word on the real engine (tests/conftest.py prints it): CPU, kernel, how many
    real-engine tests ran and how they ended, and the suite's wall time; None if none was collected.
    ``stats`` is pytest's terminal reporter's (outcome -> reports)."""
    worst = ("skipped", "passed", "failed", "error")  # a test's setup, call and teardown: the worst counts
    outcomes: dict[str, str] = {}
    skip_reason = ""
    for outcome in worst:
        for report in stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            if not nodeid.startswith(REAL_ENGINE_TESTS):
                continue
            outcomes[nodeid] = outcome
            if (
                outcome == "skipped"
                and not skip_reason
                and isinstance(getattr(report, "longrepr", None), tuple)
            ):
                skip_reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    if not outcomes:
        return None
    cpuinfo = kernel_wheel.read_cpuinfo() if cpuinfo is None else cpuinfo
    flags = kernel_wheel.cpu_flags(cpuinfo)
    found = kernel_wheel.installed()
    build = kernel_wheel.build_of(found[1]) if found else None
    kernel = (
        f"{found[0]} {found[1]} ({build.name if build else 'unknown'} build)"
        if found
        else "no kernel installed"
    )
    counts = {
        k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "error", "skipped")
    }
    ran = counts["passed"] + counts["failed"] + counts["error"]
    machine = kernel_wheel.sglang_cpu_path(flags) if found else "none"
    paths: dict[str, int] = {}
    for nodeid, outcome in outcomes.items():
        if outcome != "skipped":
            path = cpu_path_of(nodeid, machine)
            paths[path] = paths.get(path, 0) + 1
    on = ", ".join(f"{n} on {p}" for p, n in sorted(paths.items(), key=lambda item: -item[1])) or "none run"
    note = (
        f"real SGLang engine on {kernel_wheel.cpu_model(cpuinfo)} ({kernel_wheel.isa_level(flags)}), {kernel}: "
        f"{ran} of {len(outcomes)} tests run ({counts['passed']} passed, {counts['failed'] + counts['error']} failed), "
        f"{counts['skipped']} skipped; SGLang CPU path {machine} ({on}); suite {seconds:.0f} s"
    )
    return note + (f". Skipped: {skip_reason}" if skip_reason else "")
