"""tools/sgl_kernel_wheel.py: the SGLang CPU kernel wheel for a CPU's flags (the AVX-512 build where
avx512_bf16 is, the AVX2 build where only AVX2 is, never the AVX2 build beside AMX, else none), the
installed build against the CPU, the skip line of tests/sglang_env.py and the Makefile's choice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import sglang_env
from tests.sglang_env import kernel_wheel as kw

REPO = Path(__file__).resolve().parents[1]
PY = f"cp{sys.version_info.major}{sys.version_info.minor}"
AVX512 = f"sglang_kernel_cpu-0.4.6.post1-{PY}-{PY}-linux_x86_64.whl"
AVX2 = f"sglang_kernel_cpu-0.4.6.post1+avx2-{PY}-{PY}-linux_x86_64.whl"

V2 = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep cmov clflush mmx fxsr sse sse2 pni ssse3 cx16 sse4_1 sse4_2 popcnt"
    " lahf_lm"
)
EPYC_AVX2 = V2 + " fma movbe xsave avx f16c abm bmi1 avx2 bmi2 sha_ni"  # AMD EPYC (Rome/Milan): no AVX-512
XEON_NO_BF16 = (  # this workplace's Intel Xeon (Cascade Lake class), copied from its /proc/cpuinfo
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht "
    "syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni "
    "pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c "
    "rdrand hypervisor lahf_lm abm 3dnowprefetch cpuid_fault ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase "
    "tsc_adjust bmi1 avx2 smep bmi2 erms invpcid mpx avx512f avx512dq rdseed adx smap clflushopt clwb avx512cd "
    "avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves arat umip pku ospke avx512_vnni md_clear flush_l1d "
    "arch_capabilities"
)
ZEN4 = XEON_NO_BF16 + " avx512_bf16 avx512_vbmi"  # AVX-512 with bf16, no AMX
SAPPHIRE_RAPIDS = ZEN4 + " amx_bf16 amx_tile amx_int8"
AVX2_WITH_AMX = EPYC_AVX2 + " amx_tile amx_bf16"  # no such CPU; the AVX2 build must refuse it anyway


def cpuinfo(flags: str, model: str = "Test CPU") -> str:
    return (
        f"processor\t: 0\nmodel name\t: {model}\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    )


def folder(path: Path, *names: str) -> Path:
    """A folder holding (empty) files of these names."""
    path.mkdir(parents=True, exist_ok=True)
    for name in names:
        (path / name).write_bytes(b"")
    return path


def chosen(flags: str, wheels: Path) -> str | None:
    wheel = kw.choose(kw.cpu_flags(cpuinfo(flags)), kw.wheels_in(wheels))
    return wheel.path.name if wheel else None


@pytest.mark.parametrize(
    ("flags", "both", "only_avx512", "only_avx2"),
    [
        (SAPPHIRE_RAPIDS, AVX512, AVX512, None),  # AMX: never the AVX2 build
        (ZEN4, AVX512, AVX512, None),  # avx512_bf16: the AVX-512 build
        (XEON_NO_BF16, AVX2, None, AVX2),  # AVX-512 without bf16: the AVX2 build
        (EPYC_AVX2, AVX2, None, AVX2),
        (AVX2_WITH_AMX, None, None, None),
        (V2, None, None, None),
        ("", None, None, None),  # not x86 (no flags line)
    ],
)
def test_each_cpu_gets_the_wheel_its_flags_can_run(tmp_path, flags, both, only_avx512, only_avx2) -> None:
    assert chosen(flags, folder(tmp_path / "both", AVX512, AVX2)) == both
    assert chosen(flags, folder(tmp_path / "a", AVX512)) == only_avx512
    assert chosen(flags, folder(tmp_path / "b", AVX2)) == only_avx2
    assert chosen(flags, tmp_path / "missing") is None


def test_other_pythons_platforms_unknown_builds_and_files_are_not_chosen(tmp_path) -> None:
    folder(
        tmp_path,
        "sglang_kernel_cpu-0.4.6.post1+avx2-cp310-cp310-linux_x86_64.whl",
        f"sglang_kernel_cpu-0.4.6.post1+avx2-{PY}-{PY}-linux_aarch64.whl",
        f"sglang_kernel_cpu-0.4.6.post1+avx10-{PY}-{PY}-linux_x86_64.whl",
        f"sgl_kernel-0.4.6-{PY}-{PY}-linux_x86_64.whl",
        "README.md",
    )
    assert chosen(EPYC_AVX2, tmp_path) is None
    line = kw.wheels_line(tmp_path, kw.cpu_flags(cpuinfo(EPYC_AVX2)))
    assert f"built for cp310, not {PY}" in line and "built for linux_aarch64" in line
    assert "unknown build '+avx10'" in line and "sgl_kernel-" not in line and "README" not in line


def test_the_newest_version_of_the_fitting_build_wins(tmp_path) -> None:
    newer = f"sglang_kernel_cpu-0.4.10+avx2-{PY}-{PY}-linux_x86_64.whl"
    folder(tmp_path, AVX2, newer, AVX512)
    assert chosen(EPYC_AVX2, tmp_path) == newer
    assert chosen(ZEN4, tmp_path) == AVX512


def test_each_cpu_kind_names_the_sglang_cpu_path_it_runs() -> None:
    """SGLang's intel_amx path on AMX Xeons only; torch_native on every other CPU a kernel fits."""
    path = {
        name: kw.sglang_cpu_path(kw.cpu_flags(cpuinfo(f)))
        for name, f in (
            ("sapphire", SAPPHIRE_RAPIDS),
            ("zen4", ZEN4),
            ("xeon", XEON_NO_BF16),
            ("epyc", EPYC_AVX2),
        )
    }
    assert path == {
        "sapphire": "intel_amx",
        "zen4": "torch_native",
        "xeon": "torch_native",
        "epyc": "torch_native",
    }


