#!/usr/bin/env bash
# R1-Zero in miniature on 2 CPU processes: cold-start SFT, then GRPO; prints held-out accuracy
# before and after GRPO. Called by `make demo` (SEED=N picks another seed); everything lands in
# runs/demo/ (runs/demo/sft/ for the cold start, runs/demo/hf/ for the trained model). TASK=tool: the multi-turn calculator demo
# (examples/demo_tool.yaml), in runs/demo_tool/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SEED=${SEED:-1234}
CONFIG=examples/demo${TASK:+_$TASK}.yaml
[ -f "$CONFIG" ] || { echo "[demo] no $CONFIG: TASK is empty (arithmetic) or tool" >&2; exit 2; }
RUN=${RUN_DIR:-runs/demo${TASK:+_$TASK}}
export OMP_NUM_THREADS=1 TORCH_COMPILE_DISABLE=1 WANDB_SILENT=true
torchrun() { "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m grpo_megatron "$@"; }

rm -rf "$RUN"
start=$(date +%s)
torchrun sft "$CONFIG" train.seed="$SEED" logging.run_dir="$RUN/sft" sft.output_dir="$RUN/sft/hf"
# checkpoint.export_hf_dir: the GRPO result as a Hugging Face model in $RUN/hf (make demo DISTILL=1's teacher)
torchrun train "$CONFIG" train.seed="$SEED" logging.run_dir="$RUN" model.hf_path="$RUN/sft/hf" \
    checkpoint.export_hf_dir=hf "$@"
echo "[demo] done in $(( $(date +%s) - start )) s; metrics in $RUN/metrics.jsonl, plot in $RUN/plot.png"
