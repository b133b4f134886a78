"""``grpo-megatron train CONFIG [section.key=value ...]``: DeepSeek-R1-Zero-style GRPO, one loop.

Every rank runs this loop (SPMD). One iteration, with the module that owns each phase:

  rollout       sample prompts; the engines generate G responses each      phases/rollout.py (Rollout)
  reward        rank 0 scores them in sandboxed workers, broadcasts        phases/reward.py (Scorer -> Scored)
                (DAPO dynamic sampling: the loop asks DynamicSampling whether it needs another round
                of rollout+reward, for groups with no reward variance)     algorithm/batch_shaping.py
  onload        (train.offload_trainer) engines release memory, trainer state returns  training/offload.py
  advantages    group-relative, on every rank; mini-/micro-batch plan;    phases/advantages.py (Batch, UpdatePlan)
                each replica then receives the responses it trains
  ref_logprob   frozen reference model, forward only (skipped when KL is off)  phases/logprob.py
  teacher_logprob  the distillation teacher, forward only (distill.coef > 0)  phases/logprob.py,
                training/teacher.py; its logprobs enter the advantages in the loss  algorithm/distill.py
  old_logprob   the policy before the update (only with several updates)  phases/logprob.py
  train         one Adam step per mini-batch of the clipped surrogate      phases/train.py (GRPOLoss)
  sync          export stream -> engines, then a mismatch probe            phases/sync.py
  eval          held-out greedy pass@1 (and mean@k) every train.eval_interval  phases/eval.py
  bookkeeping   metrics.jsonl, samples, checkpoint                         phases/bookkeeping.py
  safe point    a signal on any rank (SIGTERM, checkpoint.signal): save, exit 75  distributed/preemption.py

The rollout and reward phases come from a ``GroupSource`` (training/groups.py), called the same way
in every arrangement: ``RolloutNow`` generates each iteration's rollout when the loop takes it;
with engines that generate while the trainer trains (``JobConfig.producer_loop``) ``GroupProducer``
submits each batch up to train.max_staleness weight versions ahead (0: this loop's
order, bit for bit); with rollout.partial.enabled ``PartialRollouts`` (training/partial.py) advances a
pool of partial responses by segments, across weight updates, and takes the oldest complete groups.
A replay (``rollout.replay_dir``) takes them from an earlier run's dump instead
(``ReplaySource``, training/rollout_dump.py): no engine starts, the sync and eval phases do nothing;
``rollout.dump_dir`` writes that dump as the loop takes each batch (``DumpingSource``).

The colocated memory moves (onload; offload around the sync; the checkpoint's visit) are
``ColocatedMemory`` (training/offload.py), ``job.memory``.

``throughput/tokens_per_s`` counts the prompt and response tokens of the batch per second of the whole
iteration.

Departures from the GRPO paper, all configurable: the fixes named in algorithm/config.py (Dr.GRPO,
DAPO, TIS) are off by default; with one update per iteration pi_old is the detached current policy
(ratio 1), as in DeepSeekMath's on-policy setting.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from grpo_megatron.algorithm.kl import kl_beta
from grpo_megatron.checkpoint.manager import checkpoint_name
from grpo_megatron.distributed.collectives import on_rank0
from grpo_megatron.distributed.preemption import Preempted, report_preempted
from grpo_megatron.fileio import write_text_atomic
from grpo_megatron.rollout.multiturn import trajectory_metrics
from grpo_megatron.training.batching import Sample
from grpo_megatron.training.groups import GroupSource
from grpo_megatron.training.job import Job, build_job, export_hf_checkpoint
from grpo_megatron.training.phases.advantages import UpdatePlan, prepare_update
from grpo_megatron.training.phases.bookkeeping import (
    freeze_startup_objects,
    sample_rows,
    save_checkpoint,
    stop_if_not_finite,
)
from grpo_megatron.training.phases.eval import evaluate
from grpo_megatron.training.phases.logprob import PassSettings, logprob_pass, teacher_pass
from grpo_megatron.training.phases.reward import Group
from grpo_megatron.training.phases.sync import ProbeBatch, answer_probe, probe_due
from grpo_megatron.training.phases.train import GRPOLoss, update_policy
from grpo_megatron.training.route_replay import RoutingReplay
from grpo_megatron.training.sources import group_source, source_state
from grpo_megatron.training.timing import PhaseTimer, Timer

if TYPE_CHECKING:
    from grpo_megatron.config import JobConfig


@dataclass
class Iteration:
    """What one iteration produced: its rollouts, the trainer samples and the metrics of its phases."""

    groups: list[Group]
    samples: list[Sample]
    """This rank's data-parallel replica's samples (``plan`` indexes them)."""
    plan: UpdatePlan
    metrics: dict[str, float]
    tokens: int = 0
    """Prompt and response tokens of the whole batch."""


@dataclass
class LoopState:
    """The GRPO loop's own state, saved in every checkpoint's ``trainer_state.pt`` as the plain dict
    ``to_dict`` makes (the on-disk format: checkpoints written before this class resume through
    ``from_dict``)."""

    iteration: int = 0
    """The last iteration done."""
    sampler: dict[str, Any] | None = None
    """``PromptSampler.state_dict()``; None before the first iteration."""
    eval: dict[str, float] = field(default_factory=dict)
    """The last held-out evaluation's metrics."""
    best: tuple[int, float] | None = None
    """(iteration, accuracy) of the best held-out evaluation; None until the loop sets it (and in
    checkpoints older than it)."""

    def to_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "sampler": self.sampler, "eval": self.eval, "best": self.best}

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> LoopState:
        best = saved.get("best")
        return cls(saved["iteration"], saved["sampler"], dict(saved["eval"]), tuple(best) if best else None)


