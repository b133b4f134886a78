"""The trainable policy: the megatron model wrapped in megatron's DDP, its optimizer and LR schedule.

The reference model is built by the same ``build_gpt_model`` without DDP or optimizer (frozen); with
``model.lora`` it is the policy itself with its adapters off (``Policy.reference``), and only the
adapters train (models/lora.py: the base weights get no gradient buffer and no optimizer state).

Learning-rate schedule: megatron's ``OptimizerParamScheduler``, one scheduler step per optimizer
step. ``train.lr_warmup_iterations`` and ``train.iterations`` count GRPO iterations, each of
``train.updates_per_iteration`` optimizer steps, so the scheduler counts in those steps. The
scheduler advances *before* each optimizer step, so step n uses ``lr(n)`` (n = 1, 2, ...): with
warm-up the first step already learns (megatron's own loop steps after, wasting step 0 at lr 0),
and the last step of the decay uses ``min_lr``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.models.builder import PolicySpec, build_gpt_model

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from grpo_megatron.distributed.config import ParallelConfig
    from grpo_megatron.models.config import ModelConfig
    from grpo_megatron.training.config import TrainConfig


@dataclass
class Policy:
    model: DistributedDataParallel  # megatron's, around GPTModel
    optimizer: MegatronOptimizer
    spec: PolicySpec
    scheduler: OptimizerParamScheduler | None = None
    """LR / weight-decay schedule (``build_policy`` always sets one); None = the optimizer's own lr."""
    lora: bool = False
    """Only LoRA adapters train (``model.lora``); the frozen base is the reference model."""

    def reference(self) -> AbstractContextManager[None]:
        """Inside the block the model computes as the reference: with LoRA, the base (adapters off);
        otherwise it is the policy, and the caller has a reference model of its own."""
        if not self.lora:
            raise RuntimeError(
                "a full-parameter policy is not its own reference: build one (training/job.py)"
            )
        from grpo_megatron.models.lora import adapters_disabled

        return adapters_disabled(self.model)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    @property
    def lr(self) -> float:
        """Learning rate the next (or current) optimizer step uses."""
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self) -> dict[str, float]:
        """One scheduler step, then one optimizer step over the accumulated gradients; returns the
        learning rate used, the grad norm and success."""
        if self.scheduler is not None:
            self.scheduler.step(1)
        lr = self.lr
        ok, grad_norm, _ = self.optimizer.step()
        return {
            "lr": lr,
            "grad_norm": float(grad_norm if grad_norm is not None else float("nan")),
            "update_ok": float(ok),
        }


def build_policy(
    hf: Mapping[str, Any],
    model: ModelConfig,
    parallel: ParallelConfig,
    train: TrainConfig,
    ps: ParallelState,
    *,
    key_length: int | None = None,
) -> Policy:
    """This rank's shard of the policy, with DDP gradient buffers and a (distributed) Adam
    (``parallel.use_distributed_optimizer``) at ``train``'s optimizer settings and LR schedule.
    ``key_length``: batch-invariant attention (``rollout.true_on_policy``, models/batch_invariant.py)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    gpt, spec = build_gpt_model(hf, model, ps, key_length=key_length)
    tcfg = spec.transformer_config
    if model.lora.enabled:
        from grpo_megatron.models.lora import add_lora

        add_lora(gpt, model.lora, train.seed, gated=bool(tcfg.gated_linear_unit))
    use_dist_opt = parallel.use_distributed_optimizer
    ddp = DistributedDataParallel(
        config=tcfg,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=use_dist_opt,
        ),
        module=gpt,
        pg_collection=ps.pg_collection,
    )
    # The schedule calls these; without finalize_model_grads no DP/TP gradient reduction happens.
    # num_tokens is dropped on purpose: our loss carries its own global normaliser.
    tcfg.finalize_model_grads_func = lambda chunks, num_tokens=None, **kw: _finalize_grads(
        chunks, ps, model.lora.enabled
    )
    tcfg.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=train.lr,
            min_lr=train.min_lr,
            weight_decay=train.weight_decay,
            adam_beta1=train.adam_beta1,
            adam_beta2=train.adam_beta2,
            adam_eps=train.adam_eps,
            clip_grad=train.grad_clip,
            bf16=tcfg.bf16,
            fp16=tcfg.fp16,
            params_dtype=tcfg.params_dtype,
            use_distributed_optimizer=use_dist_opt,
        ),
        [ddp],
        # Explicit groups; megatron's extra gloo groups (for CPU-side optimizer state
        # checkpointing) only exist through its global state, so they are off here.
        use_gloo_process_groups=False,
        pg_collection=ps.pg_collection,
    )
    return Policy(
        model=ddp,
        optimizer=optimizer,
        spec=spec,
        scheduler=build_scheduler(optimizer, train),
        lora=model.lora.enabled,
    )


def _finalize_grads(chunks: list[Any], ps: ParallelState, lora: bool) -> None:
    """megatron's gradient reduction (DP, sequence-parallel norms, embeddings); with LoRA, the adapters'
    partial gradients are all-reduced first (models/lora.py:reduce_partial_grads)."""
    from megatron.core.distributed import finalize_model_grads

    if lora:
        from grpo_megatron.models.lora import reduce_partial_grads

        for chunk in chunks:
            reduce_partial_grads(chunk)
    finalize_model_grads(chunks, num_tokens=None, pg_collection=ps.pg_collection)


def scheduler_steps(train: TrainConfig) -> tuple[int, int]:
    """(warm-up steps, decay-end step) in optimizer steps for ``train``'s iteration counts."""
    per_iteration = train.updates_per_iteration
    warmup = train.lr_warmup_iterations * per_iteration
    # megatron requires warm-up < decay end; warm-up over the whole run decays over nothing.
    return warmup, max(train.iterations * per_iteration, warmup + 1)


def build_scheduler(optimizer: MegatronOptimizer, train: TrainConfig) -> OptimizerParamScheduler:
    """megatron's LR / weight-decay scheduler for ``train`` (constant weight decay).

    On resume the config's values win over the checkpoint's (``override_opt_param_scheduler``):
    only the step count is restored, so a resumed run may extend ``train.iterations`` or change
    ``train.lr``.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup, decay_end = scheduler_steps(train)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else train.lr,
        max_lr=train.lr,
        min_lr=train.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_end,
        lr_decay_style=train.lr_decay,
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=decay_end,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
