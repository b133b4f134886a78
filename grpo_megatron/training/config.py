"""Train section of the job config: iterations, batch sizes and the optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class TrainConfig:
    """One iteration = rollout of `prompts_per_iteration` prompts, then `updates_per_iteration` optimizer steps."""

    seed: int = 1234
    """Seed for weights initialisation, data order and sampling."""
    iterations: int = 100
    """Number of GRPO iterations (rollout + update) to run."""
    prompts_per_iteration: int = 32
    """Prompts sampled per iteration; each yields rollout.n_samples_per_prompt responses."""
    updates_per_iteration: int = 1
    """Optimizer steps per iteration: the rollout batch is split into this many mini-batches
    (1 = fully on-policy)."""
    micro_batch_size: int = 1
    """Sequences per forward/backward pass (ignored when max_tokens_per_micro_batch is set)."""
    max_tokens_per_micro_batch: int | None = None
    """Fill micro-batches to at most this many tokens (a longer sequence gets one of its own); None =
    micro_batch_size sequences. Packed, the tokens of a micro-batch are the sum of its sequence
    lengths (first-fit decreasing); padded, its rows times its longest sequence."""
    packing: bool = True
    """Pack the sequences of a micro-batch end to end into one sequence (megatron's PackedSeqParams:
    attention never crosses sequences, positions restart per sequence) instead of right-padding them
    to the longest: the same logprobs and gradients without the compute spent on padding
    (training/packing.py). false = right-padded rows."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_iterations: int = 0
    """Iterations of linear warm-up from 0 to lr."""
    lr_decay: Literal["constant", "cosine", "linear"] = "constant"
    """Schedule from lr to min_lr after warm-up, over the remaining iterations."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW denominator epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    old_logprobs: Literal["trainer", "engine"] = "trainer"
    """Where pi_old comes from. trainer = the policy before this iteration's updates (recomputed by a
    forward pass when updates_per_iteration > 1; with one update it equals the detached current
    logprobs, so no pass is needed). engine = the rollout engine's logprobs (only with one on-policy
    update; the ratio then also corrects the engine/trainer mismatch, as in slime's default). It
    is the importance ratio itself: algorithm.tis / algorithm.off_policy on top are refused (they
    would weigh each token r * w(r) instead of r; config/loop_rules.py:off_policy_errors)."""
    max_staleness: int = 0
    """How many weight versions a trained sample's policy may lag the policy being trained (needs
    engines that generate the next batches while the trainer trains: rollout.embedded_process=true,
    or rollout.engine=sglang, whose schedulers are processes of their own; colocated SGLang engines
    then keep their memory in every phase, rollout/placement.py). 0 =
    the synchronous loop, bit for bit; 1 = one step off (iteration k trains on responses sampled by the
    weights of iteration k-2's end, i.e. version k-2, while the engines sample iteration k+1's); N: N
    steps off. Correct for the lag with algorithm.off_policy (or algorithm.tis)."""
    offload_trainer: bool = False
    """Colocated rollout on GPUs: while the engines generate, the trainer's parameters, gradients and
    optimizer state live in pinned host memory (training/offload.py), and the engines release their
    memory while the trainer works. Off on CPU, where there is nothing to gain."""
    reference_on_cpu: bool = False
    """Keep the frozen reference model's weights in CPU memory and move them to the GPU only for the
    reference pass (saves a model's worth of GPU memory at the cost of two copies per iteration)."""
    eval_interval: int = 0
    """Evaluate on the held-out prompts every this many iterations (and before the first and after the
    last); 0 = only before the first and after the last. Needs held-out prompts (data.eval_path or a
    generator)."""
    eval_samples: int = 0
    """k of mean@k: responses sampled per held-out prompt at rollout.temperature (0 = greedy pass@1 only)."""
    rollout_samples_logged: int = 4
    """Sample rollouts shown in the console table and samples.jsonl per logged iteration."""

    def validate(self) -> None:
        errors = []
        for name in ("iterations", "prompts_per_iteration", "updates_per_iteration", "micro_batch_size"):
            value = getattr(self, name)
            if value < 1:
                errors.append(f"train.{name}={value} must be >= 1")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            errors.append(
                f"train.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 1, "
                "or null to batch by train.micro_batch_size"
            )
        if self.lr <= 0:
            errors.append(f"train.lr={self.lr} must be > 0 (1e-6 is usual for RL on pretrained models)")
        elif not 0 <= self.min_lr <= self.lr:
            errors.append(f"train.min_lr={self.min_lr} must be in [0, train.lr={self.lr}]")
        if not 0 <= self.lr_warmup_iterations <= self.iterations:
            errors.append(
                f"train.lr_warmup_iterations={self.lr_warmup_iterations} must be in "
                f"[0, train.iterations={self.iterations}]"
            )
        if self.weight_decay < 0:
            errors.append(f"train.weight_decay={self.weight_decay} must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                errors.append(f"train.{name}={value} must be in [0, 1)")
        if self.adam_eps <= 0:
            errors.append(f"train.adam_eps={self.adam_eps} must be > 0 (1e-8 is usual)")
        if self.grad_clip < 0:
            errors.append(f"train.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        if self.old_logprobs == "engine" and self.updates_per_iteration != 1:
            errors.append(
                f"train.old_logprobs=engine needs train.updates_per_iteration=1 (it is "
                f"{self.updates_per_iteration}): after the first update the engine no longer holds pi_old; "
                "use train.old_logprobs=trainer"
            )
        if self.max_staleness < 0:
            errors.append(f"train.max_staleness={self.max_staleness} must be >= 0 (0 = synchronous)")
        for name in ("eval_interval", "eval_samples", "rollout_samples_logged"):
            if getattr(self, name) < 0:
                errors.append(f"train.{name}={getattr(self, name)} must be >= 0")
        if errors:
            raise ValueError("\n".join(errors))


@dataclass
class SFTConfig:
    """Supervised cold start (`grpo-megatron sft`): next-token loss on the response tokens of
    prompt/response pairs, stopped at a dev-accuracy threshold (DeepSeek-R1's cold start)."""

    max_steps: int = 1000
    """Upper bound on optimizer steps."""
    batch_size: int = 64
    """Prompt/response pairs per optimizer step (over all data-parallel ranks)."""
    lr: float = 1e-3
    """Constant learning rate (AdamW with the train section's betas, eps and weight decay)."""
    eval_interval: int = 50
    """Measure greedy accuracy on the dev prompts every this many steps."""
    stop_accuracy: float | None = None
    """Stop as soon as dev accuracy reaches this (in [0, 1]) and export the weights of that step;
    None = run max_steps. A cold start for GRPO should stop well below saturation, so that RL has
    something to improve. Exclusive with target_accuracy_band, which lands more reliably."""
    target_accuracy_band: tuple[float, float] | None = None
    """[low, high] dev accuracy the exported weights should have (e.g. [0.2, 0.3]); None = off.
    Dev accuracy often jumps by tens of points between two evaluations, so crossing a threshold
    overshoots by a seed- and machine-dependent amount. With a band the cold start keeps a copy of
    the weights of the in-band evaluation closest to the band's centre, stops at the first
    evaluation at or above the centre, and exports the kept weights. When one interval jumps from
    below the band to above it, the steps since the last evaluation below the band are replayed
    (weights, Adam state and data order restored) with an evaluation after every step. When no
    evaluation lands in the band, the one closest to it is exported. The SFT log says which step
    was kept and why."""
    dev_prompts: int = 200
    """Held-out prompts used for the dev accuracy (taken from the evaluation set)."""
    output_dir: str | None = None
    """Where the final Hugging Face checkpoint (safetensors, config.json, tokenizer) is written;
    None = <logging.run_dir>/hf. Point model.hf_path of the GRPO job at it."""

    def validate(self) -> None:
        errors = []
        for name in ("max_steps", "batch_size", "eval_interval", "dev_prompts"):
            if getattr(self, name) < 1:
                errors.append(f"sft.{name}={getattr(self, name)} must be >= 1")
        if self.lr <= 0:
            errors.append(f"sft.lr={self.lr} must be > 0")
        if self.stop_accuracy is not None and not 0 < self.stop_accuracy <= 1:
            errors.append(
                f"sft.stop_accuracy={self.stop_accuracy} must be in (0, 1], or null to run max_steps"
            )
        band = self.target_accuracy_band
        if band is not None:
            if len(band) != 2 or not 0 <= band[0] < band[1] <= 1:
                errors.append(
                    f"sft.target_accuracy_band={list(band)} must be [low, high] with 0 <= low < high <= 1 "
                    "(e.g. [0.2, 0.3]), or null"
                )
            if self.stop_accuracy is not None:
                errors.append(
                    f"sft.stop_accuracy={self.stop_accuracy} and sft.target_accuracy_band={list(band)} are "
                    "exclusive: set one of them to null"
                )
        if errors:
            raise ValueError("\n".join(errors))
