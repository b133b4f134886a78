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
    from grpo_megatron.training.job import build_reference, engine_spec
    from grpo_megatron.training.route_replay import store_own_routes

    out: dict = {}
    for case, (hf_dir, overrides) in cases.items():
        # r3: the engines record their routes (engine_spec), which this test replays
        cfg, ps, hf, policy = _setup(hf_dir, [*overrides, "algorithm.routing_replay=r3"])
        reference = build_reference(cfg.model, hf, ps, policy)
        fleet = RolloutFleet.build(engine_spec(cfg), hf, ps)
        fleet.sync_weights(policy.model, version=1)
        groups = fleet.generate(
            PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=7, routes=True)
        )
        # Every rank runs the whole batch here: every route goes to every rank.
        routes = fleet.deliver_routes({c.route_id: range(ps.world_size) for cs in groups for c in cs})
        samples = [
            make_sample(p, c.token_ids, c.logprobs, 0.0, routes[c.route_id])
            for p, cs in zip(PROMPTS, groups, strict=True)
            for c in cs
        ]
        # Two micro-batches of different padded lengths (longest rows first, as the planner cuts them).
        order = sorted(range(len(samples)), key=lambda i: -samples[i].length)
        split = [order[:5], order[5:]]
        mbs = [collate(samples, r, pad_id=0, routes="engine") for r in split]
        vocab = hf["vocab_size"]
        res: dict = {"tp": ps.tp, "ep": ps.ep, "dp": ps.dp, "sp": ps.sequence_parallel}
        res["lengths"] = [mb.tokens_bs.shape[1] for mb in mbs]

        def logprobs(model, batches, routing=None, ps=ps, vocab=vocab) -> list[torch.Tensor]:
            outs = forward_logprobs(model, batches, ps, vocab_size=vocab, routing=routing)
            return [o.logprobs_bs.float().cpu() for o in outs]

        def max_diff(a: list[torch.Tensor], b: list[torch.Tensor], mbs=mbs) -> float:
            return max(
                float(((x - y).abs() * mb.extras["mask_bs"]).max())
                for x, y, mb in zip(a, b, mbs, strict=True)
            )

        def counts(routes: list[torch.Tensor], num_experts: int) -> torch.Tensor:
            total = torch.zeros(routes[0].shape[0], num_experts, dtype=torch.float64)
            for r_lbsk in routes:
                valid_bs = r_lbsk[0, :, :, 0] >= 0
                total += torch.stack(
                    [torch.bincount(r[valid_bs].long().reshape(-1), minlength=num_experts) for r in r_lbsk]
                )
            return total

        engine = [mb.extras["rollout_logprobs_bs"] for mb in mbs]
        routing = RoutingPass(policy.model, ps, replay=True)
        replayed = logprobs(policy.model, mbs, routing)
        compare_m2, counts_me = _reduced(routing, ps)
        routing.close()
        num_experts = counts_me.shape[1]
        res["r3_vs_engine"] = max_diff(replayed, engine)
        res["r3_mismatches"] = compare_m2[:, 0].tolist()
        res["r3_compared"] = compare_m2[:, 1].tolist()
        res["tokens"] = sum(int((mb.routes_lbsk[0, :, :, 0] >= 0).sum()) for mb in mbs)
        res["engine_counts"] = counts([mb.routes_lbsk for mb in mbs], num_experts)
        res["r3_counts"] = counts_me

        # Altered routes (every expert id shifted by one) replayed in the reference only: they change
        # its logprobs and its load counts follow them; the policy, run next without replay, is
        # untouched (the two models' routers never share replay state).
        shifted = []
        for r, mb in zip(split, mbs, strict=True):
            batch = collate(samples, r, pad_id=0)
            batch.routes_lbsk = torch.where(
                mb.routes_lbsk >= 0, (mb.routes_lbsk + 1) % num_experts, mb.routes_lbsk
            )
            shifted.append(batch)
        ref_routing = RoutingPass(reference, ps, replay=True)
        ref_out = logprobs(reference, shifted, ref_routing)
        _, ref_counts = _reduced(ref_routing, ps)
        ref_routing.close()
        res["altered_counts"] = ref_counts
        res["altered_expected"] = counts([b.routes_lbsk for b in shifted], num_experts)
        res["altered_vs_engine"] = max_diff(ref_out, engine)
        own = logprobs(policy.model, mbs)
        res["own_vs_engine"] = max_diff(own, engine)
        # R2: the pass's own routes, stored on the samples (gathered over SP chunks), replayed.
        own_routing = RoutingPass(policy.model, ps, replay=False)
        logprobs(policy.model, mbs, own_routing)
        store_own_routes(own_routing, samples, split)
        own_routing.close()
        old = samples[0].routes["old"]
        local = [m for m in range(old.shape[0]) if bool((old[m] >= 0).all())]
        res["r2_local_layers"] = local  # this pipeline stage's MoE layers: the others stay -1
        res["r2_routes_equal_engine"] = all(
            torch.equal(
                s.routes["old"][local].long().sort(-1).values,
                s.routes["engine"][local].long().sort(-1).values,
            )
            for s in samples
        )
        r2_batches = [collate(samples, r, pad_id=0, routes="old") for r in split]
        res["r2_vs_own"] = max_diff(
            logprobs(policy.model, r2_batches, RoutingPass(policy.model, ps, replay=True)), own
        )
        res["taps_disjoint"] = not {id(t) for t in model_taps(policy.model)} & {
            id(t) for t in model_taps(reference)
        }
        res |= _part_replay(policy.model, mbs[0], shifted[0], logprobs, ps)
        fleet.shutdown()
        out[case] = res
        destroy_distributed(keep_process_group=True)
    return out


