"""The trainable policy: the megatron model wrapped in megatron's DDP, and its optimizer.

The reference model is built by the same ``build_gpt_model`` without DDP or optimizer (frozen).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from grpo_megatron.distributed.bootstrap import ParallelState
from grpo_megatron.models.builder import PolicySpec, build_gpt_model

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

    from grpo_megatron.config import JobConfig


@dataclass
class Policy:
    model: torch.nn.Module  # megatron DistributedDataParallel around GPTModel
    optimizer: MegatronOptimizer
    spec: PolicySpec

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> dict[str, float]:
        """One optimizer step over the accumulated gradients; returns grad norm and success."""
        ok, grad_norm, _ = self.optimizer.step()
        return {
            "grad_norm": float(grad_norm if grad_norm is not None else float("nan")),
            "update_ok": float(ok),
        }


def build_policy(hf: Mapping[str, Any], cfg: JobConfig, ps: ParallelState) -> Policy:
    """This rank's shard of the policy, with DDP gradient buffers and a (distributed) Adam."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    gpt, spec = build_gpt_model(hf, cfg.model, ps)
    tcfg = spec.transformer_config
    use_dist_opt = cfg.parallel.use_distributed_optimizer
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
    tcfg.finalize_model_grads_func = lambda chunks, num_tokens=None, **kw: finalize_model_grads(
        chunks, num_tokens=None, pg_collection=ps.pg_collection
    )
    tcfg.no_sync_func = ddp.no_sync
    train = cfg.train
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
    return Policy(model=ddp, optimizer=optimizer, spec=spec)
