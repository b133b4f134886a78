"""``grpo-megatron train CONFIG [section.key=value ...]``: DeepSeek-R1-Zero-style GRPO, one loop.

Every rank runs this loop (SPMD). One iteration, with the module that owns each phase:

  rollout       sample prompts; the engines generate G responses each       data/, rollout/fleet.py
  reward        rank 0 scores them in sandboxed workers, broadcasts         rewards/pool.py
                (DAPO dynamic sampling repeats rollout+reward for groups with no reward variance)
  onload        (train.offload_trainer) engines release memory, trainer state returns  training/offload.py
  advantages    group-relative, on every rank; mini-/micro-batch plan       algorithm/advantages.py, training/batching.py
  ref_logprob   frozen reference model, forward only (skipped when KL is off)  training/phases.py
  old_logprob   the policy before the update (only with several updates)
  train         one Adam step per mini-batch of the clipped surrogate       algorithm/policy_loss.py
  sync          export stream -> engines, then a mismatch probe             bridge/export.py, rollout/
  eval          held-out greedy pass@1 (and mean@k) every train.eval_interval  training/phases.py
  bookkeeping   metrics.jsonl, samples, checkpoint                          logging_utils/, checkpoint/

``throughput/tokens_per_s`` counts the prompt and response tokens of the batch per second of the whole
iteration.

Departures from the GRPO paper, all configurable: the fixes named in algorithm/config.py (Dr.GRPO,
DAPO, TIS) are off by default; with one update per iteration pi_old is the detached current policy
(ratio 1), as in DeepSeekMath's on-policy setting.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_megatron.algorithm.kl import kl_beta
from grpo_megatron.distributed.collectives import on_rank0
from grpo_megatron.fileio import write_text_atomic
from grpo_megatron.training import phases, route_replay
from grpo_megatron.training.batching import Sample
from grpo_megatron.training.job import Job, PhaseTimer, build_job, export_hf_checkpoint

if TYPE_CHECKING:
    from grpo_megatron.config import JobConfig
    from grpo_megatron.data import PromptSampler

Probe = tuple[list[list[int]], list[int]]  # the mismatch probe's sequences and prompt lengths


@dataclass
class Iteration:
    """What one iteration produced: its rollouts, the trainer samples and the metrics of its phases."""

    groups: list[phases.Group]
    samples: list[Sample]
    plan: phases.UpdatePlan
    metrics: dict[str, float]


def run_iteration(job: Job, sampler: PromptSampler, probe: Probe, it: int, timer: PhaseTimer) -> Iteration:
    """One GRPO iteration, rollout to weight sync, each phase timed as ``time/<phase>``."""
    cfg = job.cfg
    groups, reward_metrics = phases.collect_groups(job, sampler, timer, it)  # rollout, reward
    with timer("onload"):
        onload_metrics = phases.trainer_to_device(job)
    with timer("advantages"):
        samples, adv_metrics = phases.build_samples(job, groups)
        plan = phases.plan_update(job, samples)
    beta = kl_beta(cfg.algorithm.kl, it - 1, cfg.train.iterations)
    # MoE routing of each pass (algorithm.routing_replay) and its metrics: training/route_replay.py.
    with timer("ref_logprob"), job.reference_on_device():
        if job.reference is not None:
            routing, routes = route_replay.routing_pass(job, job.reference, "ref", samples)
            phases.logprob_pass(job, job.reference, samples, plan, "ref", routing, routes)
            route_replay.finish_pass(job, routing, samples, plan.all_rows, measure=False)
    routing_metrics: dict[str, float] = {}
    with timer("old_logprob"):
        if cfg.train.updates_per_iteration > 1 and cfg.train.old_logprobs == "trainer":
            routing, routes = route_replay.routing_pass(job, job.policy.model, "old", samples)
            phases.logprob_pass(job, job.policy.model, samples, plan, "old", routing, routes)
            routing_metrics = route_replay.finish_pass(job, routing, samples, plan.all_rows, measure=True)
    with timer("train"):
        routing, routes = route_replay.routing_pass(job, job.policy.model, "train", samples)
        train_metrics = phases.update_policy(job, samples, plan, beta, routing, routes)
        measured = route_replay.finish_pass(job, routing, samples, plan.all_rows, measure=not routing_metrics)
        routing_metrics = routing_metrics or measured
    with timer("sync"):
        sync_metrics = phases.sync_weights(job, it, probe)
    metrics = {
        **reward_metrics,
        **train_metrics,
        **routing_metrics,
        "kl_beta": beta,
        "response_len/mean": sum(len(c.token_ids) for g in groups for c in g.completions) / len(samples),
        **adv_metrics,
        **sync_metrics,
        **onload_metrics,
    }
    metrics.setdefault("kl", 0.0)
    return Iteration(groups, samples, plan, metrics)


def train(job: Job) -> dict[str, float]:
    cfg = job.cfg
    resumed = job.checkpoints.resume(job.policy)
    job.beat("resume")
    state = resumed or {"iteration": 0, "sampler": None, "eval": {}}
    sampler = job.make_sampler()
    if state["sampler"] is not None:
        sampler.load_state_dict(state["sampler"])
    start = state["iteration"]
    # Lines after the resumed checkpoint belong to iterations about to be redone; a fresh start
    # (no checkpoint yet: a crash before the first save, or save_interval=0) redoes everything,
    # its iteration-0 evaluation included.
    job.logger.truncate_from(start + 1 if resumed is not None else 0)
    probe = phases.probe_sequences(job)
    phases.sync_weights(job, start, probe)  # the engines start from the trainer's weights
    last_eval = dict(state["eval"])
    if resumed is None:  # a fresh run: held-out accuracy before any update, logged as iteration 0
        last_eval = phases.evaluate(job, start)
        job.logger.log(start, last_eval)
    first_eval = dict(last_eval)
    job.beat("first evaluation")
    # (iteration, accuracy) of the best held-out evaluation: the final report gives it beside the last
    best = state.get("best") or (start, last_eval.get("eval/accuracy", float("nan")))
    last_it = start

    for it in range(start + 1, cfg.train.iterations + 1):
        timer = PhaseTimer(beat=job.beat)
        eval_metrics: dict[str, float] = {}
        with timer("iteration"):
            result = run_iteration(job, sampler, probe, it, timer)
            with timer("eval"):
                if it == cfg.train.iterations or (cfg.train.eval_interval and it % cfg.train.eval_interval == 0):
                    eval_metrics = last_eval = phases.evaluate(job, it)
                    last_it = it
                    if not eval_metrics.get("eval/accuracy", float("nan")) <= best[1]:  # NaN best: replace
                        best = (it, eval_metrics.get("eval/accuracy", float("nan")))
        n_tokens = sum(s.length + 1 for s in result.samples)
        metrics = {
            **result.metrics,
            **eval_metrics,
            **timer.seconds,
            "throughput/tokens_per_s": n_tokens / timer.seconds["time/iteration"],
        }
        for name in ("ref_logprob", "old_logprob"):
            metrics.setdefault(f"time/{name}", 0.0)
        job.logger.log(it, metrics)
        phases.stop_if_not_finite(metrics, it, f"the checkpoints in {job.checkpoints.dir} are untouched")
        if cfg.logging.samples_interval and it % cfg.logging.samples_interval == 0:
            job.logger.log_samples(it, sample_rows(result.groups, cfg.train.rollout_samples_logged))
        if cfg.checkpoint.save_interval and (it % cfg.checkpoint.save_interval == 0 or it == cfg.train.iterations):
            phases.save_checkpoint(job, it, {"iteration": it, "sampler": sampler.state_dict(), "eval": last_eval, "best": best})
    return {
        "before": first_eval.get("eval/accuracy", float("nan")),
        "after": last_eval.get("eval/accuracy", float("nan")),
        "after_iteration": last_it,
        "best": best[1],
        "best_iteration": best[0],
    }


def sample_rows(groups: list[phases.Group], count: int) -> list[dict[str, object]]:
    """The first response of the first ``count`` prompts, for the console table and samples.jsonl."""
    return [
        {"prompt": g.record.prompt, "response": g.texts[0], "answer": g.record.answer, "reward": g.rewards[0]}
        for g in groups[:count]
    ]


def main(cfg: JobConfig) -> int:
    from grpo_megatron.distributed.bootstrap import destroy_distributed

    # The CLI (the only caller) checked data paths and output directories before any process group.
    start = time.perf_counter()
    job = build_job(cfg, with_reference=cfg.algorithm.kl.enabled)
    try:
        result = train(job)
        if cfg.checkpoint.export_hf_dir:
            phases.trainer_to_device(job)  # the export reads the parameters (offload_trainer)
            export_hf_checkpoint(job, job.run_dir / cfg.checkpoint.export_hf_dir)
    finally:
        job.close()
    seconds = time.perf_counter() - start
    if job.ps.rank == 0:
        print(
            f"[train] held-out accuracy {result['before']:.1%} -> {result['after']:.1%} at the last evaluation "
            f"(iteration {result['after_iteration']}); best {result['best']:.1%} at iteration "
            f"{result['best_iteration']}; {seconds:.0f} s; run directory {job.run_dir}",
            flush=True,
        )
    text = json.dumps({**result, "seconds": seconds}, indent=1) + "\n"
    on_rank0(lambda: write_text_atomic(job.run_dir / "summary.json", text), "writing the training summary")
    destroy_distributed()
    return 0
