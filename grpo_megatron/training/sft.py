"""``grpo-megatron sft CONFIG [section.key=value ...]``: supervised cold start before GRPO.

DeepSeek-R1 starts RL from a model fine-tuned on a few thousand worked solutions. This command
trains the policy with the next-token loss on the response tokens of prompt/response pairs
(a JSONL/Parquet file with a response field, or a procedural generator's gold solutions), checks
greedy accuracy on held-out dev prompts every ``sft.eval_interval`` steps through the same rollout
engine and reward as GRPO, stops once it reaches ``sft.stop_accuracy`` (or, with
``sft.target_accuracy_band``, exports the in-band weights closest to the band's centre: see
``BandKeeper``), and writes a Hugging Face checkpoint (safetensors, config.json, tokenizer files)
through the weight bridge's export stream. Point ``model.hf_path`` of the GRPO job at that directory.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from grpo_megatron.distributed.collectives import collective_device, on_rank0
from grpo_megatron.fileio import write_text_atomic
from grpo_megatron.training.batching import LossInputs, Sample, collate, make_samples, rank_microbatches
from grpo_megatron.training.forward_backward import MicroBatch, forward_backward
from grpo_megatron.training.job import SFTJob, build_sft_job, export_hf_checkpoint
from grpo_megatron.training.phases.bookkeeping import freeze_startup_objects, stop_if_not_finite
from grpo_megatron.training.phases.eval import evaluate

if TYPE_CHECKING:
    from collections.abc import Sequence

    from grpo_megatron.config import JobConfig
    from grpo_megatron.data import SFTRecord
    from grpo_megatron.data.sampler import PromptSampler
    from grpo_megatron.training.config import SFTConfig


def sft_job_config(cfg: JobConfig) -> JobConfig:
    """The job config the SFT job is built with: the optimizer runs at sft.lr, constant."""
    train = dataclasses.replace(
        cfg.train,
        lr=cfg.sft.lr,
        min_lr=cfg.sft.lr,
        lr_decay="constant",
        lr_warmup_iterations=0,
        iterations=cfg.sft.max_steps,
    )
    # The console reports at each dev evaluation (metrics.jsonl still gets every step).
    logging = dataclasses.replace(cfg.logging, log_interval=cfg.sft.eval_interval)
    return dataclasses.replace(cfg, train=train, logging=logging)


def sft_step(job: SFTJob, samples: list[Sample]) -> dict[str, float]:
    """One optimizer step of the mean response-token negative log-likelihood over ``samples``."""
    cfg, ps = job.cfg, job.ps
    rows = rank_microbatches(
        [s.length for s in samples],
        range(len(samples)),
        dp_size=ps.dp,
        dp_rank=ps.dp_rank,
        micro_batch_size=cfg.train.micro_batch_size,
        max_tokens=cfg.train.max_tokens_per_micro_batch,
        packing=cfg.train.packing,
    )
    total_tokens = float(sum(s.mask_s.sum() for s in samples))

    def nll(
        logprobs_bs: torch.Tensor, entropy_bs: torch.Tensor | None, mb: MicroBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask_bs = LossInputs.of(mb).mask_bs
        loss = -(logprobs_bs * mask_bs).sum() / total_tokens  # this micro-batch's share of the mean
        return loss, {"tokens": mask_bs.sum()}

    job.policy.zero_grad()
    outs = forward_backward(
        job.policy.model,
        [collate(samples, r, job.pad_id, packed=cfg.train.packing) for r in rows],
        ps,
        nll,
        vocab_size=job.policy.spec.vocab_size,
    )
    loss_t = torch.tensor([sum(o["loss"] for o in outs)], dtype=torch.float64)
    if ps.dp > 1:
        loss_t = loss_t.to(collective_device(ps.dp_group))
        torch.distributed.all_reduce(loss_t, group=ps.dp_group)
    return {"sft/loss": float(loss_t), **job.policy.step()}


@dataclass(frozen=True)
class DevEval:
    """One dev-set evaluation of the cold start."""

    step: int
    accuracy: float


@dataclass
class BandKeeper:
    """Which evaluation's weights a cold start with ``sft.target_accuracy_band`` exports, and when it
    stops or replays. Pure bookkeeping; ``run_sft`` holds the weights and acts on the answers.

    An evaluation's rank is (distance to the band, distance to the band's centre), smaller is better;
    the best-ranked one so far is ``kept``. Reaching the centre stops the run. A jump from below the
    band to above it triggers one replay from the last evaluation below the band.
    """

    low: float
    high: float
    kept: DevEval | None = None
    below: DevEval | None = None
    """The last evaluation below the band: the point a replay restarts from."""
    replayed: bool = False

    @property
    def centre(self) -> float:
        return (self.low + self.high) / 2

    def in_band(self, accuracy: float) -> bool:
        return self.low <= accuracy <= self.high

    def rank(self, accuracy: float) -> tuple[float, float]:
        return max(self.low - accuracy, accuracy - self.high, 0.0), abs(accuracy - self.centre)

    def observe(self, ev: DevEval) -> tuple[Literal["continue", "replay", "stop"], bool]:
        """(what to do next, whether ``ev``'s weights become the kept ones)."""
        # later wins ties: of equally close evaluations, the more trained weights
        keep = self.kept is None or self.rank(ev.accuracy) <= self.rank(self.kept.accuracy)
        if keep:
            self.kept = ev
        assert self.kept is not None  # the first evaluation is always kept
        if ev.accuracy < self.low:
            self.below = ev
            return "continue", keep
        jumped = ev.accuracy > self.high and not self.in_band(self.kept.accuracy)
        if jumped and not self.replayed and self.below is not None:
            self.replayed = True
            return "replay", keep
        return ("stop" if ev.accuracy >= self.centre else "continue"), keep

    def reason(self) -> str:
        """Why ``kept`` was kept, for the log."""
        assert self.kept is not None
        band = f"[{self.low:.0%}, {self.high:.0%}]"
        if self.in_band(self.kept.accuracy):
            return f"the in-band evaluation closest to the centre of the band {band}"
        return f"no evaluation landed in the band {band}; this one was the closest to it"


@dataclass
class TrainState:
    """A copy of everything an SFT step changes: weights, Adam state, data order, schedule step."""

    step: int
    weights: list[torch.Tensor]
    adam: list[dict]
    sampler: dict[str, int]
    scheduler_steps: int


def _adams(job: SFTJob) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (one per chained optimizer: dense and expert params)."""
    return [o.optimizer for o in getattr(job.policy.optimizer, "chained_optimizers", [job.policy.optimizer])]


def copy_weights(job: SFTJob) -> list[torch.Tensor]:
    return [p.detach().clone() for p in job.policy.model.parameters()]


def load_weights(job: SFTJob, weights: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, w in zip(job.policy.model.parameters(), weights, strict=True):
            p.copy_(w)
    job.policy.optimizer.reload_model_params()  # main params that are copies, not views, follow


def capture(job: SFTJob, step: int, sampler: PromptSampler) -> TrainState:
    adam = [{p: _clone(st) for p, st in o.state.items()} for o in _adams(job)]
    scheduler_steps = job.policy.scheduler.num_steps if job.policy.scheduler is not None else 0
    return TrainState(step, copy_weights(job), adam, sampler.state_dict(), scheduler_steps)


def _clone(adam_state: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in adam_state.items()}


def restore(job: SFTJob, state: TrainState, sampler: PromptSampler) -> None:
    load_weights(job, state.weights)
    for o, saved in zip(_adams(job), state.adam, strict=True):
        o.state.clear()
        for p, st in saved.items():
            o.state[p] = _clone(st)
    sampler.load_state_dict(state.sampler)
    if job.policy.scheduler is not None:
        job.policy.scheduler.num_steps = state.scheduler_steps


def dev_eval(job: SFTJob, step: int) -> float:
    """The policy's weights into the engines (through the memory phases, as GRPO's sync), the dev
    accuracy, then the training phase's memory again (the engines release theirs)."""
    job.sync_engines(step)
    accuracy = evaluate(
        job.rollout,
        job.scorer,
        job.eval_records,
        train_seed=job.cfg.train.seed,
        iteration=step,
        samples=job.cfg.train.eval_samples,
    )["eval/accuracy"]
    job.memory.to_trainer()
    return accuracy