class Abandoned(Exception):
    """Raised on every rank at a safe point before the update (``abandon_if_signalled``): a signal came,
    and iteration's batch is dropped; the state to keep is the iteration before's."""

    def __init__(self, signal_name: str, where: str) -> None:
        super().__init__(f"{signal_name} during {where}: the batch is dropped")
        self.signal_name, self.where = signal_name, where


def abandon_if_signalled(job: Job, drops: bool, where: str) -> None:
    """A safe point inside the iteration, before anything of it is kept (issue 51 item 5). Collective
    where ``drops`` (the source can drop its batch: the same on every rank): any rank's signal raises
    ``Abandoned`` on every rank."""
    if drops and (name := job.preemption.requested_anywhere(dist.group.WORLD)):
        raise Abandoned(name, where)


def run_iteration(
    job: Job, source: GroupSource, probe: ProbeBatch, it: int, timer: Timer, *, drops: bool = False
) -> Iteration:
    """One GRPO iteration, rollout to weight sync, each phase timed as ``time/<phase>``; the rollout and
    reward phases are ``source``'s (training/groups.py). ``drops``: a signal before the update drops the
    batch (``Abandoned``): the engines' generation is cut short at the signal (``RolloutFleet.
    interrupt``), then safe points after the reward and after the logprob passes."""
    cfg, ps, policy = job.cfg, job.ps, job.policy
    with job.preemption.interrupting(job.fleet.interrupt) if drops else contextlib.nullcontext():
        produced = source.take(it, timer)
    abandon_if_signalled(job, drops, "the rollout and reward")
    groups = produced.groups
    with timer("onload"):
        onload_metrics = job.memory.to_trainer()
    with timer("advantages"):
        # this replica's samples only; the held payloads and routes of the source's later batches stay held
        batch, plan = prepare_update(
            cfg.algorithm,
            cfg.train,
            cfg.rollout.response_budget.tokens,
            ps,
            job.fleet,
            groups,
            release_payloads=produced.release_payloads,
            release_routes=produced.release_routes,
        )
    # Every trainer pass takes these; each pass's MoE routing is algorithm.routing_replay's (off, r2, r3).
    passes = PassSettings(
        ps,
        job.pad_id,
        policy.spec.vocab_size,
        cfg.rollout.temperature,
        RoutingReplay(cfg.algorithm.routing_replay, ps, policy.spec.num_experts),
        cfg.rollout.truncation,
    )
    with timer("ref_logprob"), job.reference_on_device() as reference:
        if reference is not None:
            logprob_pass(reference, batch.samples, plan, "ref", passes).store(batch.samples)
    teacher_metrics: dict[str, float] = {}
    if job.teacher is not None:
        with timer("teacher_logprob"), job.teacher_on_device() as teacher:
            assert teacher is not None
            teacher_metrics = teacher_pass(teacher, batch.samples, plan, passes)
    routing_metrics: dict[str, float] = {}  # the first policy pass's: the old-policy pass when it runs
    with timer("old_logprob"):
        if cfg.train.updates_per_iteration > 1 and cfg.train.old_logprobs == "trainer":
            old = logprob_pass(policy.model, batch.samples, plan, "old", passes)
            old.store(batch.samples)
            routing_metrics = old.routing_metrics
    abandon_if_signalled(job, drops, "the logprob passes")  # the last point before the weights change
    beta = kl_beta(cfg.algorithm.kl, it - 1, cfg.train.iterations)
    loss = GRPOLoss(
        cfg.algorithm_in_effect,  # the off-policy correction resolved by the rollout (FP8: icepop)
        beta,
        cfg.algorithm.loss_norm_len or cfg.rollout.response_budget.tokens,
        old_from_engine=cfg.train.old_logprobs == "engine",
        distill=cfg.distill if job.teacher is not None else None,
    )
    with timer("train"):  # a signal stops the update at its next mini-batch (a safe point: every rank asks)
        stop = lambda: job.preemption.requested_anywhere(dist.group.WORLD) is not None  # noqa: E731
        train_metrics = update_policy(
            policy, batch.samples, plan, loss, passes, measure_routing=not routing_metrics, stop=stop
        )
    with timer("rollout"):  # asynchronous with SGLang: the batches in flight end before the sync stream
        drain_metrics = source.before_sync()
    with timer("sync"):
        due = probe_due(it, cfg.rollout.probe_interval, cfg.train.iterations)
        sync_metrics = job.sync_engines(it, probe if due else None)
    source.after_sync(
        it
    )  # the engines have version `it` (asynchronous: the batch that may lag it by N goes out)
    metrics = {
        **produced.metrics,
        **drain_metrics,
        **train_metrics,
        **routing_metrics,
        **teacher_metrics,
        "kl_beta": beta,
        "response_len/mean": sum(c.num_tokens for g in groups for c in g.completions) / batch.size,
        **trajectory_metrics([c for g in groups for c in g.completions]),  # multi-turn: turns/mean, tool/*
        **batch.metrics,
        **sync_metrics,
        **onload_metrics,
    }
    metrics.setdefault("kl", 0.0)
    return Iteration(groups, batch.samples, plan, metrics, batch.tokens)


