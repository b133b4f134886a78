"""Typed config of the GRPO algorithm (the `algorithm:` section of a job YAML).

Defaults are DeepSeekMath GRPO (Shao et al. 2024): std-normalized group advantages,
symmetric clip 0.2, per-sequence mean of per-token means, k3 KL to the reference with
beta 0.04. Every later fix the field adopted (Dr.GRPO, DAPO, GSPO, RLOO, TIS) is a named
switch that is OFF by default. This module imports nothing heavy (no torch): the CLI
loads configs without torch.
"""

from dataclasses import dataclass, field
from typing import Literal

AdvantageEstimator = Literal["grpo", "rloo"]
RatioLevel = Literal["token", "sequence"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
BetaSchedule = Literal["constant", "cosine"]
RoutingReplay = Literal["off", "r2", "r3"]
OffPolicyCorrection = Literal["auto", "none", "seq_tis", "mis", "icepop"]


@dataclass
class KLConfig:
    """KL penalty to the frozen reference policy, added to the loss (GRPO eq. 3)."""

    beta: float = 0.04
    """KL coefficient (the schedule's start value). 0 disables the penalty AND the reference
    model: no reference forward pass is run at all."""
    estimator: KLEstimator = "k3"
    """Schulman's estimators of KL(pi || pi_ref) from samples of pi: k1 = -log r,
    k2 = (log r)^2 / 2, k3 = r - 1 - log r (unbiased, non-negative, low variance),
    with r = pi_ref / pi."""
    clamp: float = 10.0
    """log(pi_ref / pi) is clamped to [-clamp, clamp] before the estimator and the per-token
    estimate after it, so that one token the reference finds very unlikely cannot blow up
    k3 = exp(x) - 1 - x."""
    schedule: BetaSchedule = "constant"
    """`constant`: beta throughout. `cosine`: linear warm-up 0 -> beta over
    `warmup_fraction` of the run, then cosine decay beta -> beta_end."""
    beta_end: float = 0.0
    """Final beta of the cosine schedule (ignored by `constant`)."""
    warmup_fraction: float = 0.0
    """Fraction of training iterations spent in the linear warm-up of the cosine schedule."""

    def validate(self, prefix: str = "algorithm.kl") -> None:
        if self.beta < 0:
            raise ValueError(f"{prefix}.beta={self.beta} must be >= 0: use 0 to disable the KL penalty")
        if self.beta_end < 0:
            raise ValueError(f"{prefix}.beta_end={self.beta_end} must be >= 0")
        if self.clamp <= 0:
            raise ValueError(
                f"{prefix}.clamp={self.clamp} must be > 0: 10 is a safe value for fp32/bf16 logprobs"
            )
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(
                f"{prefix}.warmup_fraction={self.warmup_fraction} must be in [0, 1): "
                "it is the fraction of iterations spent warming beta up"
            )
        if self.schedule == "cosine" and self.beta == 0 and self.beta_end > 0:
            raise ValueError(
                f"{prefix}.beta=0 with {prefix}.schedule=cosine and {prefix}.beta_end={self.beta_end}: "
                "beta=0 disables the reference model; set beta to the start value of the schedule"
            )

    @property
    def enabled(self) -> bool:
        """Whether the reference model is needed at all."""
        return self.beta > 0 or (self.schedule == "cosine" and self.beta_end > 0)


@dataclass
class TISConfig:
    """Truncated importance sampling against the rollout engine's logprobs (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training")."""

    enabled: bool = False
    """Multiply each token's loss by min(pi_old_trainer / pi_rollout, cap) (needs rollout logprobs)."""
    cap: float = 2.0
    """Truncation C of the importance weight; the paper used C = 2."""

    def validate(self, prefix: str = "algorithm.tis") -> None:
        if self.cap < 1.0:
            raise ValueError(
                f"{prefix}.cap={self.cap} must be >= 1: a cap below 1 down-weights even on-policy tokens"
            )


@dataclass
class OffPolicyConfig:
    """Correction for responses sampled by another policy than the trainer's pi_old (the engine's
    kernels, and with train.max_staleness > 0 older weights): algorithm/off_policy.py. Its
    `off_policy/*` metrics (ratio mean/max/min, weight mean, masked fraction) are logged every
    iteration whatever the choice."""

    correction: OffPolicyCorrection = "auto"
    """`auto`: `icepop` when the engines serve FP8 weights (rollout.weight_dtype=fp8: a trainer/engine
    gap by design, which the peers correct) unless algorithm.tis already weighs the loss or
    train.old_logprobs=engine (whose ratio already is the importance ratio); `none` otherwise
    (config/loop_rules.py:off_policy_in_effect; `grpo-megatron check` prints the outcome). `none`:
    no correction (set it explicitly to train FP8 rollouts uncorrected). `seq_tis`: every token of a
    response weighted min(rho, cap), rho its sequence ratio. `mis`: responses whose rho leaves [low,
    high] dropped, the others weighted rho. `icepop`: tokens whose ratio leaves [low, high] dropped,
    the others weighted by it. (Token-level TIS is algorithm.tis.)"""
    cap: float = 2.0
    """C of `seq_tis`."""
    low: float = 0.5
    """Lower end of the band of `mis` and `icepop` (IcePop used 0.5)."""
    high: float = 2.0
    """Upper end of the band of `mis` and `icepop` (IcePop used 5)."""
    sequence_ratio: Literal["product", "geometric"] = "product"
    """How `seq_tis` and `mis` make rho of the token ratios: their product (the response's
    importance ratio) or their geometric mean (length-normalised)."""

    def validate(self, prefix: str = "algorithm.off_policy") -> None:
        if self.cap < 1.0:
            raise ValueError(
                f"{prefix}.cap={self.cap} must be >= 1: a cap below 1 down-weights on-policy responses"
            )
        if not 0.0 < self.low < 1.0 < self.high:
            raise ValueError(
                f"{prefix}.low={self.low} and {prefix}.high={self.high} must satisfy 0 < low < 1 < high: "
                "the band must keep on-policy samples (ratio 1), e.g. low=0.5 high=2"
            )


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage, no
    gradient) and refill the batch from further prompts."""

    enabled: bool = False
    """Drop zero-variance groups and sample more prompts to refill the batch."""
    max_tries: int = 3
    """Most rollout rounds per iteration (the first included); after that the batch is used
    as it is, possibly smaller than requested (counted in metrics)."""
    std_threshold: float = 0.0
    """A group is dropped when the std of its rewards is <= this."""

    def validate(self, prefix: str = "algorithm.dynamic_sampling") -> None:
        if self.max_tries < 1:
            raise ValueError(f"{prefix}.max_tries={self.max_tries} must be >= 1")
        if self.std_threshold < 0:
            raise ValueError(f"{prefix}.std_threshold={self.std_threshold} must be >= 0")


@dataclass
class OverlongConfig:
    """DAPO soft overlong punishment: a length penalty that ramps linearly from 0 to
    -penalty over the last `buffer_len` tokens before the maximum response length."""

    enabled: bool = False
    """Add the soft overlong penalty to each response's reward."""
    buffer_len: int = 4096
    """L_cache: width of the ramp in tokens (DAPO used 4096 of a 20480 maximum)."""
    penalty: float = 1.0
    """Penalty at (and beyond) the maximum length."""
    max_len: int | None = None
    """L_max; None = the rollout's maximum number of new tokens."""

    def validate(self, prefix: str = "algorithm.overlong") -> None:
        if self.buffer_len < 1:
            raise ValueError(f"{prefix}.buffer_len={self.buffer_len} must be >= 1")
        if self.penalty < 0:
            raise ValueError(f"{prefix}.penalty={self.penalty} must be >= 0 (it is subtracted)")
        if self.max_len is not None and self.max_len <= self.buffer_len:
            raise ValueError(
                f"{prefix}.max_len={self.max_len} must be > {prefix}.buffer_len={self.buffer_len}: "
                "shrink the buffer or leave max_len unset to use the rollout's max_new_tokens"
            )


