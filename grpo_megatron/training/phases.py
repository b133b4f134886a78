"""The phases of a GRPO iteration, one function each; training/grpo.py strings them together.

Every function runs on every rank with the same inputs and returns the same result everywhere
(rollouts are gathered by the fleet, rewards are broadcast from rank 0), except the logprob passes
and the update, which work on this rank's data-parallel share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from grpo_megatron.algorithm.advantages import advantages_from_config
from grpo_megatron.algorithm.batch_shaping import dynamic_sampling, overlong_penalty
from grpo_megatron.algorithm.mismatch import tis_weights
from grpo_megatron.algorithm.policy_loss import grpo_policy_loss, loss_normalizer
from grpo_megatron.distributed.collectives import collective_device, on_rank0
from grpo_megatron.rewards.base import RewardSample, attach_groups
from grpo_megatron.rewards.pool import report_failures
from grpo_megatron.rollout.engine import Completion, SamplingParams
from grpo_megatron.training.batching import (
    Sample,
    all_rank_microbatches,
    batch_metrics,
    collate,
    make_sample,
    minibatch_slices,
    scatter_logprobs,
)
from grpo_megatron.training.forward_backward import MicroBatch, forward_backward, forward_logprobs
from grpo_megatron.training.job import Job


@dataclass
class Group:
    """One prompt with its G scored responses."""

    record: object  # data.PromptRecord
    completions: list[Completion]
    rewards: list[float]
    texts: list[str]


def sampling_params(job: Job, *, n: int, seed: int, greedy: bool = False) -> SamplingParams:
    r = job.cfg.rollout
    return SamplingParams(
        n=n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=(job.eos_id,),
        seed=seed,
        greedy=greedy,
    )


def rollout(job: Job, records: Sequence, params: SamplingParams) -> list[list[Completion]]:
    """G completions per prompt, in prompt order, on every rank."""
    return job.fleet.generate([list(r.prompt_ids) for r in records], params)


def score(job: Job, records: Sequence, completions: list[list[Completion]]) -> tuple[list[Group], dict[str, float]]:
    """Rewards of every completion (rank 0's reward pool, broadcast), grouped per prompt."""
    texts = [[job.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in cs] for cs in completions]

    def score_all() -> tuple[list[float], dict[str, float]]:
        assert job.rewards is not None  # rank 0 holds the pool
        samples = [
            RewardSample(
                prompt=r.prompt,
                response=t,
                label=r.answer,
                metadata=dict(r.metadata),
                response_len_tokens=len(c.token_ids),
            )
            for r, cs, ts in zip(records, completions, texts, strict=True)
            for c, t in zip(cs, ts, strict=True)
        ]
        group_size = len(completions[0]) if completions else 1
        batch = job.rewards.score_detailed(attach_groups(samples, group_size))
        report_failures(batch, job.cfg.reward)  # prints the first failure; stops past reward.max_error_frac
        return batch.rewards, batch.metrics

    rewards, metrics = on_rank0(score_all, "reward scoring")
    groups, k = [], 0
    for r, cs, ts in zip(records, completions, texts, strict=True):
        groups.append(Group(r, cs, list(rewards[k : k + len(cs)]), ts))
        k += len(cs)
    return groups, metrics


def collect_groups(job: Job, sampler, timer, iteration: int) -> tuple[list[Group], dict[str, float]]:
    """Rollout + reward of train.prompts_per_iteration prompts; with DAPO dynamic sampling, repeated
    rounds keep only groups whose rewards differ (the batch may come out smaller). Reward metrics are those of the first round (the
    policy's own reward, before any filtering)."""
    cfg = job.cfg
    rounds: list[dict[str, float]] = []
    last_round: list[Group] = []

    def sample_round(n: int) -> list[Group]:
        records = [job.train_records[i] for i in sampler.next_indices(n)]
        seed = cfg.train.seed * 1_000_003 + iteration + 7919 * len(rounds)
        params = sampling_params(job, n=cfg.rollout.n_samples_per_prompt, seed=seed)
        with timer("rollout"):
            completions = rollout(job, records, params)
        with timer("reward"):
            groups, metrics = score(job, records, completions)
        rounds.append(metrics)
        last_round[:] = groups
        return groups

    ds = cfg.algorithm.dynamic_sampling
    if not ds.enabled:
        groups = sample_round(cfg.train.prompts_per_iteration)
        return groups, rounds[0]
    groups, ds_metrics = dynamic_sampling(
        sample_round,
        lambda g: g.rewards,
        cfg.train.prompts_per_iteration,
        max_tries=ds.max_tries,
        std_threshold=ds.std_threshold,
    )
    if not groups:
        # No group with reward variance in any round: train on the last round as it is (zero
        # advantages: only the KL term moves the policy) rather than skip the iteration's phases.
        groups = list(last_round)
        ds_metrics["dynamic_sampling/fallback"] = 1.0
    return groups, rounds[0] | ds_metrics


def build_samples(job: Job, groups: Sequence[Group]) -> tuple[list[Sample], dict[str, float]]:
    """Rewards (+ DAPO overlong penalty) -> group-relative advantages -> trainer samples."""
    alg = job.cfg.algorithm
    rewards_b = torch.tensor([x for g in groups for x in g.rewards], dtype=torch.float32)
    lengths_b = torch.tensor([len(c.token_ids) for g in groups for c in g.completions], dtype=torch.float32)
    metrics: dict[str, float] = {}
    if alg.overlong.enabled:
        max_len = alg.overlong.max_len or job.cfg.rollout.max_new_tokens
        penalty_b, metrics = overlong_penalty(lengths_b, max_len, alg.overlong.buffer_len, alg.overlong.penalty)
        rewards_b = rewards_b + penalty_b
    group_size = len(groups[0].completions)
    advantages_b = advantages_from_config(rewards_b, group_size, alg)
    samples, k = [], 0
    for g in groups:
        for c in g.completions:
            samples.append(make_sample(g.record.prompt_ids, c.token_ids, c.logprobs, float(advantages_b[k])))
            k += 1
    metrics["advantage/abs_mean"] = float(advantages_b.abs().mean())
    return samples, metrics


@dataclass
class UpdatePlan:
    """This rank's micro-batches (rows into the sample list), per mini-batch, and each mini-batch's
    global loss normaliser (the same on every rank)."""

    rows: list[list[list[int]]]
    normalizers: list[float]
    packed: bool = False
    """Micro-batches are packed sequences (train.packing)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """batch/padding_frac and batch/tokens_per_microbatch over every rank's micro-batches."""

    @property
    def all_rows(self) -> list[list[int]]:
        return [r for minibatch in self.rows for r in minibatch]


def plan_update(job: Job, samples: Sequence[Sample]) -> UpdatePlan:
    """Split the batch into mini-batches, DP shares and micro-batches (training/batching.py)."""
    cfg, ps = job.cfg, job.ps
    lengths = [s.length for s in samples]
    rows, normalizers, every_rank = [], [], []
    for minibatch in minibatch_slices(len(samples), cfg.train.updates_per_iteration):
        per_rank = all_rank_microbatches(
            lengths,
            minibatch,
            dp_size=ps.dp,
            micro_batch_size=cfg.train.micro_batch_size,
            max_tokens=cfg.train.max_tokens_per_micro_batch,
            packing=cfg.train.packing,
        )
        rows.append(per_rank[ps.dp_rank])
        every_rank.extend(per_rank)
        normalizers.append(
            sum(loss_normalizer(cfg.algorithm.loss_agg_mode, samples[i].mask_s[None]) for i in minibatch)
        )
    return UpdatePlan(rows, normalizers, cfg.train.packing, batch_metrics(lengths, every_rank, cfg.train.packing))


def logprob_pass(job: Job, model: torch.nn.Module, samples: list[Sample], plan: UpdatePlan, name: str) -> None:
    """Forward-only logprobs of this rank's samples under ``model``, stored as ``sample.logprobs[name]``."""
    rows = plan.all_rows
    microbatches = [collate(samples, r, job.pad_id, packed=plan.packed) for r in rows]
    outputs = forward_logprobs(
        model,
        microbatches,
        job.ps,
        vocab_size=job.policy.spec.vocab_size,
        temperature=job.cfg.rollout.temperature,
    )
    scatter_logprobs(samples, rows, [o.logprobs_bs for o in outputs], name)


# Metrics the loss function reports as sums over a micro-batch's response tokens (divided by the
# global token count after the data-parallel reduction) and as plain sums.
_TOKEN_MEAN = ("clip_frac", "clip_frac/low", "clip_frac/high", "kl", "ppo_kl", "ratio/mean")
_SUMMED = ("loss/pg", "loss/kl", "loss/total")


def grpo_loss_fn(job: Job, normalizer: float, kl_beta: float):
    """The loss of one micro-batch (its share of the mini-batch's GRPO loss) and its metrics."""
    alg = job.cfg.algorithm
    norm_len = alg.loss_norm_len or job.cfg.rollout.max_new_tokens
    from_engine = job.cfg.train.old_logprobs == "engine"

    def loss_fn(logprobs_bs: torch.Tensor, entropy_bs: torch.Tensor | None, mb: MicroBatch):
        e = mb.extras
        mask_bs = e["mask_bs"]
        rollout_bs = e["rollout_logprobs_bs"]
        # pi_old before any update of this iteration, on the trainer's side.
        trainer_old_bs = e.get("old_logprobs_bs", logprobs_bs.detach())
        old_bs = rollout_bs if from_engine else e.get("old_logprobs_bs")
        tis_bs = None
        if alg.tis.enabled:
            tis_bs, _ = tis_weights(trainer_old_bs, rollout_bs, mask_bs, alg.tis.cap)
        loss, m = grpo_policy_loss(
            logprobs_bs,
            old_bs,
            e["advantages_b"],
            mask_bs,
            alg,
            ref_logprobs_bt=e.get("ref_logprobs_bs"),
            kl_beta=kl_beta,
            tis_weights_bt=tis_bs,
            normalizer=normalizer,
            norm_len=norm_len,
        )
        n_tokens = mask_bs.sum()
        out = {k: m[k] for k in _SUMMED if k in m}
        out |= {f"{k}:tok": m[k] * n_tokens for k in _TOKEN_MEAN if k in m}
        if entropy_bs is not None:
            out["entropy:tok"] = (entropy_bs.detach() * mask_bs).sum()
        diff_bs = (trainer_old_bs - rollout_bs).abs() * mask_bs
        out["mismatch/logprob_abs_diff:tok"] = diff_bs.sum()
        out["mismatch/logprob_abs_diff_max:max"] = diff_bs.max()
        out["tokens"] = n_tokens
        return loss, out

    return loss_fn


def reduce_metrics(per_microbatch: Sequence[dict[str, float]], job: Job, minibatches: int) -> dict[str, float]:
    """Sum this rank's micro-batch metrics, reduce over data-parallel ranks, turn token sums into means."""
    keys = sorted({k for m in per_microbatch for k in m if k != "loss"})
    sums = [k for k in keys if not k.endswith(":max")]
    maxes = [k for k in keys if k.endswith(":max")]
    sum_t = torch.tensor([sum(m.get(k, 0.0) for m in per_microbatch) for k in sums], dtype=torch.float64)
    max_t = torch.tensor([max((m.get(k, 0.0) for m in per_microbatch), default=0.0) for k in maxes],
                         dtype=torch.float64)
    if job.ps.dp > 1:
        device = collective_device(job.ps.dp_group)
        sum_t, max_t = sum_t.to(device), max_t.to(device)
        dist.all_reduce(sum_t, group=job.ps.dp_group)
        dist.all_reduce(max_t, op=dist.ReduceOp.MAX, group=job.ps.dp_group)
    total = dict(zip(sums, sum_t.tolist(), strict=True))
    tokens = max(total.pop("tokens", 0.0), 1.0)
    out: dict[str, float] = {}
    for k, v in total.items():
        out[k.removesuffix(":tok")] = v / tokens if k.endswith(":tok") else v / minibatches
    out |= {k.removesuffix(":max"): v for k, v in zip(maxes, max_t.tolist(), strict=True)}
    out["loss/policy"] = out.pop("loss/pg", 0.0)
    return out


def update_policy(job: Job, samples: list[Sample], plan: UpdatePlan, kl_beta: float) -> dict[str, float]:
    """One optimizer step per mini-batch; returns loss, clip, KL, entropy and mismatch metrics."""
    per_microbatch: list[dict[str, float]] = []
    steps: list[dict[str, float]] = []
    for rows, normalizer in zip(plan.rows, plan.normalizers, strict=True):
        job.policy.zero_grad()
        per_microbatch += forward_backward(
            job.policy.model,
            [collate(samples, r, job.pad_id, packed=plan.packed) for r in rows],
            job.ps,
            grpo_loss_fn(job, normalizer, kl_beta),
            vocab_size=job.policy.spec.vocab_size,
            temperature=job.cfg.rollout.temperature,
            with_entropy=True,
        )
        steps.append(job.policy.step())
    metrics = reduce_metrics(per_microbatch, job, len(plan.rows)) | plan.metrics
    metrics["grad_norm"] = sum(s["grad_norm"] for s in steps) / len(steps)
    if "lr" in steps[-1]:
        metrics["lr"] = steps[-1]["lr"]
    return metrics


def probe_sequences(job: Job) -> tuple[list[list[int]], list[int]]:
    """A fixed batch for the mismatch probe: the first held-out (else training) prompts followed by
    their reference answers, so every run and every resume probes the same tokens."""
    records = (job.eval_records or job.train_records)[: job.cfg.rollout.probe_batch]
    sequences, prompt_lens = [], []
    for r in records:
        answer_ids = job.tokenizer(str(r.answer), add_special_tokens=False)["input_ids"]
        sequences.append([*r.prompt_ids, *answer_ids, job.eos_id])
        prompt_lens.append(len(r.prompt_ids))
    return sequences, prompt_lens


def trainer_to_device(job: Job) -> dict[str, float]:
    """Colocated memory swap, engines -> trainer (train.offload_trainer): the engines release their
    device memory, then the trainer's state comes back from the host. A no-op when off."""
    from grpo_megatron.training.offload import onload

    if not job.cfg.train.offload_trainer or not job.offloaded:
        return {}
    job.fleet.release_memory(None)
    seconds = sum(onload(job.policy, report) for report in reversed(job.offloaded))
    job.offloaded.clear()
    return {"offload/onload_seconds": seconds}


def sync_weights(job: Job, version: int, probe: tuple[list[list[int]], list[int]]) -> dict[str, float]:
    """Weight sync as ``version`` and the mismatch probe. With train.offload_trainer, in the order that
    keeps peak device memory low: gradients and optimizer state leave first, the engines take their
    weights back and receive the new ones, then the parameters leave and the engines get their caches."""
    from grpo_megatron.training.offload import offload

    swap = job.cfg.train.offload_trainer
    if swap:
        job.offloaded.append(offload(job.policy, parts=("grads", "optimizer")))
        job.fleet.resume_memory(["weights"])
    metrics = job.fleet.sync_weights(job.policy.model, version=version)
    metrics |= job.fleet.mismatch_probe(job.policy.model, job.ps, *probe, temperature=job.cfg.rollout.temperature)
    if swap:
        report = offload(job.policy, parts=("params",))
        job.offloaded.append(report)
        job.fleet.resume_memory(["kv_cache", "cuda_graph"])
        metrics |= report.metrics()
    return metrics


def save_checkpoint(job: Job, iteration: int, trainer_state: dict) -> None:
    """Checkpoint the policy; trainer state that is offloaded (train.offload_trainer) visits the device
    for the save and leaves again, so the engines keep their memory."""
    from grpo_megatron.training.offload import offload, onload

    was_offloaded = bool(job.offloaded)
    for report in reversed(job.offloaded):
        onload(job.policy, report)
    job.offloaded.clear()
    job.checkpoints.save(iteration, job.policy, trainer_state)
    if was_offloaded:
        job.offloaded.append(offload(job.policy, parts=("grads", "optimizer")))
        job.offloaded.append(offload(job.policy, parts=("params",)))


def evaluate(job: Job, iteration: int) -> dict[str, float]:
    """Held-out accuracy: greedy pass@1 (``eval/accuracy``) and, with train.eval_samples = k > 0,
    mean@k of sampled responses (``eval/mean@k``)."""
    records = job.eval_records
    if not records:
        return {}
    seed = job.cfg.train.seed * 1_000_003 + iteration
    greedy = rollout(job, records, sampling_params(job, n=1, seed=seed, greedy=True))
    groups, _ = score(job, records, greedy)
    accuracy = sum(g.rewards[0] for g in groups) / len(groups)
    metrics = {"eval/accuracy": accuracy}
    k = job.cfg.train.eval_samples
    if k > 0:
        sampled = rollout(job, records, sampling_params(job, n=k, seed=seed + 1))
        groups, _ = score(job, records, sampled)
        metrics[f"eval/mean@{k}"] = sum(sum(g.rewards) / k for g in groups) / len(groups)
    return metrics


# Not grad_norm: megatron reports none (NaN here) when clipping is off. NaN gradients make NaN
# weights, which the next loss and the save's parameter check catch.
LOSS_KEYS = ("loss/policy", "sft/loss")


def stop_if_not_finite(metrics: dict[str, float], iteration: int, kept: str) -> None:
    """Raise before anything is saved when the iteration's loss is not finite:
    the weights it wrote are NaN, and a checkpoint of them must never become ``latest``. ``kept``
    says what stays intact, for the message."""
    bad = {k: metrics[k] for k in LOSS_KEYS if k in metrics and not math.isfinite(metrics[k])}
    if bad:
        shown = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise FloatingPointError(
            f"iteration {iteration}: {shown}; the run stops before saving these weights ({kept}). "
            "Lower the learning rate or set train.grad_clip"
        )
