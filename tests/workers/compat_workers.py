"""Multi-process workers for tests/test_megatron_compat.py: a tiny megatron-core MoE GPTModel trained
one optimizer step at several parallel layouts on CPU (gloo, fp32).

Shapes: b = micro-batch size, s = sequence length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from tests.helpers.dist import init_gloo

SEED = 1234
VOCAB = 128
SEQ = 16
MICRO_BATCH = 2
NUM_MICROBATCHES = 2


@dataclass(frozen=True)
class Layout:
    """One parallel layout to train at."""

    name: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel size; None = same as tp (megatron's default)
    dispatcher: str = "alltoall"  # moe_token_dispatcher_type
    distributed_optimizer: bool = False
    tied_embeddings: bool = False  # share_embeddings_and_output_weights (PP: embedding group sync)


LAYOUTS = {
    "tp2_sp": Layout("tp2_sp", tp=2),
    "ep2_alltoall": Layout("ep2_alltoall", ep=2, dispatcher="alltoall"),
    "ep2_allgather": Layout("ep2_allgather", ep=2, dispatcher="allgather"),
    "pp2": Layout("pp2", pp=2, tied_embeddings=True),
    "dp2_distopt": Layout("dp2_distopt", distributed_optimizer=True),
    "tp2_etp1_ep2": Layout("tp2_etp1_ep2", tp=2, ep=2, etp=1),
    "tp2_ep2": Layout("tp2_ep2", tp=2, ep=2),
    "tp2_etp2": Layout("tp2_etp2", tp=2, etp=2),
}


def _config(layout: Layout) -> Any:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_token_dispatcher_type=layout.dispatcher,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp if layout.etp is not None else layout.tp,
        sequence_parallel=layout.tp > 1,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        add_bias_linear=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )


def _batch(step: int) -> dict[str, torch.Tensor]:
    """Same data on every rank (each DP rank sees the same batch: fine for a smoke test)."""
    g = torch.Generator().manual_seed(step)
    tokens_bs = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
    return {
        "tokens": tokens_bs,
        "labels": torch.roll(tokens_bs, -1, dims=1),
        "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ),
        "loss_mask": torch.ones(MICRO_BATCH, SEQ),
    }


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    losses_bs = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(loss_mask_bs, losses_bs):
        loss = (losses_bs.float() * loss_mask_bs).sum() / loss_mask_bs.sum()
        return loss, {"loss": loss.detach().clone()}

    return losses_bs, partial(loss_func, batch["loss_mask"])


def _rng_draws() -> dict[str, torch.Tensor]:
    """One draw from each named stream of megatron's RNG tracker (they must differ per rank as
    megatron seeds them), and a check that forking leaves the default stream where it was."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.tensor_parallel.random import (
        get_data_parallel_rng_tracker_name,
        get_expert_parallel_rng_tracker_name,
    )

    tracker = get_cuda_rng_tracker()
    before = torch.get_rng_state()
    draws = {}
    for key, name in (
        ("rand_tp", "model-parallel-rng"),
        ("rand_dp", get_data_parallel_rng_tracker_name()),
        ("rand_ep", get_expert_parallel_rng_tracker_name()),
    ):
        with tracker.fork(name):
            draws[key] = torch.rand(4)
    draws["fork_restores_default"] = bool(torch.equal(before, torch.get_rng_state()))
    return draws


def train_one_layout(layout: Layout) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from grpo_megatron.distributed import megatron_compat

    config = _config(layout)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=config.expert_tensor_parallel_size,
    )
    try:
        megatron_compat.cpu_model_parallel_seed(SEED)
        rng_draws = _rng_draws()
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            position_embedding_type="rope",
            share_embeddings_and_output_weights=layout.tied_embeddings,
        )
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=layout.distributed_optimizer,
        )
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        # What a training loop sets: the schedule then all-reduces data-parallel grads, sums the
        # sequence-parallel norm grads over TP and syncs tied embeddings across stages.
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = model.no_sync
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=1e-3,
                clip_grad=1.0,
                use_distributed_optimizer=layout.distributed_optimizer,
                bf16=False,
                fp16=False,
                params_dtype=torch.float32,
            ),
            [model],
        )
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter([_batch(i) for i in range(NUM_MICROBATCHES)]),
            model=[model],
            num_microbatches=NUM_MICROBATCHES,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        update_ok, grad_norm, _ = optimizer.step()
        loss = float(torch.stack([d["loss"] for d in losses]).mean()) if losses else math.nan
        direct_loss = math.nan
        if layout.pp == 1:
            # Outside the schedule too (as logprob code may call the model): one plain forward.
            with torch.no_grad():
                batch = _batch(0)
                direct_loss = float(
                    model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
                )
        return {
            **rng_draws,
            "direct_loss": direct_loss,
            "loss": loss,
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "update_ok": bool(update_ok),
            "last_stage": ps.is_pipeline_last_stage(),
        }
    finally:
        ps.destroy_model_parallel()


def train_layouts(names: list[str], check_collectives: bool = False) -> dict[str, Any]:
    """Train one step at each named layout in turn (one launch, several layouts); optionally also
    run :func:`uneven_collectives` in the same launch."""
    from grpo_megatron.distributed import megatron_compat

    init_gloo()
    out: dict[str, Any] = {"applied": megatron_compat.apply_megatron_compat("cpu")}
    for name in names:
        out[name] = train_one_layout(LAYOUTS[name])
    if check_collectives:
        out["collectives"] = uneven_collectives()
    return out


