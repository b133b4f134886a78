"""Workers of test_sync.py: the parallel weight sync into several embedded engines on 4 real
megatron-core ranks (gloo), layout by layout."""

from __future__ import annotations

import dataclasses

import torch

from tests.workers.rollout_workers import _setup


def _reference(policy, ps, hf) -> dict[str, torch.Tensor]:
    """The HF tensors of the trainer's weights by another road than the sync's: every canonical
    tensor all-gathered (``full_state``) and converted with the adapter's rules (``to_hf``)."""
    from grpo_megatron.bridge.hf_loader import rules_by_name
    from grpo_megatron.bridge.layout import full_state
    from grpo_megatron.bridge.transforms import to_hf

    full = full_state(policy.model, ps)
    return {
        name: t.clone()
        for rule in rules_by_name(hf).values()
        if rule.export
        for name, t in to_hf(rule, full[rule.mcore])
    }


def _engine_weights(engine) -> dict[str, torch.Tensor]:
    """The engine's live weights by HF checkpoint name (views, cloned)."""
    state = engine.model.state_dict()
    return {name: view.of(state[view.live_name]).clone() for name, view in engine.views.items()}


def _matches(engine, ref: dict[str, torch.Tensor]) -> bool:
    got = _engine_weights(engine)
    return set(got) <= set(ref) and all(torch.equal(got[n], ref[n]) for n in got)


def parallel_sync(cases: dict[str, list[str]], bad_hf_dir: str, bucket_bytes: int) -> dict:
    """Per case (layout overrides, placement included): sync v1 into every engine and compare each
    with the reference export; record the transport's peak buffer bytes, the bytes each rank sent and
    the model's size. Cases whose name ends in "reject" then move the trainer's weights, put an engine
    built from another config on the last engine rank and sync v2: every rank must raise, every other
    engine must keep v1 and its weights."""
    from grpo_megatron.bridge import export_plan
    from grpo_megatron.distributed.bootstrap import destroy_distributed
    from grpo_megatron.rollout.embedded import EmbeddedEngine
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.job import engine_spec

    out: dict = {}
    default_direct_min = export_plan.DIRECT_MIN_BYTES
    for case, overrides in cases.items():
        if case.startswith("needs"):
            out[case] = _per_gpu_needs(overrides, bucket_bytes)
            continue
        # "direct_min_bytes=N": slices of N bytes and more travel alone (the tiny model's slices are
        # all under the default, so this is how the send-from-shard and receive-in-place paths run).
        direct = [o for o in overrides if o.startswith("direct_min_bytes=")]
        export_plan.DIRECT_MIN_BYTES = int(direct[0].split("=")[1]) if direct else default_direct_min
        overrides = [o for o in overrides if o not in direct]
        cfg, ps, hf, policy = _setup(cfg_hf_dir := overrides[0], overrides[1:])
        del cfg_hf_dir
        fleet = RolloutFleet.build(engine_spec(cfg), hf, ps)
        metrics = fleet.sync_weights(policy.model, version=1, bucket_bytes=bucket_bytes)
        ref = _reference(policy, ps, hf)
        plan = fleet.weights.export_plan
        assert plan is not None
        sent = [0] * ps.world_size
        for (src, _), nbytes in plan.pair_bytes.items():
            sent[src] += nbytes
        res: dict = {
            "direct_messages": sum(m.direct for rnd in plan.sends + plan.recvs for m in rnd),
            "engine_ranks": list(fleet.engine_ranks),
            "has_engine": fleet.engine is not None,
            "version": fleet.engine.weight_version if fleet.engine is not None else None,
            "exact": _matches(fleet.engine, ref) if fleet.engine is not None else None,
            "peak_buffer_bytes": metrics["sync/peak_buffer_bytes"],
            "in_place_bytes": metrics["sync/in_place_bytes"],
            "sync_bytes": metrics["sync/bytes"],
            "sent": sent,
            "max_item_bytes": max(item.hf_bytes for item in plan.items),
            "model_bytes": sum(item.hf_bytes for item in plan.items),
        }
        # A second sync with the cached plan: still exact (the plan's views follow the weights).
        with torch.no_grad():
            for p in policy.model.parameters():
                p.mul_(0.5)
        fleet.sync_weights(policy.model, version=2, bucket_bytes=bucket_bytes)
        ref2 = _reference(policy, ps, hf)
        res["exact_v2"] = _matches(fleet.engine, ref2) if fleet.engine is not None else None

        if case.endswith("reject"):
            with torch.no_grad():
                for p in policy.model.parameters():
                    p.add_(1.0)
            if ps.rank == fleet.engine_ranks[-1]:  # a misconfigured engine: another model's shapes
                bad_hf = dataclasses.replace(cfg.model, hf_path=bad_hf_dir).load_hf_config()
                fleet.parts.engine = EmbeddedEngine(bad_hf, dtype=torch.float32)
            try:
                fleet.sync_weights(policy.model, version=3, bucket_bytes=bucket_bytes)
                res["reject_error"] = "no error"
            except RuntimeError as exc:
                res["reject_error"] = str(exc)
            if fleet.engine is not None:
                res["version_after_reject"] = fleet.engine.weight_version
                res["kept_v2"] = _matches(fleet.engine, ref2) if ps.rank != fleet.engine_ranks[-1] else None
        fleet.shutdown()
        out[case] = res
        destroy_distributed(keep_process_group=True)
    return out


