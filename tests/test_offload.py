"""Trainer offload / onload: storages really freed, everything back bit for bit, the policy still trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_megatron.training.offload import offload, onload
from grpo_megatron.training.policy import Policy
from tests.helpers.dist import run_distributed
from tests.helpers.tiny_configs import tiny_hf_config


def test_torch_module_and_adam_round_trip():
    """The same walk over a plain module and torch Adam: parameters, grads and moments come back exact,
    views of a freed storage included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).square().sum().backward()
    optimizer.step()
    policy = Policy(model=model, optimizer=optimizer, spec=None)  # type: ignore[arg-type]
    view = model[0].weight[:, :3]  # a view taken before the offload stays valid after it
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [t for state in optimizer.state.values() for t in state.values() if t.dim() > 0]
    before = [t.clone() for t in tensors]
    view_before = view.clone()

    report = offload(policy)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    assert report.bytes_moved == report.bytes_freed == sum(t.numel() * 4 for t in before) + 4 * 4  # + steps
    assert report.device_memory_left is None  # CPU
    onload(policy, report)
    assert all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True))
    assert torch.equal(view, view_before)
    with pytest.raises(RuntimeError, match="already onloaded"):
        onload(policy, report)

    first = offload(policy, parts=("grads", "optimizer"))
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())  # still there for a sync
    assert all(p.grad.untyped_storage().nbytes() == 0 for p in model.parameters())
    second = offload(policy, parts=("params",))
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    onload(policy, second)
    onload(policy, first)
    assert all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True))
    with pytest.raises(ValueError, match="offload parts"):
        offload(policy, parts=("weights",))

    report = offload(policy, discard_grads=True)
    assert report.bytes_moved < report.bytes_freed
    onload(policy, report)
    assert all(bool((p.grad == 0).all()) for p in model.parameters())
    assert torch.equal(model[1].weight, before[2])


@pytest.mark.launches
@pytest.mark.timeout(300)
def test_megatron_policy_round_trip_on_two_ranks(tmp_path: Path):
    """After two optimizer steps: DP2 with the distributed optimizer (grads and optimizer offloaded first,
    then parameters), EP2 with it (gradients discarded), TP2 with plain Adam. Offload frees every parameter, main_grad and optimizer tensor; onload restores
    them bit for bit; a further step still moves the model."""
    hf_dir = tmp_path / "moe"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(tiny_hf_config("qwen3_moe")))
    moe = str(hf_dir)
    cases = {
        "dp2_distopt_two_phase": (moe, ["parallel.use_distributed_optimizer=true"], False, True),
        "ep2_distopt_discard": (
            moe,
            ["parallel.ep=2", "parallel.use_distributed_optimizer=true"],
            True,
            False,
        ),
        "tp2_adam": (moe, ["parallel.tp=2", "parallel.use_distributed_optimizer=false"], False, False),
    }
    results = run_distributed(
        "tests.workers.offload_workers:roundtrips", world_size=2, timeout_s=280, cases=cases
    )
    for rank, per_case in enumerate(results):
        for case, res in per_case.items():
            where = f"{case} rank {rank}"
            assert res["has_exp_avg"], where  # optimizer state exists
            assert res["still_allocated"] == [], where
            assert res["not_identical"] == [], where
            assert res["memory_left"] is None, where
            assert res["bytes_moved"] > 0 and res["storages"] > 0, where
            assert res["logprob_change_after"] > 1e-3, where
            if case.endswith("two_phase"):  # shards are views of parameters: phase 1 must keep them
                assert res["params_kept_in_phase1"], where
            if case.endswith("discard"):
                assert res["grads_zero"] and res["bytes_moved"] < res["bytes_freed"], where
            else:
                assert res["grads_identical"] and res["bytes_moved"] == res["bytes_freed"], where
    assert results[0]["dp2_distopt_two_phase"]["dist_opt"] and not results[0]["tp2_adam"]["dist_opt"]
    # Same data, same init: DP2 and TP2 take the same step after the round trip.
    assert results[0]["dp2_distopt_two_phase"]["grad_norm_after"] == pytest.approx(
        results[0]["tp2_adam"]["grad_norm_after"]
    )
