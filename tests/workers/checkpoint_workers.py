"""Workers of tests/test_checkpoint.py: real policies trained, saved, resumed (gloo, fp32, 2 ranks).

Each case trains the tiny Qwen3-MoE of examples/tiny_moe.yaml with a next-token loss, one
optimizer step per iteration on a batch that depends on the iteration (as a prompt sampler's
would), and checkpoints through ``CheckpointManager`` with ``save_interval``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.dist import CPU_JOB

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe.yaml"
GLOBAL_ROWS, SEQ_LEN = 4, 16  # one global batch, split over data-parallel ranks


def _setup(overrides: list[str]):
    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import init_distributed, world_size_from_env
    from grpo_megatron.training.policy import build_policy

    cfg = load_config(EXAMPLE, [*CPU_JOB, *overrides])
    validate(cfg, world_size_from_env())
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    policy = build_policy(cfg.model.load_hf_config(), cfg.model, cfg.parallel, cfg.train, ps)
    return cfg, ps, policy


def _teardown() -> None:
    from grpo_megatron.distributed.bootstrap import destroy_distributed

    destroy_distributed(keep_process_group=True)


def _train_step(policy, ps, iteration: int) -> tuple[float, float]:
    """One optimizer step on iteration ``iteration``'s batch; returns (global loss, lr used)."""
    import torch.distributed as dist

    from grpo_megatron.training.forward_backward import MicroBatch, forward_backward
    from grpo_megatron.training.sanity import synthetic_batch

    rows = GLOBAL_ROWS // ps.dp
    tokens_bs = synthetic_batch(policy.spec.vocab_size, GLOBAL_ROWS, SEQ_LEN + 1, seed=iteration)
    mine_bs = tokens_bs[ps.dp_rank * rows : (ps.dp_rank + 1) * rows]
    global_tokens = GLOBAL_ROWS * SEQ_LEN

    def nll(logprobs_bs, entropy_bs, mb):
        return -logprobs_bs.sum() / global_tokens, {}

    policy.zero_grad()
    metrics = forward_backward(
        policy.model,
        [MicroBatch(tokens_bs=mine_bs[:, :-1], labels_bs=mine_bs[:, 1:])],
        ps,
        nll,
        vocab_size=policy.spec.vocab_size,
    )
    stats = policy.step()
    loss = torch.tensor(sum(float(m["loss"]) for m in metrics), dtype=torch.float64)
    dist.all_reduce(loss, group=ps.dp_group)
    return float(loss), stats["lr"]


def _weights(policy, ps) -> dict[str, torch.Tensor]:
    from grpo_megatron.bridge.layout import full_state

    state = full_state(policy.model, ps)
    return state if ps.rank == 0 else {}


def _adam_steps(policy) -> list[float]:
    """Adam's per-parameter step counters on this rank (all must equal the optimizer steps taken)."""
    steps = []
    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        for state in opt.optimizer.state.values():
            if "step" in state:
                steps.append(float(state["step"]))
    return steps


def run_case(
    overrides: list[str], ckpt_dir: str, total: int, *, record_weights_at: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Train from ``checkpoint.resume`` (auto: the latest checkpoint, else from scratch) to
    iteration ``total``, saving every ``checkpoint.save_interval``; record what happened."""
    from grpo_megatron.checkpoint.manager import CheckpointManager

    cfg, ps, policy = _setup([f"checkpoint.dir={ckpt_dir}", *overrides])
    manager = CheckpointManager(cfg.checkpoint, cfg.logging.run_dir, ps)
    trainer_state = manager.resume(policy)
    start = 0 if trainer_state is None else trainer_state["iteration"]
    out: dict[str, Any] = {
        "resumed_at": start,
        "trainer_state": trainer_state or {},
        "lr_after_resume": policy.lr,
        "adam_steps_after_resume": _adam_steps(policy),
        "losses": {},
        "lrs": {},
        "weights": {},
    }
    if start in record_weights_at:
        out["weights"][start] = _weights(policy, ps)
    for iteration in range(start + 1, total + 1):
        out["losses"][iteration], out["lrs"][iteration] = _train_step(policy, ps, iteration)
        if manager.should_save(iteration):
            manager.save(iteration, policy, {"iteration": iteration, "consumed_prompts": 4 * iteration})
        if iteration in record_weights_at:
            out["weights"][iteration] = _weights(policy, ps)
    out["adam_steps"] = _adam_steps(policy)
    out["final_weights"] = _weights(policy, ps)
    _teardown()
    return out


def interrupted_save(overrides: list[str], ckpt_dir: str, iteration: int) -> dict[str, Any]:
    """Resume from ``ckpt_dir``, train one iteration, and crash the save just before it is
    published (the dist checkpoint and RNG files are already written in the temporary directory)."""
    import grpo_megatron.checkpoint.manager as manager_module
    from grpo_megatron.checkpoint.manager import CheckpointManager

    cfg, ps, policy = _setup([f"checkpoint.dir={ckpt_dir}", *overrides])
    manager = CheckpointManager(cfg.checkpoint, cfg.logging.run_dir, ps)
    manager.resume(policy)
    _train_step(policy, ps, iteration)

    def crash(*args, **kwargs):
        raise OSError("simulated crash while publishing the checkpoint")

    manager_module.finish, original = crash, manager_module.finish
    try:
        manager.save(iteration, policy, {"iteration": iteration})
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    finally:
        manager_module.finish = original
    _teardown()
    return {"error": error}


def load_elsewhere(
    overrides: list[str], ckpt: str, *, step_iteration: int | None = None, expect_error: bool = False
) -> dict[str, Any]:
    """Load training checkpoint ``ckpt`` at the layout of ``overrides``; record the weights (and
    those after one more step on ``step_iteration``'s batch), or the error when one is expected."""
    from grpo_megatron.checkpoint.manager import CheckpointManager

    cfg, ps, policy = _setup([f"checkpoint.resume={ckpt}", *overrides])
    manager = CheckpointManager(cfg.checkpoint, cfg.logging.run_dir, ps)
    out: dict[str, Any] = {}
    try:
        out["trainer_state"] = manager.resume(policy)
    except Exception as exc:
        if not expect_error:
            raise
        out["error"] = f"{type(exc).__name__}: {exc}"
        _teardown()
        return out
    out["weights"] = _weights(policy, ps)
    out["lr"] = policy.lr
    if step_iteration is not None:
        out["loss"], _ = _train_step(policy, ps, step_iteration)
        out["weights_after_step"] = _weights(policy, ps)
    _teardown()
    return out


def cases(calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Run several of the functions above in one launch (process group kept between them)."""
    from tests.helpers.dist import init_gloo

    init_gloo()
    return [globals()[name](**kwargs) for name, kwargs in calls]
