"""Build what the lent GPU machine lacks, as one file a device call can carry.

The GPU machine (Python 3.12, torch 2.11.0 + CUDA 13, no package index; ../shared/GUIDE.md sections 8
and 10) lacks megatron-core, math-verify, the locked transformers and SGLang. This downloads the wheels
``tools/gpu_carry.txt`` lists for that Python, unpacks them into one folder, deletes what a Hopper GPU
never loads (``TRIM``), and packs the folder as ``.gpu-carry/gpu-carry.tar.xz`` with
``.gpu-carry/MANIFEST.txt`` beside it (every distribution as ``name==version``, the size and sha256).
``bench/gpu_env.sh`` unpacks it on the GPU machine and puts it first on PYTHONPATH.

    python tools/build_gpu_carry.py                 # download (cached in .gpu-carry-build/), trim, pack
    python tools/build_gpu_carry.py --check         # no download: the list against the lock, and a built
                                                     # carry's manifest against the list and the size bound
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIST = REPO / "tools" / "gpu_carry.txt"
LOCK = REPO / "requirements.lock"
BUILD = REPO / ".gpu-carry-build"
OUT = REPO / ".gpu-carry"
TARBALL_NAME = "gpu-carry.tar.xz"
MANIFEST_NAME = "MANIFEST.txt"
MAX_BYTES = 60 * 2**20
"""A device call carries 64 MiB with the working tree (about 2.5 MiB) and a JIT cache (about 5 MiB)."""
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
TRIM = (
    # sglang-kernel: on Hopper only sm90/common_ops loads; FA3, FlashMLA, InfLLM and the sm100 build are
    # never imported with attention_backend=triton (GUIDE section 10). 1.2 GB of the 1.5 GB unpacked.
    "sgl_kernel/flash_ops.abi3.so",
    "sgl_kernel/flashmla_ops.abi3.so",
    "sgl_kernel/infllm_ops.*.so",
    "sgl_kernel/sm100",
    # xgrammar's C++ headers and static library: grammar_backend=none.
    "xgrammar/lib",
    "xgrammar/include",
    # Top-level names that would shadow the repository's own tools/ on PYTHONPATH (shipped by sglang
    # and flashinfer's build helpers).
    "tools",
    "build_backend.py",
    "build_utils.py",
)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """``name==version`` lines (comments and blank lines skipped), keyed by normalised name."""
    pins: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise SystemExit(f"{path}:{lineno}: expected 'name==version', got {raw!r}")
        pins[normalise(name.strip())] = version.strip()
    return pins


def resolve(listed: dict[str, str], lock: dict[str, str]) -> dict[str, str]:
    """The list with every ``==lock`` replaced by the lock's version; an error names a missing one."""
    out = {}
    for name, version in listed.items():
        if version == "lock":
            if name not in lock:
                raise SystemExit(
                    f"{LIST}: {name}==lock, but {LOCK} pins no {name}: pin a version in the list"
                )
            version = lock[name].split("+", 1)[0]
        out[name] = version
    return out


def download(pins: dict[str, str], dest: Path) -> list[Path]:
    """Every pinned wheel for the GPU machine's Python, into ``dest`` (pip skips those present)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, *(f"{n}=={v}" for n, v in sorted(pins.items()))], check=True)
    wheels = {}
    for wheel in dest.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        if pins.get(normalise(name)) == version:
            wheels[normalise(name)] = wheel
    missing = sorted(set(pins) - set(wheels))
    if missing:
        raise SystemExit(f"no wheel downloaded for {missing} in {dest}")
    return [wheels[n] for n in sorted(wheels)]


def unpack(wheels: list[Path], site: Path) -> None:
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
    for pattern in TRIM:
        for path in site.glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for cache in list(site.rglob("__pycache__")):
        shutil.rmtree(cache, ignore_errors=True)


def distributions(site: Path) -> dict[str, str]:
    """``{normalised name: version}`` of every ``*.dist-info`` in ``site`` (the engine checks its
    kernel's version through them, so they are kept)."""
    out = {}
    for info in site.glob("*.dist-info"):
        meta = (info / "METADATA").read_text(errors="replace")
        name = re.search(r"^Name: *(.+)$", meta, re.M)
        version = re.search(r"^Version: *(.+)$", meta, re.M)
        if name and version:
            out[normalise(name.group(1).strip())] = version.group(1).strip()
    return out


def pack(site: Path, tarball: Path) -> None:
    """``site`` as a tar compressed by xz -9 (the xz program when present: it uses every core)."""
    tarball.parent.mkdir(parents=True, exist_ok=True)
    tmp = tarball.with_suffix(".partial")
    if shutil.which("xz"):
        with tmp.open("wb") as out:
            tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-9", "-T0"], stdin=tar.stdout, stdout=out, check=True)
            if tar.wait() != 0:
                raise SystemExit("tar failed")
    else:
        with tarfile.open(tmp, "w:xz", preset=9) as tf:
            tf.add(site, arcname=".")
    tmp.replace(tarball)


def manifest_text(dists: dict[str, str], tarball: Path) -> str:
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    lines = [f"# {TARBALL_NAME}: {tarball.stat().st_size} bytes, sha256 {digest}"]
    return "\n".join([*lines, *(f"{n}=={v}" for n, v in sorted(dists.items()))]) + "\n"


def check_manifest(manifest: str, pins: dict[str, str], max_bytes: int = MAX_BYTES) -> list[str]:
    """What is wrong with a built carry, from its manifest: a listed pin absent or at another version,
    a distribution nobody listed, or a tarball over ``max_bytes``. Empty when it is right."""
    problems = []
    size = re.search(r"^# \S+: (\d+) bytes", manifest, re.M)
    if size is None:
        problems.append("the manifest's first line gives no size")
    elif int(size.group(1)) > max_bytes:
        problems.append(
            f"the tarball is {int(size.group(1)) / 2**20:.1f} MiB, over {max_bytes / 2**20:.0f} MiB"
        )
    built = read_pins_text(manifest)
    for name, version in sorted(pins.items()):
        if built.get(name) != version:
            problems.append(f"{name}=={version} listed, the carry has {built.get(name, 'none')}")
    extra = sorted(set(built) - set(pins))
    problems += [f"{name}=={built[name]} in the carry but not in {LIST.name}" for name in extra]
    return problems


def read_pins_text(text: str) -> dict[str, str]:
    pins = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalise(name)] = version
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="check the list and a built carry; download nothing"
    )
    args = parser.parse_args(argv)
    pins = resolve(read_pins(LIST), read_pins(LOCK))
    manifest = OUT / MANIFEST_NAME
    if args.check:
        if not manifest.is_file():
            build = f"python {LIST.parent.name}/build_gpu_carry.py"
            print(f"gpu carry: {len(pins)} pins resolve against the lock; none built yet ({build})")
            return 0
        problems = check_manifest(manifest.read_text(), pins)
        for problem in problems:
            print(f"gpu carry: {problem}", file=sys.stderr)
        print(f"gpu carry: {manifest}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    wheels = download(pins, BUILD / "wheels")
    unpack(wheels, BUILD / "site")
    tarball = OUT / TARBALL_NAME
    pack(BUILD / "site", tarball)
    text = manifest_text(distributions(BUILD / "site"), tarball)
    manifest.write_text(text)
    print(text, end="")
    problems = check_manifest(text, pins)
    for problem in problems:
        print(f"gpu carry: {problem}", file=sys.stderr)
    print(f"gpu carry: {tarball} {tarball.stat().st_size / 2**20:.1f} MiB ({len(wheels)} wheels)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
