"""Run logging: metrics.jsonl, wandb, TensorBoard, the rich progress bar, sample tables, the final plot.

The logger lives in `grpo_megatron.logging_utils.metrics` (imported by the trainer, not here, so that
loading a config does not import rich).
"""