def sft_samples(batch: Sequence[SFTRecord]) -> list[Sample]:
    """A batch of prompt/response pairs as samples: the loss on every response token, no advantage."""
    return make_samples(
        [p.prompt_ids for p in batch],
        [p.response_ids for p in batch],
        [[0.0] * len(p.response_ids) for p in batch],
        [0.0] * len(batch),
    )


def run_sft(job: SFTJob) -> dict[str, object]:
    """The cold start's steps; returns the steps run, the exported step and its dev accuracy, and why."""
    sft = job.cfg.sft
    pairs = job.sft_records
    sampler = job.make_sampler(len(pairs))
    job.logger.truncate_from(0)  # SFT writes no checkpoints: a rerun starts over, its log too
    keeper = BandKeeper(*sft.target_accuracy_band) if sft.target_accuracy_band else None
    accuracy = dev_eval(job, 0)
    job.logger.log(0, {"eval/accuracy": accuracy})
    kept_weights: list[torch.Tensor] | None = None
    replay_point: TrainState | None = None
    dense_until = 0  # a replay evaluates after every step up to here
    stop_reason = f"reached sft.max_steps={sft.max_steps}"
    action = "continue"
    if keeper is not None:
        action, _ = keeper.observe(DevEval(0, accuracy))  # the initial weights are the replay point
        replay_point = capture(job, 0, sampler)
        kept_weights = copy_weights(job)
    elif sft.stop_accuracy is not None and accuracy >= sft.stop_accuracy:
        action = "stop"
    step = 0
    steps_run = 0
    freeze_startup_objects()
    while step < sft.max_steps and action != "stop":
        step += 1
        job.beat(f"sft step {step}")
        steps_run += 1
        start = time.perf_counter()
        metrics = sft_step(job, sft_samples([pairs[i] for i in sampler.next_indices(sft.batch_size)]))
        if step % sft.eval_interval == 0 or step == sft.max_steps or step <= dense_until:
            accuracy = metrics["eval/accuracy"] = dev_eval(job, step)
            if keeper is not None:
                action, keep = keeper.observe(DevEval(step, accuracy))
                if keep:
                    kept_weights = copy_weights(job)
                if accuracy < keeper.low:
                    replay_point = capture(job, step, sampler)
            elif sft.stop_accuracy is not None and accuracy >= sft.stop_accuracy:
                action = "stop"
            if action == "stop":
                stop_reason = f"dev accuracy {accuracy:.1%} at step {step} reached {_target(sft)}"
        metrics["time/step"] = time.perf_counter() - start
        job.logger.log(step, metrics)
        stop_if_not_finite(metrics, step, "SFT writes its checkpoint only at the end")
        if action == "replay":
            assert replay_point is not None and keeper is not None and keeper.below is not None
            _say(
                job,
                f"[sft] dev accuracy jumped from {keeper.below.accuracy:.1%} (step {keeper.below.step}) to "
                f"{accuracy:.1%} (step {step}), past the band [{keeper.low:.0%}, {keeper.high:.0%}]: replaying "
                f"steps {replay_point.step + 1}-{step} with a dev evaluation after each",
            )
            dense_until = step
            restore(job, replay_point, sampler)
            step = replay_point.step
            job.logger.truncate_from(step + 1)
            action = "continue"
    if keeper is None:
        return {
            "steps": steps_run,
            "last_step": step,
            "kept_step": step,
            "eval/accuracy": accuracy,
            "reason": stop_reason,
        }
    assert keeper.kept is not None and kept_weights is not None
    load_weights(job, kept_weights)
    return {
        "steps": steps_run,
        "last_step": step,
        "kept_step": keeper.kept.step,
        "eval/accuracy": keeper.kept.accuracy,
        "reason": f"{keeper.reason()}; {stop_reason}",
    }


