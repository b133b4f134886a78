"""Train phase (``time/train``): one optimizer step per mini-batch of the clipped GRPO surrogate
(+ KL, TIS), and the reduction of its metrics over micro-batches and data-parallel ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from grpo_megatron.algorithm.config import AlgorithmConfig
from grpo_megatron.algorithm.distill import distill_advantages, mixed_advantages, sampled_reverse_kl
from grpo_megatron.algorithm.mismatch import mismatch_metrics, tis_weights
from grpo_megatron.algorithm.off_policy import OffPolicyStats, icepop_weights, mis_weights, seq_tis_weights
from grpo_megatron.algorithm.policy_loss import grpo_policy_loss
from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.distributed.collectives import collective_device
from grpo_megatron.training.batching import LossInputs, Sample, collate
from grpo_megatron.training.config import DistillConfig
from grpo_megatron.training.forward_backward import LossFn, MicroBatch, forward_backward
from grpo_megatron.training.phases.advantages import UpdatePlan
from grpo_megatron.training.phases.logprob import PassSettings
from grpo_megatron.training.policy import Policy


class Reduction(Enum):
    """How a loss metric's per-micro-batch values become the iteration's value."""

    TOKEN_MEAN = "token_mean"
    """Each micro-batch reports a sum over its response tokens; the sums over micro-batches and
    data-parallel ranks are divided by the global token count."""
    MINIBATCH_MEAN = "minibatch_mean"
    """Each micro-batch reports its share of its mini-batch's value; summed over micro-batches and
    ranks, averaged over mini-batches."""
    MAX = "max"
    """The maximum over micro-batches and ranks."""
    MIN = "min"
    """The minimum over micro-batches and ranks."""
    TOKENS = "tokens"
    """The response-token count: TOKEN_MEAN's denominator, not logged."""


LOSS_METRICS: dict[str, Reduction] = {
    "loss/pg": Reduction.MINIBATCH_MEAN,  # logged as loss/policy
    "loss/kl": Reduction.MINIBATCH_MEAN,
    "loss/total": Reduction.MINIBATCH_MEAN,
    "clip_frac": Reduction.TOKEN_MEAN,
    "clip_frac/low": Reduction.TOKEN_MEAN,
    "clip_frac/high": Reduction.TOKEN_MEAN,
    "kl": Reduction.TOKEN_MEAN,
    "ppo_kl": Reduction.TOKEN_MEAN,
    "ratio/mean": Reduction.TOKEN_MEAN,
    "entropy": Reduction.TOKEN_MEAN,
    "mismatch/logprob_abs_diff": Reduction.TOKEN_MEAN,
    "mismatch/logprob_abs_diff_max": Reduction.MAX,
    "off_policy/ratio_mean": Reduction.TOKEN_MEAN,
    "off_policy/ratio_max": Reduction.MAX,
    "off_policy/ratio_min": Reduction.MIN,
    "off_policy/weight_mean": Reduction.TOKEN_MEAN,
    "off_policy/masked_frac": Reduction.TOKEN_MEAN,
    "distill/reverse_kl": Reduction.TOKEN_MEAN,
    "tokens": Reduction.TOKENS,
}
"""Every metric the GRPO loss function reports, with its reduction."""