def _per_gpu_needs(overrides: list[str], bucket_bytes: int) -> dict:
    """Every rank a destination, each with an SGLang EP rank's needs (``rollout/sglang/shards.py``:
    dense tensors in full + the experts of its block, engine of 4 GPUs at ``ep=N`` given as
    "engine_ep=N"): what each receives, compared with the reference export; its plan's manifest;
    the bytes each rank sent; the transport's peak buffer."""
    from grpo_megatron.bridge.assemble import Landing
    from grpo_megatron.bridge.export import ExportStream
    from grpo_megatron.bridge.export_plan import TransferStats, plan_export
    from grpo_megatron.distributed.bootstrap import destroy_distributed
    from grpo_megatron.rollout.sglang.shards import rank_needs

    engine_ep = int(next(o for o in overrides if o.startswith("engine_ep=")).split("=")[1])
    overrides = [o for o in overrides if not o.startswith("engine_ep=")]
    _, ps, hf, policy = _setup(overrides[0], overrides[1:])
    dsts = list(range(ps.world_size))
    needs = {d: rank_needs(hf, ps.world_size, engine_ep, d) for d in dsts}
    plan = plan_export(
        policy.model, ps, hf, bucket_bytes=bucket_bytes, dst_ranks=dsts, dtype=torch.float32, needs=needs
    )
    stats = TransferStats()
    got: dict[str, torch.Tensor] = {}
    yields = 0
    for bucket in ExportStream(
        plan, Landing(torch.device("cpu"), borrow=True), stats=stats, every_round=True
    ):
        yields += 1
        for name, t in bucket:
            assert name not in got, name
            got[name] = t.clone()
    ref = _reference(policy, ps, hf)
    mine = needs[ps.rank]
    expected = {n for n in ref if mine(n)}
    sent = [0] * ps.world_size
    for (src, _), nbytes in plan.pair_bytes.items():
        sent[src] += nbytes
    res = {
        "names_exact": set(got) == expected,
        "values_exact": all(torch.equal(got[n], ref[n]) for n in expected & set(got)),
        "manifest_exact": {n for n, _, _ in plan.manifest(ps.rank)} == expected,
        "skipped_experts": len(set(ref) - expected),
        "yields": yields,
        "sent": sent,
        "received_bytes": stats.received_bytes,
        "peak_buffer_bytes": stats.peak_bytes,
        "max_item_bytes": max(item.hf_bytes for item in plan.items),
        "model_bytes": sum(item.hf_bytes for item in plan.items),
    }
    destroy_distributed(keep_process_group=True)
    return res
