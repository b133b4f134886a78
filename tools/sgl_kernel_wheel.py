"""Which build of SGLang's CPU kernel library fits this CPU: the wheel ``make setup`` installs, and
whether the installed one can run here (tests/sglang_env.py asks before a real-engine test).

``sgl_kernel`` (wheels ``sglang_kernel_cpu-<version>-...whl``, on no package index) exists in two
builds, told apart by the version's local tag; ``BUILDS`` says what each needs:

| build | version | compiled with | runs where | never where |
|---|---|---|---|---|
| AVX-512 | ``0.4.6.post1`` | ``-march=x86-64-v4 -mavx512bf16 -mavx512vnni`` (SGLang's defaults) | avx512_bf16 | - |
| AVX2 | ``0.4.6.post1+avx2`` | ``-march=x86-64-v3`` (``ISA=avx2 BUILD_SCRIPT``) | x86-64-v3 | AMX, avx512_bf16 |

(``BUILD_SCRIPT``: ``tools/build_sgl_kernel_cpu.sh``.)

SGLang's CPU engine takes its intel_amx path where the CPU has AMX (its kernels for linear layers,
norms and MoE; bf16/fp16 models), its torch_native path elsewhere (no kernel op called):
``sglang_cpu_path`` here, ``grpo_megatron/rollout/sglang/cpu_path.py`` for an engine. So a Sapphire
Rapids (or later) Xeon runs intel_amx; a Xeon with avx512_bf16 but no AMX, a Xeon without
avx512_bf16 and an AMD EPYC with AVX2 only run torch_native.

The AVX-512 build dies with SIGILL on ``import sgl_kernel`` without AVX-512. The AVX2 build has no
scalar path for the ops SGLang calls only where it sees AMX (``weight_packed_linear`` aborts), so it
never goes beside AMX; nor beside avx512_bf16, where the AVX-512 build is the one that fits.

Standard library only: the Makefile runs it with the system Python before ``.venv`` exists.

    python3 tools/sgl_kernel_wheel.py choose DIR    # the wheel of DIR for this CPU (nothing: none fits)
    python3 tools/sgl_kernel_wheel.py machine DIR   # one line: CPU model, ISA level, the wheel chosen
    python3 tools/sgl_kernel_wheel.py unfit         # sglang-kernel-cpu, if the installed build cannot run here
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

X86_64_V3 = frozenset(
    {
        "cx16",
        "lahf_lm",
        "popcnt",
        "sse4_1",
        "sse4_2",
        "ssse3",
        "avx",
        "avx2",
        "bmi1",
        "bmi2",
        "f16c",
        "fma",
        "movbe",
        "abm",
    }
)
"""The x86-64-v3 level (v2's flags and v3's; LZCNT is ``abm`` in /proc/cpuinfo)."""
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
AMX = frozenset({"amx_tile", "amx_bf16", "amx_int8"})
WHEEL_PATTERN = re.compile(
    r"^sglang_kernel_cpu-(?P<version>[^-]+)-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl$"
)
DISTRIBUTION = "sglang-kernel-cpu"
BUILD_SCRIPT = "tools/build_sgl_kernel_cpu.sh"


@dataclasses.dataclass(frozen=True)
class Build:
    """One build of the library: the CPU flags it needs and those beside which it must not run."""

    tag: str
    """The version's local tag ('' for SGLang's default flags)."""
    name: str
    needs: frozenset[str]
    refuses: frozenset[str]
    build_command: str

    def problem(self, flags: frozenset[str]) -> str | None:
        """Why this build cannot run on a CPU with ``flags``, or None."""
        missing = sorted(self.needs - flags)
        if missing:
            return f"the {self.name} build needs {', '.join(missing)}"
        beside = sorted(self.refuses & flags)
        if beside:
            return f"the {self.name} build must not run beside {', '.join(beside)}"
        return None


BUILDS: tuple[Build, ...] = (
    Build("", "AVX-512", X86_64_V4 | {"avx512_bf16", "avx512_vnni"}, frozenset(), BUILD_SCRIPT),
    Build("avx2", "AVX2", X86_64_V3, AMX | {"avx512_bf16"}, f"ISA=avx2 {BUILD_SCRIPT}"),
)
"""Preferred first where several fit (none overlap today)."""


def build_of(version: str) -> Build | None:
    """The build a version names by its local tag (``0.4.6.post1+avx2``: AVX2), None if unknown."""
    tag = version.partition("+")[2]
    return next((b for b in BUILDS if b.tag == tag), None)


def read_cpuinfo(path: str = "/proc/cpuinfo") -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's ``flags`` line of /proc/cpuinfo."""
    match = re.search(r"^flags\s*:(.*)$", cpuinfo, re.MULTILINE)
    return frozenset(match.group(1).split()) if match else frozenset()


def cpu_model(cpuinfo: str) -> str:
    match = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    return match.group(1).strip() if match else "unknown CPU"


def isa_level(flags: frozenset[str]) -> str:
    """The x86-64 level and what of it SGLang's CPU kernels care about."""
    if X86_64_V4 <= flags:
        extras = [
            "avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16",
            "AMX" if flags & AMX else "no AMX",
        ]
        return f"x86-64-v4 ({', '.join(extras)})"
    if X86_64_V3 <= flags:
        return "x86-64-v3 (AVX2, no AVX-512)"
    return "below x86-64-v3" if flags else "not x86-64 (no flags in /proc/cpuinfo)"


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


