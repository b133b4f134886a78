#!/usr/bin/env bash
# On-policy distillation in miniature (`make demo DISTILL=1`), on 2 CPU processes: the teacher is the
# model `make demo` trained by GRPO (runs/demo/hf; made first when missing, with the held-out
# accuracy evaluated every 10 iterations), the student the same cold start (runs/demo/sft/hf). The
# student learns from the teacher's logprob of every token it samples (distill.coef=1) and from no
# reward (distill.reward_coef=0), with the demo's GRPO settings otherwise. The report
# (tools/demo_distill_report.py) puts its held-out accuracy beside plain GRPO's (runs/demo, the same
# cold start) and names the iteration at which each first reaches 90% of the teacher's accuracy:
# runs/demo-distill/report.md and distill_vs_grpo.png.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SEED=${SEED:-1234}
TEACHER_RUN=${TEACHER_RUN:-runs/demo}
RUN=${RUN_DIR:-runs/demo-distill}
EVAL_INTERVAL=${EVAL_INTERVAL:-10}
export OMP_NUM_THREADS=1 TORCH_COMPILE_DISABLE=1 WANDB_SILENT=true

start=$(date +%s)
if [ ! -f "$TEACHER_RUN/hf/config.json" ]; then
    echo "[demo-distill] no teacher in $TEACHER_RUN/hf: running the GRPO demo first (make demo)"
    PYTHON="$PY" SEED="$SEED" RUN_DIR="$TEACHER_RUN" bash examples/demo.sh train.eval_interval="$EVAL_INTERVAL"
fi
rm -rf "$RUN"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m grpo_megatron train examples/demo.yaml \
    train.seed="$SEED" logging.run_dir="$RUN" model.hf_path="$TEACHER_RUN/sft/hf" \
    train.eval_interval="$EVAL_INTERVAL" \
    distill.teacher_path="$TEACHER_RUN/hf" distill.coef=1.0 distill.reward_coef=0.0 "$@"
"$PY" tools/demo_distill_report.py --grpo "$TEACHER_RUN" --distill "$RUN" --out "$RUN"
echo "[demo-distill] done in $(( $(date +%s) - start )) s; report in $RUN/report.md, plot in $RUN/distill_vs_grpo.png"