def _part_replay(model, mb, altered, logprobs, ps) -> dict:
    """The mismatch probe's one forward (RoutingPass replay_rows): ``mb``'s rows twice, the first copy
    routing itself, the second replaying ``altered``'s routes; each copy against its own pass, and
    what each counts as compared."""
    from grpo_megatron.models.routing import RoutingPass
    from grpo_megatron.training.forward_backward import MicroBatch

    rows = mb.tokens_bs.shape[0]
    both = MicroBatch(torch.cat([mb.tokens_bs] * 2), torch.cat([mb.labels_bs] * 2))
    both.routes_lbsk = torch.cat([altered.routes_lbsk] * 2, dim=1)
    passes = {
        "part": (RoutingPass(model, ps, replay=True, replay_rows=torch.arange(2 * rows) >= rows), both),
        "plain": (RoutingPass(model, ps, replay=False), altered),
        "replayed": (RoutingPass(model, ps, replay=True), altered),
    }
    out, compared = {}, {}
    for name, (routing, batch) in passes.items():
        (out[name],) = logprobs(model, [batch], routing)
        compared[name] = _reduced(routing, ps)[0]
        routing.close()
    mask = mb.extras["mask_bs"]
    return {
        "part_plain_vs_plain": float(((out["part"][:rows] - out["plain"]).abs() * mask).max()),
        "part_replay_vs_replayed": float(((out["part"][rows:] - out["replayed"]).abs() * mask).max()),
        "replayed_vs_plain": float(((out["replayed"] - out["plain"]).abs() * mask).max()),
        "part_compared": compared["part"].tolist(),
        "plain_compared": compared["plain"].tolist(),
    }


def recompute_gradients(hf_dir: str, recompute: str) -> dict:
    """One training pass (two micro-batches) of a fresh policy with ``model.recompute=recompute``,
    routing on its own and replaying given routes (which differ from its own): the gradients of
    each, the forwards each router recorded, and the micro-batches' count."""
    from grpo_megatron.distributed.bootstrap import destroy_distributed
    from grpo_megatron.models.config import num_routed_experts
    from grpo_megatron.models.routing import RoutingPass, model_taps
    from grpo_megatron.training.forward_backward import MicroBatch, forward_backward

    cfg, ps, hf, policy = _setup(hf_dir, [f"model.recompute={recompute}"])
    gen = torch.Generator().manual_seed(5)
    num_experts, top_k = num_routed_experts(hf), hf["num_experts_per_tok"]
    mbs = []
    for rows, length in ((3, 9), (2, 6)):
        tokens = torch.randint(0, hf["vocab_size"], (rows, length + 1), generator=gen)
        mb = MicroBatch(tokens[:, :-1], tokens[:, 1:])
        mb.routes_lbsk = torch.rand(
            hf["num_hidden_layers"], rows, length, num_experts, generator=gen
        ).argsort(-1)[..., :top_k]
        mbs.append(mb)

    def loss_fn(logprobs_bs, entropy_bs, mb):
        return -logprobs_bs.sum(), {}

    out: dict = {"forwards": {}}
    for replay in (False, True):
        policy.model.zero_grad_buffer()
        routing = RoutingPass(policy.model, ps, replay=replay)
        forward_backward(policy.model, mbs, ps, loss_fn, vocab_size=hf["vocab_size"], routing=routing)
        out["forwards"][replay] = [len(t.own) for t in model_taps(policy.model)]
        routing.close()
        out[f"grads_replay={replay}"] = {
            n: p.main_grad.detach().clone() for n, p in policy.model.named_parameters()
        }
    out["microbatches"] = len(mbs)
    destroy_distributed(keep_process_group=True)
    return out