@dataclasses.dataclass(frozen=True)
class Wheel:
    path: Path
    version: str
    python: str
    platform: str

    @property
    def build(self) -> Build | None:
        return build_of(self.version)

    def problem(self, flags: frozenset[str], python: str) -> str | None:
        """Why this wheel cannot be installed and run here, or None."""
        if self.python != python:
            return f"built for {self.python}, not {python}"
        if not self.platform.endswith("x86_64"):
            return f"built for {self.platform}"
        if self.build is None:
            return f"an unknown build '+{self.version.partition('+')[2]}' (known: {', '.join(b.name for b in BUILDS)})"
        return self.build.problem(flags)


def wheels_in(folder: str | Path | None) -> list[Wheel]:
    """The kernel wheels of ``folder`` (none if it is not a folder)."""
    if not folder or not Path(folder).is_dir():
        return []
    found = []
    for path in sorted(Path(folder).iterdir()):
        match = WHEEL_PATTERN.match(path.name)
        if match:
            found.append(Wheel(path, match["version"], match["python"], match["platform"]))
    return found


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version.partition("+")[0]))


def choose(flags: frozenset[str], wheels: Iterable[Wheel], python: str | None = None) -> Wheel | None:
    """The wheel for a CPU with ``flags``: of those that can run there, the preferred build's newest."""
    fitting = [w for w in wheels if w.problem(flags, python or python_tag()) is None]
    if not fitting:
        return None
    rank = {b.tag: i for i, b in enumerate(BUILDS)}
    return min(
        fitting, key=lambda w: (rank[w.version.partition("+")[2]], [-n for n in _version_key(w.version)])
    )


def how_to_build(flags: frozenset[str]) -> str:
    """The command that builds a kernel for this CPU (or why none can)."""
    build = next((b for b in BUILDS if b.problem(flags) is None), None)
    if build is None:
        return "no build of SGLang's CPU kernels runs on this CPU (the AVX2 one needs x86-64-v3)"
    return (
        f"build one with `{build.build_command} wheels` (needs GitHub), then `make setup WHEELHOUSE=wheels`"
    )


def wheels_line(folder: str | Path | None, flags: frozenset[str]) -> str:
    """The wheels present in ``folder``, each with why it does not fit (if it does not)."""
    wheels = wheels_in(folder)
    if not wheels:
        return f"no sglang_kernel_cpu-*.whl in {folder}" if folder else "no WHEELHOUSE"
    shown = []
    for w in wheels:
        why = w.problem(flags, python_tag())
        shown.append(w.path.name + (f" ({why})" if why else ""))
    return f"wheels in {folder}: {'; '.join(shown)}"


def sglang_cpu_path(flags: frozenset[str]) -> str:
    """The path SGLang's CPU engine takes on a CPU with ``flags`` and a kernel build that fits it."""
    return "intel_amx" if "amx_tile" in flags else "torch_native"


def machine_line(cpuinfo: str, folder: str | Path | None) -> str:
    """CPU model, ISA level and the kernel wheel chosen from ``folder`` (with the SGLang CPU path it
    gives): the first line of make test."""
    flags = cpu_flags(cpuinfo)
    chosen = choose(flags, wheels_in(folder))
    head = f"machine: {cpu_model(cpuinfo)} | ISA {isa_level(flags)} | SGLang CPU kernel: "
    if chosen is not None:
        build = chosen.build.name if chosen.build else "?"
        return (
            head
            + f"{chosen.path.name} ({build} build, from {folder}) | SGLang CPU path: {sglang_cpu_path(flags)}"
        )
    return (
        head
        + f"none fits ({wheels_line(folder, flags)}; {how_to_build(flags)}): the real-engine tests will skip"
    )


def installed() -> tuple[str, str] | None:
    """(distribution, version) of the installed ``sgl_kernel``, read from its metadata (importing a
    build that does not fit kills the process with SIGILL), or None."""
    dists = importlib.metadata.packages_distributions().get("sgl_kernel", [])
    if not dists:
        return None
    return dists[0], importlib.metadata.version(dists[0])


def installed_problem(flags: frozenset[str], dist: str, version: str) -> str | None:
    """Why the installed distribution ``dist`` at ``version`` cannot run on a CPU with ``flags``."""
    if dist.lower().replace("_", "-") != DISTRIBUTION:
        return f"{dist} {version} is not SGLang's CPU kernel build ({DISTRIBUTION})"
    build = build_of(version)
    if build is None:
        return f"{dist} {version} is an unknown build (known: {', '.join(b.name for b in BUILDS)})"
    return build.problem(flags)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("choose").add_argument("folder", nargs="?")
    sub.add_parser("machine").add_argument("folder", nargs="?")
    sub.add_parser("unfit")
    args = parser.parse_args(argv)
    cpuinfo = read_cpuinfo()
    if args.command == "choose":
        chosen = choose(cpu_flags(cpuinfo), wheels_in(args.folder))
        if chosen is not None:
            print(chosen.path)
    elif args.command == "machine":
        print(machine_line(cpuinfo, args.folder))
    else:
        found = installed()  # only our CPU builds: a CUDA sgl-kernel on a GPU machine stays
        if found is not None and found[0] == DISTRIBUTION and installed_problem(cpu_flags(cpuinfo), *found):
            print(found[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
