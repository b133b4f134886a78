#!/usr/bin/env bash
# Build SGLang's CPU kernel library (import name sgl_kernel; the wheel sglang_kernel_cpu-*.whl) from
# SGLang's source, for `make setup WHEELHOUSE=DIR`. No package index serves it: PyPI's sgl-kernel /
# sglang-kernel wheels are CUDA builds. Needs network access to GitHub, gcc, libnuma-dev and the
# project's .venv (its torch: the wheel is built against it); about 7 minutes on 2 cores.
#
#   tools/build_sgl_kernel_cpu.sh [OUT_DIR] [GIT_REF]
#
# OUT_DIR defaults to wheels/ (git-ignored); GIT_REF to SGLang's main. The sources are SGLang's
# python/sglang/kernels/aot with its pyproject_cpu.toml (the layout since the kernels moved there; an
# older SGLang has them in sgl-kernel/ with the same file). The result needs x86-64 with AVX-512 and
# avx512_bf16 at run time (it is built with -march=x86-64-v4).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=$(mkdir -p "${1:-wheels}" && cd "${1:-wheels}" && pwd)
ref=${2:-main}
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || { echo "no $python: run 'make setup' first (the wheel is built against its torch)" >&2; exit 1; }
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
        "$python" -m pip install -q scikit-build-core cmake ninja
        "$python" -m pip wheel --no-build-isolation --no-deps -w "$out" .
        echo "built: $(ls "$out"/sglang_kernel_cpu-*.whl 2>/dev/null || ls "$out"/*.whl)"
        echo "install: make setup WHEELHOUSE=$out"
        exit 0
    fi
done
echo "no pyproject_cpu.toml in SGLang $ref (python/sglang/kernels/aot or sgl-kernel): pick another GIT_REF" >&2
exit 1