def evaluate_unless_signalled(job: Job, iteration: int) -> dict[str, float] | None:
    """The eval phase of a training iteration; a signal during it cuts the engines' generation short
    (``RolloutFleet.interrupt``) and then its numbers would be wrong: None on every rank (collective)."""
    with job.preemption.interrupting(job.fleet.interrupt):
        metrics = evaluate_job(job, iteration)
    if job.has_engines and job.preemption.requested_anywhere(dist.group.WORLD):
        return None
    return metrics


def keep_last_iteration(
    job: Job, source: GroupSource, before: LoopState, saved_at: int | None, stop: Abandoned
) -> Preempted:
    """A batch dropped (``Abandoned``): the state of the last completed iteration (``before``: the
    weights have not changed since its end) is checkpointed unless a checkpoint of it exists already
    (or nothing was trained yet: a rerun starts afresh the same way); every rank then stops (75)."""
    done = before.iteration
    if done > 0 and saved_at != done:
        save_checkpoint(job.checkpoints, job.memory, job.policy, done, source_state(before.to_dict(), source))
    job.preemption.checkpoint_written = True
    if job.ps.rank == 0:
        print(
            f"[preempt] {stop.signal_name} during {stop.where} of iteration {done + 1}: its batch is "
            f"dropped; the rerun starts from iteration {done}",
            flush=True,
        )
    return Preempted(done, stop.signal_name, saved=done > 0)


def evaluate_job(job: Job, iteration: int) -> dict[str, float]:
    """The eval phase with the job's objects (also SFT's held-out check); none in a replay (no engines)."""
    if not job.has_engines:
        return {}
    return evaluate(
        job.rollout,
        job.scorer,
        job.eval_records,
        train_seed=job.cfg.train.seed,
        iteration=iteration,
        samples=job.cfg.train.eval_samples,
    )


def job_probe(job: Job) -> ProbeBatch:
    """The run's fixed mismatch-probe batch (rollout.probe_batch held-out, else training, prompts)."""
    return answer_probe(
        job.eval_records or job.train_records, job.tokenizer, job.eos_id, job.cfg.rollout.probe_batch
    )