def test_isa_levels_name_what_the_kernels_care_about() -> None:
    level = {
        f: kw.isa_level(kw.cpu_flags(cpuinfo(f)))
        for f in (SAPPHIRE_RAPIDS, ZEN4, XEON_NO_BF16, EPYC_AVX2, V2, "")
    }
    assert level[SAPPHIRE_RAPIDS] == "x86-64-v4 (avx512_bf16, AMX)"
    assert level[ZEN4] == "x86-64-v4 (avx512_bf16, no AMX)"
    assert level[XEON_NO_BF16] == "x86-64-v4 (no avx512_bf16, no AMX)"
    assert level[EPYC_AVX2] == "x86-64-v3 (AVX2, no AVX-512)"
    assert level[V2] == "below x86-64-v3"
    assert level[""].startswith("not x86-64")


@pytest.mark.parametrize(
    ("flags", "version", "fits"),
    [
        (SAPPHIRE_RAPIDS, "0.4.6.post1", True),
        (SAPPHIRE_RAPIDS, "0.4.6.post1+avx2", False),
        (ZEN4, "0.4.6.post1+avx2", False),
        (XEON_NO_BF16, "0.4.6.post1", False),
        (XEON_NO_BF16, "0.4.6.post1+avx2", True),
        (EPYC_AVX2, "0.4.6.post1", False),
        (EPYC_AVX2, "0.4.6.post1+avx2", True),
        (EPYC_AVX2, "0.4.6.post1+custom", False),
        (V2, "0.4.6.post1+avx2", False),
    ],
)
def test_the_installed_build_is_read_from_its_version(flags, version, fits) -> None:
    problem = kw.installed_problem(kw.cpu_flags(cpuinfo(flags)), "sglang-kernel-cpu", version)
    assert (problem is None) is fits, problem


