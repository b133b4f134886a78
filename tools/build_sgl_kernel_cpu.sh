#!/usr/bin/env bash
# Build SGLang's CPU kernel library (import name sgl_kernel; the wheel sglang_kernel_cpu-*.whl) from
# SGLang's source, for `make setup WHEELHOUSE=DIR`. No package index serves it: PyPI's sgl-kernel /
# sglang-kernel wheels are CUDA builds. Needs network access to GitHub, gcc, libnuma-dev and the
# project's .venv (its torch: the wheel is built against it).
#
#   tools/build_sgl_kernel_cpu.sh [OUT_DIR] [GIT_REF]            # the AVX-512 build (about 7 minutes on 2 cores)
#   ISA=avx2 tools/build_sgl_kernel_cpu.sh [OUT_DIR] [GIT_REF]   # the AVX2 build (about 25 minutes)
#
# OUT_DIR defaults to wheels/ (git-ignored); GIT_REF to SGLang's main. The sources are SGLang's
# python/sglang/kernels/aot with its pyproject_cpu.toml (the layout since the kernels moved there; an
# older SGLang has them in sgl-kernel/ with the same file). Which build runs where
# (tools/sgl_kernel_wheel.py chooses by the CPU's flags):
# - ISA=avx512 (default): SGLang's own flags (-march=x86-64-v4 -mavx512bf16 ...); needs AVX-512 with
#   avx512_bf16 at run time; version as SGLang has it (0.4.6.post1).
# - ISA=avx2: x86-64-v3 (AVX2, FMA, F16C), for CPUs without avx512_bf16; never for a CPU with AMX
#   (SGLang then takes AMX paths this build cannot run). Applies tools/sglang-kernel-cpu-avx2.patch
#   (an opt-in SGLANG_CPU_X86_ISA=avx2 branch in csrc/cpu/CMakeLists.txt; upstream has no such
#   switch) and tags the version +avx2 (0.4.6.post1+avx2), the tag by which the build is known.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$(pwd)
isa=${ISA:-avx512}
case "$isa" in avx512|avx2) ;; *) echo "ISA=$isa: use avx512 (default) or avx2" >&2; exit 2;; esac
out=$(mkdir -p "${1:-wheels}" && cd "${1:-wheels}" && pwd)
ref=${2:-main}
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || { echo "no $python: run 'make setup' first (the wheel is built against its torch)" >&2; exit 1; }
python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
if ! ldconfig -p | grep -q libnuma; then
    echo "libnuma is missing: apt-get install libnuma-dev" >&2; exit 1
fi
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git clone --depth 1 --branch "$ref" https://github.com/sgl-project/sglang.git "$src/sglang"
for dir in "$src/sglang/python/sglang/kernels/aot" "$src/sglang/sgl-kernel"; do
    if [ -f "$dir/pyproject_cpu.toml" ]; then
        cd "$dir"
        cp pyproject_cpu.toml pyproject.toml
        if [ "$isa" = avx2 ]; then
            # from the clone's root: inside a subdirectory git apply skips the patch's paths silently
            git -C "$src/sglang" apply --directory="${dir#"$src/sglang/"}" "$repo/tools/sglang-kernel-cpu-avx2.patch" \
                && grep -q 'SGLANG_CPU_X86_ISA}" STREQUAL "avx2"' csrc/cpu/CMakeLists.txt || {
                echo "tools/sglang-kernel-cpu-avx2.patch does not apply to csrc/cpu/CMakeLists.txt of SGLang $ref:" \
                     "add its SGLANG_CPU_X86_ISA=avx2 branch by hand, or pick another GIT_REF" >&2; exit 1; }
            sed -i 's/^version = "\([^"+]*\)"/version = "\1+avx2"/' pyproject.toml
            grep -q '^version = ".*+avx2"' pyproject.toml || { echo "no version line to tag +avx2 in pyproject.toml" >&2; exit 1; }
            export SGLANG_CPU_X86_ISA=avx2
        fi
        "$python" -m pip install -q scikit-build-core cmake ninja
        "$python" -m pip wheel --no-build-isolation --no-deps -w "$out" .
        echo "built: $(ls "$out"/sglang_kernel_cpu-*.whl 2>/dev/null || ls "$out"/*.whl)"
        echo "install: make setup WHEELHOUSE=$out"
        exit 0
    fi
done
echo "no pyproject_cpu.toml in SGLang $ref (python/sglang/kernels/aot or sgl-kernel): pick another GIT_REF" >&2
exit 1
