#!/usr/bin/env bash
# GPU acceptance run of grpo-megatron on one GPU, on a machine with no package index: the
# stages of bench/gpu_check.py (tiny fp32 smoke, train CLI killed and resumed, the 0.43B bf16
# table, the layout/checkpoint/offload/rollout/GPU tests, the SGLang loop when it can run),
# in at most 8 minutes; the table is written to <out>/gpu_check.md and printed.
#
# 1. On a machine WITH a package index, from the repository root, download what the GPU
#    machine's image lacks, as wheels for its Python (3.12 here; change --python-version to
#    match `python3 --version` there). The folder .gpu-wheels/ is git-ignored; carry it along:
#
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#        -d .gpu-wheels megatron-core==0.16.1 math-verify latex2sympy2_extended \
#        antlr4-python3-runtime==4.13.2 transformers==5.24.0
#
#    (transformers at the version the lock file pins.) TransformerEngine, apex and SGLang are
#    not brought: each is built against one torch; the run adjusts megatron-core for their
#    absence (grpo_megatron/distributed/megatron_compat.py) and skips the SGLang stage.
# 2. On the GPU machine, from the repository root:
#
#      bash bench/gpu_check.sh                  # the GPU run (default --device cuda)
#      bash bench/gpu_check.sh --device cpu     # the same stages on CPU, tiny sizes
#      PYTHON=/path/to/python bash bench/gpu_check.sh --stages smoke,table
#
#    When .gpu-wheels/ holds wheels, they are installed (no index, no dependencies) into a
#    temporary folder put first on PYTHONPATH; nothing is installed into the image's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if compgen -G ".gpu-wheels/*.whl" > /dev/null; then
  SITE="$(mktemp -d -t grpo-gpu-site-XXXXXX)"
  trap 'rm -rf "$SITE"' EXIT
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" .gpu-wheels/*.whl
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c "import megatron.core, transformers, math_verify" 2>/dev/null || {
  echo "gpu_check: megatron-core, transformers or math-verify missing for $PYTHON: bring .gpu-wheels/ (see the top of $0)" >&2
  exit 2
}
"$PYTHON" bench/gpu_check.py "$@"
