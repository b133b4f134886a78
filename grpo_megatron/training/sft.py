"""``grpo-megatron sft CONFIG [section.key=value ...]``: supervised cold start before GRPO.

DeepSeek-R1 starts RL from a model fine-tuned on a few thousand worked solutions. This command
trains the policy with the next-token loss on the response tokens of prompt/response pairs
(a JSONL/Parquet file with a response field, or a procedural generator's gold solutions), checks
greedy accuracy on held-out dev prompts every ``sft.eval_interval`` steps through the same rollout
engine and reward as GRPO, stops once it reaches ``sft.stop_accuracy``, and writes a Hugging Face
checkpoint (safetensors, config.json, tokenizer files) through the weight bridge's export stream.
Point ``model.hf_path`` of the GRPO job at that directory.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo_megatron.training import phases
from grpo_megatron.training.batching import Sample, collate, make_sample, rank_microbatches
from grpo_megatron.training.forward_backward import MicroBatch, forward_backward
from grpo_megatron.training.job import Job, build_job, export_hf_checkpoint

if TYPE_CHECKING:
    from grpo_megatron.config import JobConfig

def sft_job_config(cfg: JobConfig) -> JobConfig:
    """The job config the SFT job is built with: the optimizer runs at sft.lr, constant."""
    train = dataclasses.replace(
        cfg.train, lr=cfg.sft.lr, min_lr=cfg.sft.lr, lr_decay="constant", lr_warmup_iterations=0,
        iterations=cfg.sft.max_steps,
    )
    # The console reports at each dev evaluation (metrics.jsonl still gets every step).
    logging = dataclasses.replace(cfg.logging, log_interval=cfg.sft.eval_interval)
    return dataclasses.replace(cfg, train=train, logging=logging)


def sft_step(job: Job, samples: list[Sample]) -> dict[str, float]:
    """One optimizer step of the mean response-token negative log-likelihood over ``samples``."""
    cfg, ps = job.cfg, job.ps
    rows = rank_microbatches(
        [s.length for s in samples],
        range(len(samples)),
        dp_size=ps.dp,
        dp_rank=ps.dp_rank,
        micro_batch_size=cfg.train.micro_batch_size,
        max_tokens=cfg.train.max_tokens_per_micro_batch,
    )
    total_tokens = float(sum(s.mask_s.sum() for s in samples))

    def nll(logprobs_bs: torch.Tensor, entropy_bs: torch.Tensor | None, mb: MicroBatch):
        mask_bs = mb.extras["mask_bs"]
        loss = -(logprobs_bs * mask_bs).sum() / total_tokens  # this micro-batch's share of the mean
        return loss, {"tokens": mask_bs.sum()}

    job.policy.zero_grad()
    outs = forward_backward(
        job.policy.model, [collate(samples, r, job.pad_id) for r in rows], ps, nll, vocab_size=job.policy.spec.vocab_size
    )
    loss_t = torch.tensor([sum(o["loss"] for o in outs)], dtype=torch.float64)
    if ps.dp > 1:
        torch.distributed.all_reduce(loss_t, group=ps.dp_group)
    return {"sft/loss": float(loss_t), **job.policy.step()}


def run_sft(job: Job) -> dict[str, float]:
    sft = job.cfg.sft
    pairs = job.sft_records
    sampler = job.make_sampler(len(pairs))
    job.logger.truncate_from(0)  # SFT writes no checkpoints: a rerun starts over, its log too
    job.fleet.sync_weights(job.policy.model, version=0)
    accuracy = phases.evaluate(job, 0).get("eval/accuracy", 0.0)
    job.logger.log(0, {"eval/accuracy": accuracy})
    step = 0
    while step < sft.max_steps and (sft.stop_accuracy is None or accuracy < sft.stop_accuracy):
        step += 1
        job.beat(f"sft step {step}")
        start = time.perf_counter()
        batch = [pairs[i] for i in sampler.next_indices(sft.batch_size)]
        samples = [make_sample(p.prompt_ids, p.response_ids, [0.0] * len(p.response_ids), 0.0) for p in batch]
        metrics = sft_step(job, samples)
        if step % sft.eval_interval == 0 or step == sft.max_steps:
            job.fleet.sync_weights(job.policy.model, version=step)
            accuracy = phases.evaluate(job, step)["eval/accuracy"]
            metrics["eval/accuracy"] = accuracy
        metrics["time/step"] = time.perf_counter() - start
        job.logger.log(step, metrics)
        phases.stop_if_not_finite(metrics, step, "SFT writes its checkpoint only at the end")
    return {"steps": float(step), "eval/accuracy": accuracy}


def main(cfg: JobConfig) -> int:
    from grpo_megatron.config import ConfigError, preflight_errors
    from grpo_megatron.distributed.bootstrap import destroy_distributed

    problems = preflight_errors(cfg, "sft")  # output directories: before any step, not after the last
    if problems:
        raise ConfigError(problems)
    start = time.perf_counter()
    job = build_job(sft_job_config(cfg), with_reference=False, sft=True)
    out_dir = Path(cfg.sft.output_dir or job.run_dir / "hf")
    try:
        result = run_sft(job)
        export_hf_checkpoint(job, out_dir)
    finally:
        job.close()
    if job.ps.rank == 0:
        print(
            f"[sft] {result['steps']:.0f} steps, dev accuracy {result['eval/accuracy']:.1%}, "
            f"{time.perf_counter() - start:.0f} s; Hugging Face checkpoint in {out_dir}",
            flush=True,
        )
    destroy_distributed()
    return 0
