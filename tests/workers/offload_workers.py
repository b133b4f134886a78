"""Workers of test_offload.py: offload / onload of a real megatron policy after optimizer steps."""

from __future__ import annotations

import torch

from tests.workers.rollout_workers import _setup, _train_step

SEQUENCES = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


def _snapshot(policy) -> dict[str, torch.Tensor]:
    """Clones of every parameter, main_grad and optimizer tensor, by a readable key."""
    out = {}
    for name, param in policy.model.named_parameters():
        out[f"param/{name}"] = param.detach().clone()
        if getattr(param, "main_grad", None) is not None:
            out[f"main_grad/{name}"] = param.main_grad.detach().clone()
    optimizers = getattr(policy.optimizer, "chained_optimizers", None) or [policy.optimizer]
    for i, opt in enumerate(optimizers):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for j, param in enumerate(group["params"]):
                out[f"opt{i}/group{g}/param{j}"] = param.detach().clone()
                for key, value in inner.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"opt{i}/group{g}/param{j}/{key}"] = value.detach().clone()
    return out


def _live(policy) -> dict[str, torch.Tensor]:
    """The same tensors as ``_snapshot``, not copied (to check their storages are freed)."""
    out = {}
    for name, param in policy.model.named_parameters():
        out[f"param/{name}"] = param
        if getattr(param, "main_grad", None) is not None:
            out[f"main_grad/{name}"] = param.main_grad
    optimizers = getattr(policy.optimizer, "chained_optimizers", None) or [policy.optimizer]
    for i, opt in enumerate(optimizers):
        for g, group in enumerate(opt.optimizer.param_groups):
            for j, param in enumerate(group["params"]):
                out[f"opt{i}/group{g}/param{j}"] = param
                for key, value in opt.optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"opt{i}/group{g}/param{j}/{key}"] = value
    return out


def roundtrips(cases: dict[str, tuple[str, list[str], bool, bool]]) -> dict:
    """Per case (HF dir, overrides, discard_grads, two_phase): two steps, offload (two_phase: grads and
    optimizer first, as before a weight sync, then the parameters), onload, compare, one more step."""
    from grpo_megatron.distributed.bootstrap import destroy_distributed
    from grpo_megatron.training.offload import offload, onload
    from tests.workers.rollout_workers import _trainer_logprobs

    out = {}
    for case, (hf_dir, overrides, discard_grads, two_phase) in cases.items():
        cfg, ps, hf, policy = _setup(hf_dir, overrides)
        for _ in range(2):
            _train_step(policy, ps, hf, SEQUENCES)
        before = _snapshot(policy)
        reports = []
        res: dict = {}
        if two_phase:
            reports.append(offload(policy, parts=("grads", "optimizer"), discard_grads=discard_grads))
            params = [t for k, t in _live(policy).items() if k.startswith("param/")]
            res["params_kept_in_phase1"] = all(t.untyped_storage().nbytes() > 0 for t in params)
            reports.append(offload(policy, parts=("params",)))
        else:
            reports.append(offload(policy, discard_grads=discard_grads))
        live = _live(policy)
        res |= {
            "bytes_moved": sum(r.bytes_moved for r in reports),
            "bytes_freed": sum(r.bytes_freed for r in reports),
            "storages": sum(r.storages for r in reports),
            "memory_left": reports[-1].device_memory_left,
            "still_allocated": sorted(k for k, t in live.items() if t.untyped_storage().nbytes() > 0),
            "state_keys": sorted(before),
            "has_exp_avg": any(k.endswith("/exp_avg") for k in before),
            "dist_opt": cfg.parallel.use_distributed_optimizer,
        }
        for report in reversed(reports):
            onload(policy, report)
        after = _snapshot(policy)
        grads = {k for k in before if k.startswith("main_grad/")}
        res["not_identical"] = sorted(
            k for k in before if k not in grads and not torch.equal(before[k], after[k])
        )
        res["grads_identical"] = all(torch.equal(before[k], after[k]) for k in grads)
        res["grads_zero"] = all(bool((after[k] == 0).all()) for k in grads)
        # The restored storages are the ones the model and optimizer use: a step still moves the model.
        lp_before = _trainer_logprobs(policy, ps, hf, SEQUENCES, [1] * len(SEQUENCES))
        step = _train_step(policy, ps, hf, SEQUENCES)
        lp_after = _trainer_logprobs(policy, ps, hf, SEQUENCES, [1] * len(SEQUENCES))
        res["grad_norm_after"] = step["grad_norm"]
        res["logprob_change_after"] = max(
            float((a - b).abs().max()) for a, b in zip(lp_before, lp_after, strict=True)
        )
        out[case] = res
        destroy_distributed(keep_process_group=True)
    return out