def uneven_collectives() -> dict[str, Any]:
    """megatron's first-dim all-gather / reduce-scatter with unequal split sizes over gloo: what
    megatron's own functions do, and what ours give (rank r holds r + 1 rows of value r + 1)."""
    from megatron.core.tensor_parallel import mappings

    from grpo_megatron.distributed import megatron_compat

    rank, world = init_gloo()
    megatron_compat.apply_megatron_compat("cpu")
    group = torch.distributed.group.WORLD
    sizes = [r + 1 for r in range(world)]
    rows_rh = torch.full((rank + 1, 3), float(rank + 1))
    full_rh = torch.ones(sum(sizes), 3) * (rank + 1)
    out: dict[str, Any] = {}
    for key, name, args in (
        ("gather", "_gather_along_first_dim", (rows_rh, group, sizes)),
        ("scatter", "_reduce_scatter_along_first_dim", (full_rh, group, sizes)),
    ):
        try:
            megatron_compat._original(f"megatron.core.tensor_parallel.mappings:{name}")(*args)
            out[f"megatron_{key}_error"] = ""
        except Exception as e:  # what gloo says is the point of the check
            out[f"megatron_{key}_error"] = f"{type(e).__name__}: {e}"
        torch.distributed.barrier()
        out[key] = getattr(mappings, name)(*args)
    return out


# ----------------------------------------------------------------------------------------------
# Workers that test the harness itself (no process group, no megatron: they start fast)


def echo(value: Any) -> dict[str, Any]:
    """Returns the kwargs it got and its rank (checks kwargs passing and rank order)."""
    import os

    return {"rank": int(os.environ["RANK"]), "value": value}


def fail_on_rank(rank_to_fail: int) -> dict[str, Any]:
    import os

    if int(os.environ["RANK"]) == rank_to_fail:
        raise ValueError(f"deliberate failure on rank {rank_to_fail}")
    return {}


def hang() -> None:
    import time

    time.sleep(600)


# ----------------------------------------------------------------------------------------------
# Distributed-optimizer checkpoint fixes (tests/test_megatron_compat.py::test_distopt_*)


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def distopt_checkpoint_fixes() -> dict[str, Any]:
    """For each distopt_* fix: megatron's original still fails (or misbehaves) on a real
    DistributedOptimizer over DP2, and ours works. The full save / resume equality is in
    tests/test_checkpoint.py."""
    import copy

    from grpo_megatron.distributed import megatron_compat
    from tests.workers.checkpoint_workers import _setup, _teardown, _train_step

    init_gloo()
    _, ps, policy = _setup(["parallel.use_distributed_optimizer=true"])
    (dopt,) = policy.optimizer.chained_optimizers

    def original(attr: str):
        return megatron_compat._original(f"{megatron_compat._DISTOPT}.{attr}")

    out: dict[str, Any] = {}
    # distopt_fresh_state_dict: no step taken yet.
    out["fresh_original"] = _error_of(lambda: original("state_dict")(dopt))
    out["fresh_steps"] = [g["step"] for g in dopt.state_dict()["optimizer"]["param_groups"]]
    for iteration in (1, 2):
        _train_step(policy, ps, iteration)

    # distopt_dp_zero_on_cuda: the gather of the fully_reshardable save.
    gather = {"use_gloo_comm": False, "return_on_all_ranks": True}
    out["dp_zero_original"] = _error_of(lambda: original("get_parameter_state_dp_zero")(dopt, **gather))
    out["dp_zero_fixed"] = _error_of(lambda: dopt.get_parameter_state_dp_zero(**gather))

    # distopt_unshared_step: load the optimizer's own common state back.
    common = dopt.state_dict()
    original("load_state_dict")(dopt, copy.deepcopy(common))
    steps = [s["step"] for s in dopt.optimizer.state.values()]
    out["states"] = len(steps)
    out["step_objects_original"] = len({id(t) for t in steps})
    dopt.load_state_dict(copy.deepcopy(common))
    steps = [s["step"] for s in dopt.optimizer.state.values()]
    out["step_objects_fixed"] = len({id(t) for t in steps})
    out["step_values_fixed"] = sorted({float(t) for t in steps})

    # distopt_keep_restored_step: per-parameter tensors without a step (fully_reshardable), and
    # with the fresh optimizer's 0 (dp_reshardable).
    model_param = next(iter(dopt.model_param_group_index_map))
    tensors = {
        k: v.detach().clone()
        for k, v in dopt._get_main_param_and_optimizer_states(model_param).items()
        if k != "step"
    }
    set_state = original("_set_main_param_and_optimizer_states")
    with torch.no_grad():
        out["set_original"] = _error_of(lambda: set_state(dopt, model_param, tensors))
        out["set_fixed"] = _error_of(lambda: dopt._set_main_param_and_optimizer_states(model_param, tensors))
        dopt._set_main_param_and_optimizer_states(model_param, {**tensors, "step": torch.tensor(0.0)})
    out["step_after_set"] = float(dopt._get_main_param_and_optimizer_states(model_param)["step"])

    # distopt_dp_reshardable_no_grad: the dp_reshardable load of this rank's own state.
    def own_state() -> dict:
        state = dopt.get_parameter_state_dp_reshardable()
        for gbuf_idx in range(len(dopt.gbuf_ranges)):
            for buckets in state[gbuf_idx].values():
                for bucket in buckets:
                    for elem in bucket:
                        elem["padding"] = False
        return state

    load = original("load_parameter_state_from_dp_reshardable")
    out["dp_reshardable_original"] = _error_of(lambda: load(dopt, own_state()))
    out["dp_reshardable_fixed"] = _error_of(
        lambda: dopt.load_parameter_state_from_dp_reshardable(own_state())
    )
    _teardown()
    return out
