"""Workers of test_routing.py: a real megatron policy and reference, real embedded engines, routing
replay at EP2 and TP2xEP2 (sequence parallel) on several processes."""

from __future__ import annotations

import torch

from tests.workers.rollout_workers import PROMPTS, _setup


def _reduced(routing, ps) -> tuple[torch.Tensor, torch.Tensor]:
    from grpo_megatron.models.routing import reduce_routing_stats

    return reduce_routing_stats(*routing.stats(), ps)


def replay_cases(cases: dict[str, tuple[str, list[str]]]) -> dict:
    """Per case (HF config dir, layout overrides): engine routes replayed in the trainer (R3), the
    trainer's own routes compared with them, and replay of altered routes in the reference only."""
    from grpo_megatron.distributed.bootstrap import destroy_distributed
    from grpo_megatron.models.routing import RoutingPass, model_taps
    from grpo_megatron.rollout.engine import SamplingParams
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.batching import collate, make_sample
    from grpo_megatron.training.forward_backward import forward_logprobs
    from grpo_megatron.training.job import build_reference
    from grpo_megatron.training.route_replay import store_own_routes

    out: dict = {}
    for case, (hf_dir, overrides) in cases.items():
        cfg, ps, hf, policy = _setup(hf_dir, overrides)
        reference = build_reference(cfg, hf, ps, policy)
        fleet = RolloutFleet.build(cfg, hf, ps)
        fleet.sync_weights(policy.model, version=1)
        groups = fleet.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=7))
        samples = [
            make_sample(p, c.token_ids, c.logprobs, 0.0, c.routed_experts)
            for p, cs in zip(PROMPTS, groups, strict=True)
            for c in cs
        ]
        rows = list(range(len(samples)))
        mb = collate(samples, rows, pad_id=0, routes="engine")
        vocab = hf["vocab_size"]
        res: dict = {"tp": ps.tp, "ep": ps.ep, "dp": ps.dp, "sp": ps.sequence_parallel}

        def logprobs(model, batch, routing=None, ps=ps, vocab=vocab) -> torch.Tensor:
            (o,) = forward_logprobs(model, [batch], ps, vocab_size=vocab, routing=routing)
            return o.logprobs_bs.float().cpu()

        mask_bs = mb.extras["mask_bs"]
        engine_bs = mb.extras["rollout_logprobs_bs"]
        routing = RoutingPass(policy.model, ps, replay=True)
        replayed_bs = logprobs(policy.model, mb, routing)
        compare_m2, counts_me = _reduced(routing, ps)
        routing.close()
        res["r3_vs_engine"] = float(((replayed_bs - engine_bs).abs() * mask_bs).max())
        res["r3_mismatches"] = compare_m2[:, 0].tolist()
        res["r3_compared"] = compare_m2[:, 1].tolist()
        valid_bs = mb.routes_lbsk[0, :, :, 0] >= 0
        res["tokens"] = int(valid_bs.sum())
        res["engine_counts"] = torch.stack(
            [torch.bincount(r[valid_bs].long().reshape(-1), minlength=counts_me.shape[1]) for r in mb.routes_lbsk]
        ).double()
        res["r3_counts"] = counts_me

        # Altered routes (every expert id shifted by one) replayed in the reference only: they change
        # its logprobs and its load counts follow them; the policy, run next without replay, is
        # untouched (the two models' routers never share replay state).
        num_experts = counts_me.shape[1]
        altered = mb.routes_lbsk.clone()
        altered[altered >= 0] = (altered[altered >= 0] + 1) % num_experts
        shifted = collate(samples, rows, pad_id=0)
        shifted.routes_lbsk = altered
        ref_routing = RoutingPass(reference, ps, replay=True)
        ref_bs = logprobs(reference, shifted, ref_routing)
        _, ref_counts = _reduced(ref_routing, ps)
        ref_routing.close()
        res["altered_counts"] = ref_counts
        res["altered_expected"] = torch.stack(
            [torch.bincount(r[valid_bs].long().reshape(-1), minlength=num_experts) for r in altered]
        ).double()
        res["altered_vs_engine"] = float(((ref_bs - engine_bs).abs() * mask_bs).max())
        own_bs = logprobs(policy.model, mb)
        res["own_vs_engine"] = float(((own_bs - engine_bs).abs() * mask_bs).max())
        # R2: the pass's own routes, stored on the samples (gathered over SP chunks), replayed.
        own_routing = RoutingPass(policy.model, ps, replay=False)
        logprobs(policy.model, mb, own_routing)
        store_own_routes(own_routing, samples, [rows])
        own_routing.close()
        local = [m for m in range(samples[0].routes["old"].shape[0]) if bool((samples[0].routes["old"][m] >= 0).all())]
        res["r2_local_layers"] = local  # this pipeline stage's MoE layers: the others stay -1
        res["r2_routes_equal_engine"] = all(
            torch.equal(s.routes["old"][local].long().sort(-1).values, s.routes["engine"][local].long().sort(-1).values)
            for s in samples
        )
        r2_bs = logprobs(policy.model, collate(samples, rows, pad_id=0, routes="old"), RoutingPass(policy.model, ps, replay=True))
        res["r2_vs_own"] = float(((r2_bs - own_bs).abs() * mask_bs).max())
        res["taps_disjoint"] = not {id(t) for t in model_taps(policy.model)} & {id(t) for t in model_taps(reference)}
        fleet.shutdown()
        out[case] = res
        destroy_distributed(keep_process_group=True)
    return out