def test_a_cuda_sgl_kernel_is_not_a_cpu_build_and_is_never_removed() -> None:
    assert "not SGLang's CPU kernel build" in kw.installed_problem(
        kw.cpu_flags(cpuinfo(ZEN4)), "sgl-kernel", "0.3.21"
    )


def test_the_skip_line_names_the_cpu_the_wheels_and_how_to_build_one(tmp_path, monkeypatch) -> None:
    """Where no wheel fits, a skip even under GRPO_REQUIRE_SGLANG=1; where one does, the line says
    how to install it (and GRPO_REQUIRE_SGLANG=1 fails)."""
    monkeypatch.setattr(kw, "installed", lambda: ("sglang-kernel-cpu", "0.4.6.post1+avx2"))
    only_avx512 = folder(tmp_path / "a", AVX512)
    missing = sglang_env.missing_piece(cpuinfo(EPYC_AVX2, "AMD EPYC 7B13"), str(only_avx512))
    assert missing is None  # the installed AVX2 build fits

    monkeypatch.setattr(kw, "installed", lambda: None)
    missing = sglang_env.missing_piece(cpuinfo(EPYC_AVX2, "AMD EPYC 7B13"), str(only_avx512))
    assert missing is not None and missing.cpu_cannot
    assert "\n" not in missing.why
    assert "none is installed for this CPU (AMD EPYC 7B13, x86-64-v3 (AVX2, no AVX-512))" in missing.why
    assert f"{AVX512} (the AVX-512 build needs avx512_bf16, avx512_vnni, avx512bw, avx512cd" in missing.why
    assert "ISA=avx2 tools/build_sgl_kernel_cpu.sh wheels" in missing.why

    both = folder(tmp_path / "b", AVX512, AVX2)
    monkeypatch.setattr(kw, "installed", lambda: ("sglang-kernel-cpu", "0.4.6.post1+avx2"))
    missing = sglang_env.missing_piece(cpuinfo(SAPPHIRE_RAPIDS, "Intel Xeon Platinum 8480+"), str(both))
    assert missing is not None and not missing.cpu_cannot
    assert (
        "the installed sglang-kernel-cpu 0.4.6.post1+avx2 cannot run on this CPU (Intel Xeon Platinum 8480+, "
        "x86-64-v4 (avx512_bf16, AMX)): the AVX2 build must not run beside amx_bf16, amx_int8, amx_tile, avx512_bf16"
    ) in missing.why
    assert f"`make setup WHEELHOUSE={both}` installs {AVX512}" in missing.why

    missing = sglang_env.missing_piece(cpuinfo(V2, "Old CPU"), str(both))
    assert (
        missing is not None
        and missing.cpu_cannot
        and "no build of SGLang's CPU kernels runs on this CPU" in missing.why
    )


def test_require_sglang_fails_only_where_a_kernel_for_this_cpu_is_at_hand(monkeypatch) -> None:
    monkeypatch.setenv("GRPO_REQUIRE_SGLANG", "1")
    monkeypatch.setattr(
        sglang_env, "missing_piece", lambda: sglang_env.Missing("no wheel for this CPU", True)
    )
    with pytest.raises(pytest.skip.Exception, match="no wheel for this CPU"):
        sglang_env.require_sglang_engine()
    monkeypatch.setattr(sglang_env, "missing_piece", lambda: sglang_env.Missing("not installed", False))
    with pytest.raises(pytest.fail.Exception, match="GRPO_REQUIRE_SGLANG=1 but not installed"):
        sglang_env.require_sglang_engine()


