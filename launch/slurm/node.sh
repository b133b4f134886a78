#!/usr/bin/env bash
# One node of a multi-node job: torchrun with a c10d rendezvous on the first node.
# Started once per node by launch/slurm/train.sbatch (srun, one task per node); usable by hand too:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node001 launch/slurm/node.sh CONFIG [section.key=value ...]
#
# Environment (all overridable):
#   COMMAND          grpo-megatron subcommand run under torchrun (default: train; sanity works today)
#   NNODES           number of nodes (default: $SLURM_JOB_NUM_NODES, else 1)
#   NODE_RANK        this node's index, for the log line (default: $SLURM_NODEID, else 0); c10d
#                    assigns the ranks itself
#   GPUS_PER_NODE    processes per node (default: $SLURM_GPUS_ON_NODE, else 8)
#   MASTER_ADDR      rendezvous host (default: first host of $SLURM_JOB_NODELIST)
#   MASTER_PORT      rendezvous port (default 29500)
#   RDZV_ID          rendezvous id shared by all nodes (default: $SLURM_JOB_ID, else "grpo")
#   RDZV_TIMEOUT     seconds a node waits for the others to join (default 900)
#   MAX_RESTARTS     torchrun restarts of the whole worker group after a failure (default 0)
#   PYTHON           interpreter (default: .venv/bin/python if present, else python3)
#   GRPO_EXIT_FILE   where rank 0 of `train` leaves 75 when it stopped on a signal with a checkpoint
#                    (default: a temporary file); this script then exits 75 (torchrun exits 1)
#
# Preemption (COMMAND=train): the ranks handle SIGTERM and SIGUSR1/SIGUSR2 themselves -- stop at the next
# safe point (a rollout is cut short and its batch dropped), save, exit 75 (grpo_megatron/distributed/
# preemption.py). torchrun would die of SIGUSR1 and answer SIGTERM by killing the ranks, so it starts with
# these signals ignored and told not to handle SIGTERM: torchrun (torch >= 2.8) overwrites
# TORCHELASTIC_SIGNALS_TO_HANDLE from its own --signals-to-handle (default SIGTERM,SIGINT,SIGHUP,SIGQUIT),
# whose environment form is PET_SIGNALS_TO_HANDLE, and its handler would replace the ignored disposition;
# older torchruns read TORCHELASTIC_SIGNALS_TO_HANDLE. This script forwards each signal it gets to the
# ranks (the same signal reaching a rank also straight from Slurm within a second counts once).
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ $# -lt 1 ]; then
    echo "usage: $0 CONFIG [section.key=value ...]" >&2
    exit 2
fi

NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
if [ -z "${MASTER_ADDR:-}" ]; then
    if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    else
        MASTER_ADDR=127.0.0.1
    fi
fi
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-grpo}}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-900}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export TORCH_COMPILE_DISABLE=${TORCH_COMPILE_DISABLE:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "[node $NODE_RANK/$NNODES on $(hostname)] ${COMMAND:-train} $* | $GPUS_PER_NODE procs, rendezvous $MASTER_ADDR:$MASTER_PORT id $RDZV_ID"

# Open files of torchrun's agent: node 0's serves the c10d store to every rank (two connections each:
# its process group's and its progress watchdog's) and every node's agent, about 2,200 connections at
# 1024 ranks (grpo_megatron/distributed/open_files.py:store_open_files); the usual soft limit is 1024.
# The soft limit goes up to the hard one on every node (the ranks inherit it and raise their own), and
# node 0 stops here, naming the fix, when even the hard limit is below what its agent needs.
hard_files=$(ulimit -Hn)
if [ "$hard_files" = unlimited ]; then
    ulimit -Sn 1048576 2>/dev/null || true
else
    ulimit -Sn "$hard_files"
fi
if [ "$NODE_RANK" = 0 ]; then
    store_files=$("$PYTHON" -m grpo_megatron.distributed.open_files store "$((NNODES * GPUS_PER_NODE))" "$NNODES")
    if [ "$(ulimit -Sn)" != unlimited ] && [ "$(ulimit -Sn)" -lt "$store_files" ]; then
        echo "[node 0] torchrun's agent here serves the c10d store to $((NNODES * GPUS_PER_NODE)) ranks and $NNODES" \
             "agents: it needs about $store_files open files, but the hard limit is $hard_files: raise nofile in" \
             "/etc/security/limits.conf (and Slurm's PropagateResourceLimits) on the first node" >&2
        exit 1
    fi
fi
TORCHRUN=("$PYTHON" -m torch.distributed.run
    --nnodes "$NNODES"
    --nproc-per-node "$GPUS_PER_NODE"
    --rdzv-backend c10d
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
    --rdzv-id "$RDZV_ID"
    --rdzv-conf "join_timeout=$RDZV_TIMEOUT"
    --max-restarts "${MAX_RESTARTS:-0}"
    -m grpo_megatron "${COMMAND:-train}" "$@")
if [ "${COMMAND:-train}" != train ]; then
    # exec: torchrun's exit code (non-zero when any local rank failed) is this task's exit code.
    exec "${TORCHRUN[@]}"
fi

export GRPO_EXIT_FILE=${GRPO_EXIT_FILE:-$(mktemp)}
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGINT,SIGHUP,SIGQUIT}  # torchrun's --signals-to-handle
export TORCHELASTIC_SIGNALS_TO_HANDLE=${TORCHELASTIC_SIGNALS_TO_HANDLE:-$PET_SIGNALS_TO_HANDLE}  # older torch
(trap '' TERM USR1 USR2; exec "${TORCHRUN[@]}") &
torchrun_pid=$!
forward() { pkill "-$1" -P "$torchrun_pid" || true; }  # torchrun's children: this node's ranks
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap 'forward USR2' USR2
while kill -0 "$torchrun_pid" 2>/dev/null; do
    wait "$torchrun_pid" || true  # returns early (> 128) each time a trapped signal arrives
done
rc=0
wait "$torchrun_pid" || rc=$?  # its exit status, kept by the shell
if [ "$rc" -ne 0 ] && [ "$(cat "$GRPO_EXIT_FILE" 2>/dev/null)" = 75 ]; then
    echo "[node $NODE_RANK] stopped on a signal with a checkpoint written: exit 75 (rerun to resume)"
    rc=75
fi
exit "$rc"