def train(job: Job) -> dict[str, float]:
    cfg = job.cfg
    resumed = job.checkpoints.resume(job.policy)
    job.beat("resume")
    state = LoopState.from_dict(resumed) if resumed is not None else LoopState()
    sampler = job.make_sampler()
    if state.sampler is not None:
        sampler.load_state_dict(state.sampler)
    start = state.iteration
    # Lines after the resumed checkpoint belong to iterations about to be redone; a fresh start
    # (no checkpoint yet: a crash before the first save, or save_interval=0) redoes everything,
    # its iteration-0 evaluation included.
    job.logger.truncate_from(start + 1 if resumed is not None else 0)
    probe = job_probe(job)
    job.sync_engines(start, probe)  # the engines start from the trainer's weights
    source = group_source(job, sampler, resumed)
    source.start(start)
    last_eval = dict(state.eval)
    if resumed is None:  # a fresh run: held-out accuracy before any update, logged as iteration 0
        last_eval = evaluate_job(job, start)
        job.logger.log(start, last_eval)
    first_eval = dict(last_eval)
    job.beat("first evaluation")
    freeze_startup_objects()
    # (iteration, accuracy) of the best held-out evaluation: the final report gives it beside the last
    best = state.best or (start, last_eval.get("eval/accuracy", float("nan")))
    last_it = start

    saved_at = start if resumed is not None else None  # the newest checkpoint's iteration
    drops = bool(getattr(source, "drops_batches", False))  # a signal may drop the batch being taken
    for it in range(start + 1, cfg.train.iterations + 1):
        timer = PhaseTimer(beat=job.beat)
        eval_metrics: dict[str, float] = {}
        before = LoopState(it - 1, sampler.state_dict(), dict(last_eval), best)  # kept if `it` is dropped
        try:
            with timer("iteration"):
                result = run_iteration(job, source, probe, it, timer, drops=drops)
                with timer("eval"):
                    due = it == cfg.train.iterations or (
                        cfg.train.eval_interval and it % cfg.train.eval_interval == 0
                    )
                    evaluated = evaluate_unless_signalled(job, it) if due else None
                    if evaluated is not None:
                        eval_metrics = last_eval = evaluated
                        last_it = it
                        if (
                            not eval_metrics.get("eval/accuracy", float("nan")) <= best[1]
                        ):  # NaN best: replace
                            best = (it, eval_metrics.get("eval/accuracy", float("nan")))
        except Abandoned as stop:
            raise keep_last_iteration(job, source, before, saved_at, stop) from None
        n_tokens = result.tokens
        metrics = {
            **result.metrics,
            **eval_metrics,
            **job.fleet.recovery.metrics(),  # engine/restarts, engine/restart_s (only after a restart)
            # the worst engine resume since the last row: a save's or a restart's visit included
            **job.memory.take_cached_at_resume(),
            **timer.seconds,
            "throughput/tokens_per_s": n_tokens / timer.seconds["time/iteration"],
        }
        for name in ("ref_logprob", "old_logprob"):
            metrics.setdefault(f"time/{name}", 0.0)
        job.logger.log(it, metrics)
        stop_if_not_finite(metrics, it, f"the checkpoints in {job.checkpoints.dir} are untouched")
        if cfg.logging.samples_interval and it % cfg.logging.samples_interval == 0:
            job.logger.log_samples(it, sample_rows(result.groups, cfg.train.rollout_samples_logged))
        trainer_state = LoopState(it, sampler.state_dict(), last_eval, best).to_dict()
        saved = job.checkpoints.should_save(it, final_iteration=cfg.train.iterations)
        if saved:
            save_checkpoint(job.checkpoints, job.memory, job.policy, it, source_state(trainer_state, source))
            saved_at = it
        # The safe point: any rank's signal (SIGTERM, checkpoint.signal) stops every rank here, saved.
        if signal_name := job.preemption.requested_anywhere(dist.group.WORLD):
            if not saved:
                save_checkpoint(
                    job.checkpoints, job.memory, job.policy, it, source_state(trainer_state, source)
                )
            job.preemption.checkpoint_written = True
            raise Preempted(it, signal_name)
    return {
        "before": first_eval.get("eval/accuracy", float("nan")),
        "after": last_eval.get("eval/accuracy", float("nan")),
        "after_iteration": last_it,
        "best": best[1],
        "best_iteration": best[0],
    }


def main(cfg: JobConfig) -> int:
    from grpo_megatron.distributed.bootstrap import destroy_distributed

    # The CLI (the only caller) checked data paths and output directories before any process group.
    start = time.perf_counter()
    job = build_job(cfg, with_reference=cfg.algorithm.kl.enabled)
    preempted: Preempted | None = None
    in_order = False  # every rank reached the run's end (or the safe point) together
    try:
        result = train(job)
        if cfg.checkpoint.export_hf_dir:
            export_hf_checkpoint(job, job.run_dir / cfg.checkpoint.export_hf_dir)
        in_order = True
    except Preempted as stop:
        preempted, in_order = stop, True
    finally:
        job.close(together=in_order)
    if preempted is not None:
        checkpoint = job.checkpoints.dir / checkpoint_name(preempted.iteration)
        code = report_preempted(preempted, checkpoint, job.ps.rank, dist.group.WORLD)
        destroy_distributed()
        return code
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