@dataclass(frozen=True)
class GRPOLoss:
    """The settings of the GRPO loss for one iteration."""

    alg: AlgorithmConfig
    kl_beta: float
    """This iteration's KL coefficient (algorithm/kl.py:kl_beta)."""
    norm_len: int
    """Dr.GRPO's constant length (algorithm.loss_norm_len, else rollout.max_new_tokens)."""
    old_from_engine: bool
    """train.old_logprobs == "engine": pi_old is the rollout engine's logprobs."""
    distill: DistillConfig | None = None
    """On-policy distillation (``distill:``); None or ``coef: 0``: GRPO's advantages alone."""

    def __post_init__(self) -> None:
        # config/loop_rules.py:off_policy_errors refuses this for a job; here for any other caller.
        if self.old_from_engine and (
            self.alg.tis.enabled or self.alg.off_policy.correction not in ("none", "auto")
        ):
            raise ValueError(
                "an off-policy correction (algorithm.tis / algorithm.off_policy) with train.old_logprobs=engine "
                "counts the ratio twice: drop the correction or use train.old_logprobs=trainer"
            )

    def loss_fn(self, normalizer: float) -> LossFn:
        """The loss of one micro-batch (its share of the mini-batch's GRPO loss, ``normalizer`` being
        the mini-batch's global loss normaliser) and its ``LOSS_METRICS``."""
        alg = self.alg

        def loss_fn(
            logprobs_bs: torch.Tensor, entropy_bs: torch.Tensor | None, mb: MicroBatch
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            inputs = LossInputs.of(mb)
            mask_bs, rollout_bs = inputs.mask_bs, inputs.rollout_logprobs_bs
            # pi_old before any update of this iteration, on the trainer's side.
            trainer_old_bs = (
                inputs.old_logprobs_bs if inputs.old_logprobs_bs is not None else logprobs_bs.detach()
            )
            old_bs = rollout_bs if self.old_from_engine else inputs.old_logprobs_bs
            tis_bs = off_policy_weights(alg, trainer_old_bs, rollout_bs, mask_bs)
            token_advantages_bs, distill_metrics = self.distill_advantages(inputs, trainer_old_bs)
            loss, m = grpo_policy_loss(
                logprobs_bs,
                old_bs,
                inputs.advantages_b,
                mask_bs,
                alg,
                ref_logprobs_bt=inputs.ref_logprobs_bs,
                kl_beta=self.kl_beta,
                tis_weights_bt=tis_bs,
                normalizer=normalizer,
                norm_len=self.norm_len,
                token_advantages_bt=token_advantages_bs,
            )
            n_tokens = mask_bs.sum()
            out: dict[str, torch.Tensor] = {k: v * n_tokens for k, v in distill_metrics.items()}
            for key, value in m.items():
                kind = LOSS_METRICS.get(key)
                if kind is Reduction.MINIBATCH_MEAN:
                    out[key] = value
                elif kind is Reduction.TOKEN_MEAN:
                    out[key] = value * n_tokens  # a mean over this micro-batch's tokens -> their sum
            if entropy_bs is not None:
                out["entropy"] = (entropy_bs.detach() * mask_bs).sum()
            mismatch = mismatch_metrics(trainer_old_bs, rollout_bs, mask_bs)
            out["mismatch/logprob_abs_diff"] = mismatch.abs_diff_sum
            out["mismatch/logprob_abs_diff_max"] = mismatch.abs_diff_max
            off = OffPolicyStats.of(trainer_old_bs - rollout_bs, tis_bs, mask_bs)
            out["off_policy/ratio_mean"] = off.ratio_mean * n_tokens
            out["off_policy/ratio_max"] = off.ratio_max
            out["off_policy/ratio_min"] = off.ratio_min
            out["off_policy/weight_mean"] = off.weight_mean * n_tokens
            out["off_policy/masked_frac"] = off.masked_frac * n_tokens
            out["tokens"] = n_tokens
            return loss, out

        return loss_fn

    def distill_advantages(
        self, inputs: LossInputs, student_bs: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """With distillation, each token's advantage (algorithm/distill.py:mixed_advantages: the
        teacher's logprobs against ``student_bs``, pi_old on the trainer's side) and
        ``distill/reverse_kl`` as this micro-batch's token mean; without it (None, {})."""
        d = self.distill
        if d is None or not d.enabled:
            return None, {}
        mask_bs, teacher_bs = inputs.mask_bs, inputs.teacher_logprobs_bs
        if teacher_bs is None:
            if mask_bs.any():
                raise RuntimeError("distill.coef > 0 but the micro-batch has no teacher logprobs")
            teacher_bs = torch.zeros_like(mask_bs)  # a placeholder micro-batch: no token counts
        distill_bs = distill_advantages(teacher_bs, student_bs, mask_bs)
        advantages_bs = mixed_advantages(
            inputs.advantages_b, distill_bs, mask_bs, reward_coef=d.reward_coef, coef=d.coef
        )
        return advantages_bs, {"distill/reverse_kl": sampled_reverse_kl(teacher_bs, student_bs, mask_bs)}


def off_policy_weights(
    alg: AlgorithmConfig, trainer_old_bs: torch.Tensor, rollout_bs: torch.Tensor, mask_bs: torch.Tensor
) -> torch.Tensor | None:
    """The loss weights of the configured correction (algorithm.tis, algorithm.off_policy), from
    pi_old_trainer / pi_rollout per token; None = no correction (weights 1). ``alg`` is the section in
    effect (``JobConfig.algorithm_in_effect``); an unresolved ``auto`` weighs nothing, as it resolves
    outside FP8 rollout."""
    if alg.tis.enabled:
        return tis_weights(trainer_old_bs, rollout_bs, mask_bs, alg.tis.cap)[0]
    off = alg.off_policy
    log_ratio_bs = (trainer_old_bs.detach().float() - rollout_bs.detach().float()) * mask_bs
    geometric = off.sequence_ratio == "geometric"
    if off.correction == "seq_tis":
        return seq_tis_weights(log_ratio_bs, mask_bs, off.cap, geometric)
    if off.correction == "mis":
        return mis_weights(log_ratio_bs, mask_bs, off.low, off.high, geometric)
    if off.correction == "icepop":
        return icepop_weights(log_ratio_bs, mask_bs, off.low, off.high)
    return None


def reduce_metrics(
    per_microbatch: Sequence[dict[str, float]],
    kinds: dict[str, Reduction],
    ps: ParallelState,
    minibatches: int,
) -> dict[str, float]:
    """Reduce this rank's micro-batch metrics over micro-batches and data-parallel ranks, each by its
    declared ``kinds`` (``forward_backward``'s own "loss" is not one of them)."""
    keys = sorted({k for m in per_microbatch for k in m if k != "loss"})
    unknown = [k for k in keys if k not in kinds]
    if unknown:
        raise KeyError(f"loss metrics {unknown} have no declared Reduction")
    sums = [k for k in keys if kinds[k] not in (Reduction.MAX, Reduction.MIN)]
    maxes = [k for k in keys if kinds[k] in (Reduction.MAX, Reduction.MIN)]
    sign = {k: -1.0 if kinds[k] is Reduction.MIN else 1.0 for k in maxes}  # min = -max(-x)
    sum_t = torch.tensor([sum(m.get(k, 0.0) for m in per_microbatch) for k in sums], dtype=torch.float64)
    max_t = torch.tensor(
        [max((sign[k] * m[k] for m in per_microbatch if k in m), default=0.0) for k in maxes],
        dtype=torch.float64,
    )
    if ps.dp > 1:
        device = collective_device(ps.dp_group)
        sum_t, max_t = sum_t.to(device), max_t.to(device)
        dist.all_reduce(sum_t, group=ps.dp_group)
        dist.all_reduce(max_t, op=dist.ReduceOp.MAX, group=ps.dp_group)
    total = dict(zip(sums, sum_t.tolist(), strict=True))
    tokens = max(sum(v for k, v in total.items() if kinds[k] is Reduction.TOKENS), 1.0)
    out: dict[str, float] = {}
    for k, v in total.items():
        if kinds[k] is Reduction.TOKEN_MEAN:
            out[k] = v / tokens
        elif kinds[k] is Reduction.MINIBATCH_MEAN:
            out[k] = v / minibatches
    out |= {k: sign[k] * v for k, v in zip(maxes, max_t.tolist(), strict=True)}
    return out


def update_policy(
    policy: Policy,
    samples: list[Sample],
    plan: UpdatePlan,
    loss: GRPOLoss,
    settings: PassSettings,
    *,
    measure_routing: bool,
    stop: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Collective: one optimizer step per mini-batch; returns loss, clip, KL, entropy, mismatch,
    grad_norm and lr, and with ``measure_routing`` (no old-policy pass measured it) the iteration's
    routing metrics (training/route_replay.py). ``stop`` (collective: the same answer on every rank),
    asked before every mini-batch but the first, ends the update there: a signal's safe point (issue 51:
    the iteration then keeps the mini-batches it took; ``update/minibatches_skipped`` says how many it
    did not)."""
    ps = settings.ps
    routing, routes = settings.replay.begin(
        policy.model, "train", [samples[i] for r in plan.all_rows for i in r]
    )
    per_microbatch: list[dict[str, float]] = []
    steps: list[dict[str, float]] = []
    for rows, normalizer in zip(plan.rows, plan.normalizers, strict=True):
        if steps and stop is not None and stop():
            break
        policy.zero_grad()
        per_microbatch += forward_backward(
            policy.model,
            [collate(samples, r, settings.pad_id, routes, packed=plan.packed) for r in rows],
            ps,
            loss.loss_fn(normalizer),
            vocab_size=policy.spec.vocab_size,
            temperature=settings.temperature,
            with_entropy=True,
            routing=routing,
            truncation=settings.truncation,
        )
        steps.append(policy.step())
    metrics = reduce_metrics(per_microbatch, LOSS_METRICS, ps, len(steps)) | plan.metrics
    metrics["loss/policy"] = metrics.pop("loss/pg", 0.0)
    metrics["grad_norm"] = sum(s["grad_norm"] for s in steps) / len(steps)
    if "lr" in steps[-1]:
        metrics["lr"] = steps[-1]["lr"]
    if len(steps) < len(plan.rows):  # only on a stop: an uninterrupted run's rows never have it
        metrics["update/minibatches_skipped"] = float(len(plan.rows) - len(steps))
    done_rows = [r for minibatch in plan.rows[: len(steps)] for r in minibatch]
    return metrics | settings.replay.end(routing, samples, done_rows, measure=measure_routing)