@dataclass
class AlgorithmConfig:
    """GRPO objective. See grpo_megatron/algorithm/*.py for the formulas."""

    advantage_estimator: AdvantageEstimator = "grpo"
    """`grpo`: baseline = group mean (DeepSeekMath). `rloo`: baseline = mean of the other
    G-1 rewards of the group (Ahmadian et al. 2024, RLOO)."""
    norm_adv_by_std: bool = True
    """Divide advantages by the group's reward std (DeepSeekMath). False = Dr.GRPO."""
    adv_eps: float = 1e-6
    """Added to the std before dividing, so near-constant groups stay finite."""
    clip_low: float = 0.2
    """epsilon_low: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """epsilon_high: the ratio is clipped above at 1 + clip_high. DAPO's clip-higher: 0.28."""
    dual_clip: float | None = None
    """Dual clip c > 1 (Ye et al. 2020): for negative advantages the loss is at most
    -c * A. None disables it."""
    ratio_level: RatioLevel = "token"
    """`token`: per-token ratio (PPO/GRPO). `sequence`: GSPO's length-normalized sequence
    ratio (use clip ranges of order 3e-4 / 4e-4 as GSPO does)."""
    loss_agg_mode: LossAggMode = "seq-mean-token-mean"
    """`seq-mean-token-mean`: mean over sequences of the per-sequence token mean (GRPO paper).
    `token-mean`: mean over all tokens of the batch (DAPO). `seq-mean-token-sum-norm`:
    per-sequence token sum divided by a constant, averaged over sequences (Dr.GRPO)."""
    loss_norm_len: int | None = None
    """The constant of `seq-mean-token-sum-norm`; None = the rollout's max_new_tokens."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL penalty to the reference policy."""
    tis: TISConfig = field(default_factory=TISConfig)
    """Truncated importance sampling against the rollout engine's logprobs."""
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    """Sequence-level TIS, masked importance sampling or IcePop (algorithm/off_policy.py)."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO dynamic sampling."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO soft overlong punishment."""
    routing_replay: RoutingReplay = "off"
    """MoE routing replay (models/routing.py): which experts the trainer's passes route tokens to.
    `off`: each pass routes by itself (an engine and a trainer near a tie pick different experts,
    which changes the policy ratio). `r2`: the old-policy pass routes by itself and records its
    experts; the training passes replay them, so the ratio compares pi_theta and pi_old under one
    routing (needs train.updates_per_iteration > 1 and train.old_logprobs=trainer: with one update the
    training pass is the old-policy pass). `r3` (rollout routing replay): the rollout engine's experts
    of every token (Completion.routed_experts) are replayed in the reference, old-policy and training
    passes, so the trainer computes logprobs under the routing that sampled the tokens. Every mode
    logs the expert load; r3 also `routing/disagreement` (trainer vs engine, before replay: the
    engine's routes reach the trainer only when r3 replays them). MoE models
    only; not with parallel.cp > 1. With model.recompute=full the recomputed forward replays the
    experts its forward used (models/routing.py)."""

    def validate(self) -> None:
        p = "algorithm"
        if self.adv_eps <= 0:
            raise ValueError(
                f"{p}.adv_eps={self.adv_eps} must be > 0: it keeps all-equal groups from dividing by 0"
            )
        if not 0.0 < self.clip_low < 1.0:
            raise ValueError(
                f"{p}.clip_low={self.clip_low} must be in (0, 1): the ratio is clipped below at 1 - clip_low"
            )
        if self.clip_high <= 0:
            raise ValueError(f"{p}.clip_high={self.clip_high} must be > 0")
        if self.clip_high < self.clip_low:
            raise ValueError(
                f"{p}.clip_high={self.clip_high} must be >= {p}.clip_low={self.clip_low}: "
                "clip-higher (DAPO) widens the upper range only; set clip_high >= clip_low"
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(
                f"{p}.dual_clip={self.dual_clip} must be > 1 (typically 3) or null to disable it"
            )
        if self.loss_norm_len is not None and self.loss_norm_len < 1:
            raise ValueError(f"{p}.loss_norm_len={self.loss_norm_len} must be >= 1 or null")
        self.kl.validate(f"{p}.kl")
        self.tis.validate(f"{p}.tis")
        self.off_policy.validate(f"{p}.off_policy")
        if self.tis.enabled and self.off_policy.correction not in ("none", "auto"):
            raise ValueError(
                f"{p}.tis.enabled=true and {p}.off_policy.correction={self.off_policy.correction} both weight "
                f"the loss: choose one (set {p}.tis.enabled=false or {p}.off_policy.correction=none)"
            )
        self.dynamic_sampling.validate(f"{p}.dynamic_sampling")
        self.overlong.validate(f"{p}.overlong")