def test_the_closing_note_counts_the_real_engine_tests(monkeypatch) -> None:
    monkeypatch.setattr(kw, "installed", lambda: ("sglang-kernel-cpu", "0.4.6.post1+avx2"))
    report = lambda nodeid, longrepr=None: SimpleNamespace(nodeid=nodeid, longrepr=longrepr)  # noqa: E731
    stats = {
        "passed": [report("tests/test_sglang_real.py::test_a"), report("tests/test_sglang_train.py::test_b")],
        "failed": [report("tests/test_sglang_real.py::test_c")],
        "error": [report("tests/test_sglang_real.py::test_c")],  # its teardown too: counted once
        "skipped": [report("tests/test_sglang_real.py::test_d", ("f", 1, "Skipped: no kernel for this CPU"))],
        "": [report("tests/test_sglang_real.py::test_a")],  # pytest's reports of passed setup/teardown
    }
    note = sglang_env.closing_note(stats, 1234.4, cpuinfo(EPYC_AVX2, "AMD EPYC 7B13"))
    assert note == (
        "real SGLang engine on AMD EPYC 7B13 (x86-64-v3 (AVX2, no AVX-512)), sglang-kernel-cpu 0.4.6.post1+avx2 "
        "(AVX2 build): 3 of 4 tests run (2 passed, 1 failed), 1 skipped; SGLang CPU path torch_native "
        "(3 on torch_native); suite 1234 s. Skipped: no kernel for this CPU"
    )
    # On an AMX Xeon: the bf16 engine tests on intel_amx, test_sglang_train.py's fp32 jobs on torch_native
    monkeypatch.setattr(kw, "installed", lambda: ("sglang-kernel-cpu", "0.4.6.post1"))
    amx_test = "tests/test_sglang_real.py::test_weight_updates_on_sglangs_intel_amx_path_leave_the_layouts"
    stats["passed"].append(report(amx_test))
    note = sglang_env.closing_note(stats, 1.0, cpuinfo(SAPPHIRE_RAPIDS, "Intel Xeon Platinum 8480+"))
    assert (
        "4 of 5 tests run (3 passed, 1 failed), 1 skipped; SGLang CPU path intel_amx (3 on intel_amx, "
        in note
    )
    assert "1 on torch_native)" in note
    # Elsewhere the AMX layout test runs as far as a CPU without AMX can
    note = sglang_env.closing_note(stats, 1.0, cpuinfo(EPYC_AVX2, "AMD EPYC 7B13"))
    assert "(3 on torch_native, 1 on intel_amx layouts (pretend))" in note
    assert sglang_env.closing_note({"passed": [report("tests/test_kl.py::test_x")]}, 1.0) is None


def run_make(*args: str) -> str:
    proc = subprocess.run(
        ["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_makefile_installs_the_wheel_chosen_for_this_cpu(tmp_path) -> None:
    """``make setup`` (dry run) installs what the helper chooses for this machine's CPU from both
    wheels, and nothing (removing a build that cannot run here) from a folder where none fits."""
    both = folder(tmp_path / "both", AVX512, AVX2)
    venv = f"VENV={tmp_path / 'venv'}"
    expected = kw.choose(kw.cpu_flags(kw.read_cpuinfo()), kw.wheels_in(both))
    plan = run_make("-n", "setup", f"WHEELHOUSE={both}", venv)
    installs = [line for line in plan.splitlines() if "pip install --no-deps --force-reinstall" in line]
    assert installs == (
        [f"{tmp_path}/venv/bin/python -m pip install --no-deps --force-reinstall {expected.path}"]
        if expected
        else []
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    plan = run_make("-n", "setup", f"WHEELHOUSE={empty}", venv)
    assert "--force-reinstall" not in plan and "sgl_kernel_wheel.py unfit" in plan
    line = run_make("machine", f"WHEELHOUSE={both}")
    assert line.startswith(f"machine: {kw.cpu_model(kw.read_cpuinfo())} | ISA ") and line.count("\n") == 1
    assert (expected.path.name in line) if expected else ("none fits" in line)
    if expected:
        assert line.rstrip().endswith(
            f"| SGLang CPU path: {kw.sglang_cpu_path(kw.cpu_flags(kw.read_cpuinfo()))}"
        )
