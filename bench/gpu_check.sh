#!/usr/bin/env bash
# GPU acceptance run of grpo-megatron on one GPU, on a machine with no package index: the stages of
# bench/gpu_check.py in order of value (SGLang's engine, FP8 rollout beside bf16, the train CLI with colocated
# SGLang killed and resumed and with routing replay, the adapter's loop, the embedded smoke and resume, the 0.43B bf16
# table, TransformerEngine where it imports, the GPU tests), bounded by 8 minutes (--budget-s 480: the
# stage running then is stopped, later ones skipped; a cold first call reaches the first two or three,
# docs/gpu.md). The table is rewritten after every stage to <out>/gpu_check.md and printed at the end;
# <out> is --out, else $OUT/gpu_check-<time> where the caller has an $OUT (the device tool brings back
# only that folder), else runs/gpu_check/<time>. With $OUT set, the JIT caches the run compiled are
# packed to $OUT/gpu-cache.tgz as well: put it in .gpu-carry/ for the next call.
#
# 1. On a machine WITH a package index, from the repository root, build what the GPU machine's image
#    lacks (megatron-core, math-verify, the locked transformers, SGLang 0.5.17 and its kernels) as one
#    file under the 60 MiB a device call can carry with the working tree:
#
#      python tools/build_gpu_carry.py          # -> .gpu-carry/gpu-carry.tar.xz + MANIFEST.txt (git-ignored)
#
#    and carry .gpu-carry/ along. A JIT cache brought back from an earlier run (tar -czf
#    .gpu-carry/gpu-cache.tgz .gpu-cache) saves the first SGLang start's compilation (about 90 s).
# 2. On the GPU machine, from the repository root:
#
#      bash bench/gpu_check.sh                          # the GPU run (default --device cuda)
#      bash bench/gpu_check.sh --device cpu             # the same stages on CPU, tiny sizes
#      bash bench/gpu_check.sh --stages sglang_engine,smoke
#
#    bench/gpu_env.sh unpacks the carry into a temporary folder put first on PYTHONPATH and sets
#    SGLang's GPU environment; nothing is installed into the image's Python. PYTHON=... picks the
#    interpreter (default: .venv/bin/python where it exists, else python3).
#
# Not shown by this one-GPU run, nor by the CPU suite (issue 36 item 8): a Slurm preemption of a job
# whose SGLang engine spans two nodes (rollout.sglang.tp = 2 x GPUs per node). Its further node's part
# starts through launch.py:start_colocated like the leader's (tests/test_sglang_adapter.py checks the
# start; a two-node engine was seen to run on CPU with gloo, its node-1 schedulers ignoring SIGTERM),
# but the job itself needs two hosts (the layout check keys nodes by host name). On a two-node
# allocation: sbatch launch/slurm/train.sbatch with rollout.sglang.tp spanning both nodes, `scancel --signal=TERM
# --full` mid-run after a checkpoint interval: every rank must print "[preempt] SIGTERM: checkpoint ...
# written" and the job exit 75.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh
"$PYTHON" -c "import megatron.core, transformers, math_verify" 2>/dev/null || {
  echo "gpu_check: megatron-core, transformers or math-verify missing for $PYTHON: bring .gpu-carry/ (python tools/build_gpu_carry.py)" >&2
  exit 2
}
rc=0
"$PYTHON" bench/gpu_check.py "$@" || rc=$?
if [ -n "${OUT:-}" ] && [ -d .gpu-cache ]; then
  tar -czf "$OUT/gpu-cache.tgz" .gpu-cache 2>/dev/null || echo "gpu_check: could not pack .gpu-cache into $OUT" >&2
fi
exit "$rc"
