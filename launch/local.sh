#!/usr/bin/env bash
# One node, several processes: torchrun's standalone rendezvous on this machine.
#   launch/local.sh sanity examples/tiny_moe.yaml parallel.tp=2        # NPROC defaults to 2
#   NPROC=8 launch/local.sh sanity my_job.yaml parallel.tp=2 parallel.ep=4
# Everything after the launcher's own variables goes to `python -m grpo_megatron`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export TORCH_COMPILE_DISABLE=${TORCH_COMPILE_DISABLE:-1}
# One thread per rank unless told otherwise: ranks share the node's cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" -m grpo_megatron "$@"
