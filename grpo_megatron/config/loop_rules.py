"""The rules of the loop's arrangements, across sections: the asynchronous loop (``train.max_staleness``,
``rollout.embedded_process``), partial rollouts (``rollout.partial``) and the off-policy corrections on
top of ``train.old_logprobs=engine``; ``config/validation.py:validate`` runs them once every section
passed its own rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_megatron.algorithm.config import OffPolicyCorrection
    from grpo_megatron.config.job import JobConfig

FP8_ROLLOUT_CORRECTION: OffPolicyCorrection = "icepop"
"""What ``algorithm.off_policy.correction=auto`` takes with FP8 rollout (``rollout.weight_dtype=fp8``):
IcePop (token level, the section's band [low, high]) drops the tokens whose trainer/engine ratio the
quantization pushed out of the band and weighs the others by their ratio; the peers that serve FP8
with bf16 training correct the gap likewise (slime and miles: TIS / IcePop; verl: TIS)."""


def async_errors(cfg: JobConfig) -> list[str]:
    """The asynchronous loop (train.max_staleness, rollout.embedded_process) and what it cannot run with."""
    if cfg.rollout.partial.enabled:
        return partial_rollout_errors(cfg)
    errors = []
    if cfg.train.max_staleness > 0 and not (cfg.rollout.embedded_process or cfg.rollout.engine == "sglang"):
        errors.append(
            f"train.max_staleness={cfg.train.max_staleness} needs engines that generate while the trainer "
            "trains: set rollout.embedded_process=true, or use rollout.engine=sglang (or train.max_staleness=0)"
        )
    if not cfg.producer_loop:
        return errors
    why = (
        "rollout.embedded_process=true"
        if cfg.rollout.embedded_process
        else f"train.max_staleness={cfg.train.max_staleness}"
    )
    if cfg.algorithm.dynamic_sampling.enabled:
        errors.append(
            f"{why} with algorithm.dynamic_sampling.enabled=true: the asynchronous producer submits one "
            "round per iteration ahead of time; disable dynamic sampling"
        )
    if cfg.train.offload_trainer:
        errors.append(
            f"{why} with train.offload_trainer=true: the engines generate while the trainer trains, so "
            "both stay on the device; set train.offload_trainer=false"
        )
    if cfg.rollout.multiturn.enabled:
        errors.append(
            f"{why} with rollout.multiturn.enabled=true: the asynchronous producer submits single-turn "
            "batches ahead of time, episodes are not run there yet; set train.max_staleness=0 and "
            "rollout.embedded_process=false for multi-turn training"
        )
    return errors


def partial_rollout_errors(cfg: JobConfig) -> list[str]:
    """rollout.partial (training/partial.py) and what it cannot run with."""
    r, t, errors = cfg.rollout, cfg.train, []
    k, partial = r.partial.segment_tokens, r.partial
    if (t.max_staleness + 1) * k < r.max_new_tokens:
        need = -(-r.max_new_tokens // k) - 1
        errors.append(
            f"rollout.partial.enabled=true with train.max_staleness={t.max_staleness} and "
            f"rollout.partial.segment_tokens={k}: a response of rollout.max_new_tokens={r.max_new_tokens} tokens "
            f"needs up to {need + 1} segments and only one is sure to run per iteration, so its first token "
            f"could lag more than max_staleness before it ends; set train.max_staleness>={need} or "
            f"rollout.partial.segment_tokens>={-(-r.max_new_tokens // (t.max_staleness + 1))}"
        )
    if partial.overlap:
        errors += partial_overlap_errors(cfg)
    if partial.keep_kv and r.engine != "sglang":
        errors.append(
            f"rollout.partial.keep_kv=true with rollout.engine={r.engine}: only an SGLang engine "
            "keeps its prefix cache across a weight update (the embedded engine keeps no KV "
            "between requests); use rollout.engine=sglang or set rollout.partial.keep_kv=false"
        )
    if partial.keep_kv and r.engine == "sglang" and r.sglang.mode == "colocated" and not partial.overlap:
        errors.append(
            "rollout.partial.keep_kv=true with colocated SGLang engines and rollout.partial.overlap=false: "
            "the engines release their KV cache for every train phase and SGLang flushes its prefix "
            "cache on each release, so nothing would be kept (issue 51 item 4); set "
            "rollout.partial.overlap=true (the engines then keep their memory through the train phase) "
            "or rollout.partial.keep_kv=false"
        )
    if partial.groups_in_flight and partial.groups_in_flight < t.prompts_per_iteration:
        errors.append(
            f"rollout.partial.groups_in_flight={partial.groups_in_flight} is below train.prompts_per_iteration="
            f"{t.prompts_per_iteration}: an iteration could never take its groups; raise it (0 = twice as many)"
        )
    refused = {  # setting: (whether it is on, why the mode cannot run with it)
        "algorithm.dynamic_sampling.enabled=true": (
            cfg.algorithm.dynamic_sampling.enabled,
            "a DAPO round would draw prompts outside the pool",
        ),
        "rollout.multiturn.enabled=true": (
            r.multiturn.enabled,
            "episodes are generated turn by turn, not in segments",
        ),
        "algorithm.routing_replay=r3": (
            cfg.algorithm.routing_replay == "r3",
            "a continued response's earlier tokens are re-routed by newer weights",
        ),
    }
    for name, (on, why) in refused.items():
        if on:
            errors.append(
                f"rollout.partial.enabled=true with {name}: {why}; set rollout.partial.enabled=false "
                f"or turn {name.split('=')[0]} off"
            )
    return errors


def partial_overlap_errors(cfg: JobConfig) -> list[str]:
    """rollout.partial.overlap: a segment round in flight while the trainer trains (training/partial.py)."""
    r, t, errors = cfg.rollout, cfg.train, []
    k = r.partial.segment_tokens
    if not (r.embedded_process or r.engine == "sglang"):
        errors.append(
            "rollout.partial.overlap=true needs engines that generate while the trainer trains: "
            "set rollout.embedded_process=true, or use rollout.engine=sglang (or "
            "rollout.partial.overlap=false)"
        )
    if t.max_staleness * k < r.max_new_tokens:
        errors.append(
            f"rollout.partial.overlap=true with train.max_staleness={t.max_staleness} and "
            f"rollout.partial.segment_tokens={k}: the round generated while the "
            "trainer trains lags one version when taken, so a response of rollout.max_new_tokens="
            f"{r.max_new_tokens} tokens could lag more than max_staleness before it ends; set "
            f"train.max_staleness>={max(1, -(-r.max_new_tokens // k))} or "
            f"rollout.partial.segment_tokens>={-(-r.max_new_tokens // max(t.max_staleness, 1))}"
        )
    if t.offload_trainer:
        errors.append(
            "rollout.partial.overlap=true with train.offload_trainer=true: the engines generate "
            "while the trainer trains, so both stay on the device; set train.offload_trainer=false"
        )
    return errors


def off_policy_errors(cfg: JobConfig) -> list[str]:
    """train.old_logprobs=engine makes the surrogate's ratio pi_theta / pi_rollout, which already is
    the importance ratio of the rollout policy; a correction built from the same ratio on top
    (algorithm.tis, algorithm.off_policy) would weigh each token's gradient r * w(r) instead of r.
    By the corrections' own definition (pi_old / pi_rollout) their weight is 1 there, so the
    combination is refused rather than silently ignored (verl refuses it as double counting)."""
    if cfg.train.old_logprobs != "engine":
        return []
    alg = cfg.algorithm
    on = "algorithm.tis.enabled=true" if alg.tis.enabled else None
    if alg.off_policy.correction not in ("none", "auto"):  # auto takes none here (off_policy_in_effect)
        on = f"algorithm.off_policy.correction={alg.off_policy.correction}"
    if on is None:
        return []
    return [
        f"{on} with train.old_logprobs=engine corrects the off-policy ratio twice: with the engine's "
        "logprobs as pi_old the clipped ratio pi_theta/pi_rollout already is the importance ratio, and "
        "the correction's weight (pi_old/pi_rollout) is 1 by its definition. Either drop the correction "
        "(algorithm.tis.enabled=false, algorithm.off_policy.correction=none) or keep it with "
        "train.old_logprobs=trainer"
    ]


def off_policy_in_effect(cfg: JobConfig) -> OffPolicyCorrection:
    """``algorithm.off_policy.correction`` as the run applies it: ``auto`` takes ``FP8_ROLLOUT_CORRECTION``
    when the engines serve FP8 weights, no token-level TIS weighs the loss already, and pi_old is the
    trainer's (with ``train.old_logprobs=engine`` the ratio already is the importance ratio:
    ``off_policy_errors``); else ``none``. Any other value is the user's, refusals (``none``) included."""
    alg = cfg.algorithm
    if alg.off_policy.correction != "auto":
        return alg.off_policy.correction
    fp8 = cfg.rollout.weight_dtype == "fp8"
    return (
        FP8_ROLLOUT_CORRECTION
        if fp8 and not alg.tis.enabled and cfg.train.old_logprobs != "engine"
        else "none"
    )