def _target(sft: SFTConfig) -> str:
    if sft.target_accuracy_band:
        return f"the band's centre {sum(sft.target_accuracy_band) / 2:.1%}"
    return f"sft.stop_accuracy={sft.stop_accuracy:.1%}"


def _say(job: SFTJob, line: str) -> None:
    if job.ps.rank == 0:
        print(line, flush=True)


def main(cfg: JobConfig) -> int:
    from grpo_megatron.config import output_dirs
    from grpo_megatron.distributed.bootstrap import destroy_distributed

    # The CLI (the only caller) checked data paths and output directories before any process group.
    start = time.perf_counter()
    job = build_sft_job(sft_job_config(cfg))
    ((_, out_dir),) = output_dirs(cfg, "sft")  # the directory the CLI's preflight checked
    in_order = False  # every rank reached the end together
    try:
        result = run_sft(job)
        export_hf_checkpoint(job, out_dir)
        in_order = True
    finally:
        job.close(together=in_order)
    seconds = time.perf_counter() - start
    _say(
        job,
        f"[sft] kept step {result['kept_step']} of {result['last_step']}, dev accuracy "
        f"{result['eval/accuracy']:.1%} ({result['reason']}); {result['steps']} optimizer steps, "
        f"{seconds:.0f} s; Hugging Face checkpoint in {out_dir}",
    )
    summary = {**result, "seconds": seconds, "hf_dir": str(out_dir)}
    text = json.dumps(summary, indent=1) + "\n"
    on_rank0(lambda: write_text_atomic(job.run_dir / "summary.json", text), "writing the SFT summary")
    destroy_distributed()
    return 0
