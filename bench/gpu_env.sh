# Sourced by bench/gpu_check.sh (and by hand: `source bench/gpu_env.sh`) on the GPU machine, from the
# repository root: puts what the image lacks first on PYTHONPATH and sets SGLang's GPU settings.
#
# What the image lacks comes as .gpu-carry/gpu-carry.tar.xz (built here by tools/build_gpu_carry.py:
# megatron-core, math-verify, transformers, SGLang 0.5.17 and its kernels, unpacked as one folder),
# or as wheels in .gpu-wheels/ (the older way: no SGLang). Nothing is installed into the image's Python,
# and a Python that already has megatron-core (a developer's .venv) is left as it is.
# Spawned SGLang processes inherit PYTHONPATH and the variables below.
PYTHON="${PYTHON:-python3}"
GPU_SITE="${GPU_SITE:-/tmp/grpo-gpu-site}"
if "$PYTHON" -c "import megatron.core" 2>/dev/null; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif [ -f .gpu-carry/gpu-carry.tar.xz ]; then
  if [ ! -f "$GPU_SITE/.unpacked" ]; then
    mkdir -p "$GPU_SITE"
    "$PYTHON" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='fully_trusted')" \
      .gpu-carry/gpu-carry.tar.xz "$GPU_SITE"
    touch "$GPU_SITE/.unpacked"
  fi
  export PYTHONPATH="$GPU_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif compgen -G ".gpu-wheels/*.whl" > /dev/null; then
  mkdir -p "$GPU_SITE"
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$GPU_SITE" .gpu-wheels/*.whl
  export PYTHONPATH="$GPU_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# SGLang on the GPU machine (../shared/GUIDE.md section 10): flashinfer imports but its kernels are
# not carried; libnvrtc comes from torch's CUDA 13 libraries; JIT caches stay in the working tree so
# that a later call can carry them back (.gpu-cache/ is git-ignored).
export SGLANG_IS_FLASHINFER_AVAILABLE=false
CU_LIB="$("$PYTHON" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null || true)"
[ -n "$CU_LIB" ] && export LD_LIBRARY_PATH="$CU_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# A cache brought back from an earlier call (tar -czf gpu-cache.tgz .gpu-cache) is unpacked first.
[ -f .gpu-carry/gpu-cache.tgz ] && [ ! -d .gpu-cache/triton ] && tar -xzf .gpu-carry/gpu-cache.tgz
mkdir -p .gpu-cache/triton .gpu-cache/tvm-ffi .gpu-cache/flashinfer
export TRITON_CACHE_DIR="$PWD/.gpu-cache/triton" TVM_FFI_CACHE_DIR="$PWD/.gpu-cache/tvm-ffi"
export FLASHINFER_WORKSPACE_BASE="$PWD/.gpu-cache/flashinfer"
