"""Workers of test_rollout.py: a real megatron policy and real embedded engines on several processes.

Each case builds the policy at a layout, a ``RolloutFleet`` of embedded engines, syncs the weights
and compares engine and trainer logprobs; the first case also trains one step and re-syncs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tests.helpers.dist import CPU_JOB, group_timeouts_minutes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe.yaml"
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]  # uneven: left padding matters


def _setup(hf_dir: str, overrides: list[str]):
    from grpo_megatron.config import load_config, validate
    from grpo_megatron.distributed.bootstrap import init_distributed, world_size_from_env
    from grpo_megatron.training.policy import build_policy

    cfg = load_config(EXAMPLE, [*CPU_JOB, f"model.hf_path={hf_dir}", "train.lr=1e-2", *overrides])
    validate(cfg, world_size_from_env())
    ps = init_distributed(cfg.parallel, seed=cfg.train.seed)
    hf = cfg.model.load_hf_config()
    policy = build_policy(hf, cfg.model, cfg.parallel, cfg.train, ps)
    return cfg, ps, hf, policy


def _trainer_logprobs(
    policy, ps, hf, sequences: list[list[int]], prompt_lens: list[int]
) -> list[torch.Tensor]:
    """The trainer's logprobs of each sequence's tokens after its prompt."""
    from grpo_megatron.training.forward_backward import MicroBatch, forward_logprobs

    length = max(len(s) for s in sequences)
    tokens_bl = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, s in enumerate(sequences):
        tokens_bl[i, : len(s)] = torch.tensor(s)
    (out,) = forward_logprobs(
        policy.model, [MicroBatch(tokens_bl[:, :-1], tokens_bl[:, 1:])], ps, vocab_size=hf["vocab_size"]
    )
    pairs = enumerate(zip(sequences, prompt_lens, strict=True))
    return [out.logprobs_bs[i, p - 1 : len(s) - 1] for i, (s, p) in pairs]


def _rollout_vs_trainer(fleet, policy, ps, hf, params) -> tuple[list, float]:
    """Generate, then the largest |engine logprob - trainer logprob| over all sampled tokens."""
    from grpo_megatron.training.phases.sync import probe_batch

    completions = fleet.generate(PROMPTS, params)
    probe = probe_batch(PROMPTS, _tokens(completions), size=10**6)
    sequences, prompt_lens = probe.sequences, probe.prompt_lens
    trainer = _trainer_logprobs(policy, ps, hf, sequences, prompt_lens)
    engine = [torch.tensor(c.logprobs) for group in completions for c in group if c.token_ids]
    diff = max(float((e - t).abs().max()) for e, t in zip(engine, trainer, strict=True))
    return completions, diff


def _tokens(completions) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in completions]


def _train_step(policy, ps, hf, sequences: list[list[int]]) -> dict[str, float]:
    """One optimizer step raising the logprob of ``sequences`` (SFT-shaped, enough to move weights)."""
    from grpo_megatron.training.forward_backward import MicroBatch, forward_backward

    length = max(len(s) for s in sequences)
    tokens_bl = torch.zeros((len(sequences), length), dtype=torch.long)
    mask_bl = torch.zeros((len(sequences), length - 1))
    for i, s in enumerate(sequences):
        tokens_bl[i, : len(s)] = torch.tensor(s)
        mask_bl[i, : len(s) - 1] = 1
    count = float(mask_bl.sum()) * ps.dp  # every DP rank runs the same batch

    def loss_fn(logprobs_bs, entropy_bs, mb):
        loss = -(logprobs_bs * mb.extras["mask"]).sum() / count
        return loss, {}

    policy.zero_grad()
    forward_backward(
        policy.model,
        [MicroBatch(tokens_bl[:, :-1], tokens_bl[:, 1:], extras={"mask": mask_bl})],
        ps,
        loss_fn,
        vocab_size=hf["vocab_size"],
    )
    return policy.step()


def _probe_in_two_passes(model, fleet, ps, probe, vocab_size: int) -> dict[str, float]:
    """The mismatch probe as it ran before its plain and replayed copies shared one forward: a plain
    pass, then (with engine routes) a pass that replays them; the same metrics."""
    from grpo_megatron.models.routing import RoutingPass, reduce_routing_stats
    from grpo_megatron.training.batching import pad_routes
    from grpo_megatron.training.forward_backward import MicroBatch, forward_logprobs
    from grpo_megatron.training.phases.sync import _local_diffs, _probe_diffs

    scored, routes = fleet.score(probe.sequences, probe.prompt_lens, 1.0)
    length = max(len(s) for s in probe.sequences)
    tokens_bl = torch.zeros((len(probe.sequences), length), dtype=torch.long)
    for i, seq in enumerate(probe.sequences):
        tokens_bl[i, : len(seq)] = torch.tensor(seq)
    batch = MicroBatch(tokens_bl[:, :-1], tokens_bl[:, 1:])
    batch.routes_lbsk = None if routes is None else pad_routes(routes, length - 1)
    by_suffix, metrics = {}, {}
    for suffix, replay in (("", False), ("_replay", True)) if routes is not None else (("", False),):
        routing = RoutingPass(model, ps, replay=replay) if routes is not None else None
        (out,) = forward_logprobs(model, [batch], ps, vocab_size=vocab_size, temperature=1.0, routing=routing)
        by_suffix[suffix] = _local_diffs(out.logprobs_bs.float().cpu(), probe, scored)
        if routing is not None and not replay:
            compare_m2, _ = reduce_routing_stats(*routing.stats(), ps)
            if float(compare_m2[:, 1].sum()) > 0:
                metrics["routing/probe_disagreement"] = float(compare_m2[:, 0].sum() / compare_m2[:, 1].sum())
        if routing is not None:
            routing.close()
    return _probe_diffs(by_suffix, ps) | metrics


def sync_cases(cases: dict[str, tuple[str, list[str]]], bad_hf_dir: str) -> dict:
    """Per case (HF config dir, layout overrides): sync, logprobs vs trainer, probe, reproducibility.
    Case "train" also trains one step and syncs again; case "bad" (if present) syncs into engines
    built from another config and records the error."""
    from grpo_megatron.distributed.bootstrap import destroy_distributed
    from grpo_megatron.rollout.engine import SamplingParams
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.training.job import engine_spec
    from grpo_megatron.training.phases.sync import mismatch_probe, probe_batch

    out: dict = {}
    for case, (hf_dir, overrides) in cases.items():
        cfg, ps, hf, policy = _setup(hf_dir, overrides)
        fleet = RolloutFleet.build(engine_spec(cfg), hf, ps)
        res: dict = {"engine_ranks": list(fleet.engine_ranks), "has_engine": fleet.engine is not None}
        metrics = fleet.sync_weights(policy.model, version=1, bucket_bytes=16 << 10)
        res["sync_buckets"] = metrics["sync/buckets"]
        res["sync_bytes"] = metrics["sync/bytes"]
        res["version"] = fleet.engine.weight_version if fleet.engine is not None else None

        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=7)
        completions, res["gen_vs_trainer"] = _rollout_vs_trainer(fleet, policy, ps, hf, params)
        res["tokens"] = _tokens(completions)
        res["same_seed_same"] = _tokens(fleet.generate(PROMPTS, params)) == res["tokens"]
        other = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=8)
        res["other_seed_differs"] = _tokens(fleet.generate(PROMPTS, other)) != res["tokens"]
        batch = probe_batch(PROMPTS, res["tokens"], size=4)
        sequences = batch.sequences
        vocab = int(hf["vocab_size"])
        probe = mismatch_probe(policy.model, fleet, ps, batch, vocab_size=vocab, temperature=1.0)
        res["probe_max"] = probe["mismatch/probe_abs_diff_max"]
        res["probe_tokens"] = probe["mismatch/probe_tokens"]
        res["probe"], res["probe_two_passes"] = (
            probe,
            _probe_in_two_passes(policy.model, fleet, ps, batch, vocab),
        )
        hot = mismatch_probe(policy.model, fleet, ps, batch, vocab_size=vocab, temperature=0.7)
        res["probe_max_t07"] = hot["mismatch/probe_abs_diff_max"]

        if case == "train":
            step = _train_step(policy, ps, hf, [s for s in sequences])
            res["grad_norm"] = step["grad_norm"]
            fleet.sync_weights(policy.model, version=2, bucket_bytes=64 << 10)
            res["version_after_train"] = fleet.engine.weight_version if fleet.engine is not None else None
            after, res["gen_vs_trainer_after"] = _rollout_vs_trainer(fleet, policy, ps, hf, params)
            before_lp = torch.tensor([lp for g in completions for c in g for lp in c.logprobs[:1]])
            after_lp = torch.tensor([lp for g in after for c in g for lp in c.logprobs[:1]])
            res["first_logprob_change"] = float((before_lp - after_lp).abs().max())
            probe = mismatch_probe(policy.model, fleet, ps, batch, vocab_size=vocab, temperature=1.0)
            res["probe_max_after"] = probe["mismatch/probe_abs_diff_max"]

            # Engines built from a different config: the sync must fail on every rank, and these
            # engines keep what they had.
            bad_hf = dataclasses.replace(cfg.model, hf_path=bad_hf_dir).load_hf_config()
            bad = RolloutFleet.build(engine_spec(cfg), bad_hf, ps)
            before = None
            if bad.engine is not None:
                before = {k: v.clone() for k, v in bad.engine.model.state_dict().items()}
            try:
                bad.sync_weights(policy.model, version=3)
                res["bad_error"] = "no error"
            except RuntimeError as exc:
                res["bad_error"] = str(exc)
            if bad.engine is not None:
                res["bad_version"] = bad.engine.weight_version
                res["bad_unchanged"] = all(
                    torch.equal(before[k], v) for k, v in bad.engine.model.state_dict().items()
                )
            bad.shutdown()
            # The good fleet is untouched by the failed one.
            res["version_end"] = fleet.engine.weight_version if fleet.engine is not None else None
        fleet.shutdown()
        out[case] = res
        destroy_distributed(keep_process_group=True)
    return out


def rollout_results_at_scale(hf_dir: str, overrides: list[str]) -> dict:
    """Generate with routes kept, plan the update, deliver each sample's routes (as the GRPO loop
    does): what this rank got. ``tokens``/``logprobs``: every completion's; ``direct``: on an engine
    rank, whether its engine alone gives the same slice bit for bit; ``held``: the routes an engine
    rank kept, by route id; ``routes``: the routes this rank received, by sample index;
    ``owners``/``replica``: the DP rank training each sample and this rank's DP rank."""
    from grpo_megatron.data.records import PromptRecord
    from grpo_megatron.rollout.engine import SamplingParams
    from grpo_megatron.rollout.fleet import RolloutFleet, prompt_slices
    from grpo_megatron.training.job import engine_spec
    from grpo_megatron.training.phases.advantages import build_samples, deliver_engine_routes, plan_update
    from grpo_megatron.training.phases.reward import Group

    cfg, ps, hf, policy = _setup(hf_dir, overrides)
    fleet = RolloutFleet.build(engine_spec(cfg), hf, ps)
    fleet.sync_weights(policy.model, version=1)
    prompts = PROMPTS * 2
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=7, routes=True)
    groups_c = fleet.generate(prompts, params)
    res: dict = {"tokens": _tokens(groups_c), "logprobs": [[c.logprobs for c in g] for g in groups_c]}
    res["routes_in_results"] = any(c.routed_experts is not None for g in groups_c for c in g)
    res["held"] = {rid: t.clone() for rid, t in fleet.held_routes.tensors.items()}
    res["route_ids"] = [[c.route_id for c in g] for g in groups_c]
    res["versions"] = sorted({c.weight_version for g in groups_c for c in g})
    if fleet.engine is not None:
        index = fleet.engine_ranks.index(ps.rank)
        start, end = prompt_slices(len(prompts), fleet.num_engines)[index]
        own = fleet.engine.generate(prompts[start:end], dataclasses.replace(params, seed=params.seed + index))
        res["direct"] = [[(c.token_ids, c.logprobs) for c in g] for g in own] == [
            [(c.token_ids, c.logprobs) for c in g] for g in groups_c[start:end]
        ]
    records = [PromptRecord("", "", {}, tuple(p)) for p in prompts]
    groups = [
        Group(r, cs, [float(i % 2) for i in range(len(cs))], [""] * len(cs))
        for r, cs in zip(records, groups_c, strict=True)
    ]
    batch = build_samples(cfg.algorithm, params.max_new_tokens, groups)
    plan = plan_update(cfg.train, cfg.algorithm, ps, batch.samples)
    deliver_engine_routes(fleet, groups, batch.samples, plan)
    res["routes"] = {k: s.routes["engine"] for k, s in enumerate(batch.samples) if "engine" in s.routes}
    res["owners"], res["replica"] = plan.owners, ps.dp_rank
    res["left_held"] = len(fleet.held_routes.tensors)
    # One engine's share fails (an empty prompt: rank 2's engine refuses it): every rank raises,
    # naming that rank, and the fleet still generates afterwards.
    try:
        fleet.generate([PROMPTS[0], []], params)
    except RuntimeError as exc:
        res["failure"] = str(exc)
    res["after_failure"] = _tokens(fleet.generate(PROMPTS[:2], params))
    res |= _payload_to_owners(cfg, ps, fleet, records)
    fleet.shutdown()
    res["timeouts"] = group_timeouts_minutes()  # every group made so far: megatron's, the fleet's, the world
    res["megatron_missed"] = _megatron_groups_without_their_timeout(cfg)
    return res


def _payload_to_owners(cfg, ps, fleet, records) -> dict:
    """The same rollout with the whole batch on every rank (``payload="everywhere"``), then with each
    replica receiving only what it trains (``payload="owners"`` and ``prepare_update``): the TCP
    bytes this rank received for each, what it held whole after the rollout, and whether its samples
    and plan equal those made from the whole batch, bit for bit."""
    from grpo_megatron.rollout.engine import SamplingParams
    from grpo_megatron.training.phases.advantages import build_samples, plan_update, prepare_update
    from grpo_megatron.training.phases.reward import Group
    from tests.helpers.dist import received_since, tcp_bytes_received

    records = records[:4]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=11)
    max_new = cfg.rollout.response_budget.tokens

    def grouped(completions):
        return [
            Group(r, cs, [float((i + k) % 3) for i in range(len(cs))], [""] * len(cs))
            for k, (r, cs) in enumerate(zip(records, completions, strict=True))
        ]

    out: dict = {}
    start = tcp_bytes_received()
    whole = grouped(fleet.generate([list(r.prompt_ids) for r in records], params))
    out["bytes_everywhere"] = received_since(start)
    reference = build_samples(cfg.algorithm, max_new, whole)
    ref_plan = plan_update(cfg.train, cfg.algorithm, ps, reference.samples)
    start = tcp_bytes_received()
    shared = grouped(fleet.generate([list(r.prompt_ids) for r in records], params, payload="owners"))
    out["bytes_owners_rollout"] = received_since(start)
    out["whole_after_rollout"] = [
        k for k, c in enumerate(c for g in shared for c in g.completions) if c.sizes is None
    ]
    out["sizes_agree"] = [(c.num_tokens, c.num_sampled) for g in shared for c in g.completions] == [
        (len(c.token_ids), len(c.token_ids)) for g in whole for c in g.completions
    ]
    start = tcp_bytes_received()
    batch, plan = prepare_update(cfg.algorithm, cfg.train, max_new, ps, fleet, shared)
    out["bytes_owners_delivery"] = received_since(start)
    out["whole_after_delivery"] = [
        k for k, c in enumerate(c for g in shared for c in g.completions) if c.sizes is None
    ]
    out["mine"] = plan.mine
    mine_ref = sorted({i for r in ref_plan.all_rows for i in r})
    out["plan_same"] = (
        plan.mine == mine_ref
        and plan.owners == ref_plan.owners
        and plan.normalizers == ref_plan.normalizers
        and plan.rows == [[[mine_ref.index(i) for i in r] for r in mb] for mb in ref_plan.rows]
    )
    out["samples_same"] = len(batch.samples) == len(mine_ref) and all(
        torch.equal(a.tokens_s, b.tokens_s)
        and torch.equal(a.labels_s, b.labels_s)
        and torch.equal(a.mask_s, b.mask_s)
        and torch.equal(a.rollout_logprobs_s, b.rollout_logprobs_s)
        and a.advantage == b.advantage
        for a, b in zip(batch.samples, [reference.samples[i] for i in mine_ref], strict=True)
    )
    out["batch_totals"] = (batch.size, batch.tokens, reference.size, reference.tokens)
    out["payload_bytes"] = [
        16 * c.num_tokens + 72 for g in whole for c in g.completions
    ]  # pack's bytes per completion
    out["left_held"] = len(fleet.held_completions.completions)
    return out


def _megatron_groups_without_their_timeout(cfg) -> list[str]:
    """megatron-core's ``initialize_model_parallel`` again, at the same layout and timeout: the groups
    it creates with another timeout than ``distributed_timeout_minutes`` (what
    ``megatron_compat.groups_take_timeout`` corrects in the bootstrap)."""
    from datetime import timedelta

    from megatron.core import parallel_state as mpu

    from grpo_megatron.distributed.megatron_compat import groups_take_timeout

    mpu.destroy_model_parallel()
    with groups_take_timeout(timedelta(minutes=cfg.parallel.timeout_minutes)) as missed:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=cfg.parallel.tp,
            expert_model_parallel_size=cfg.parallel.ep,
            distributed_timeout_minutes=cfg.parallel.timeout_minutes,
        )
    mpu.destroy_model_parallel()
    return missed


def engines_lost_and_restarted(hf_dir: str) -> dict:
    """Issue 41 at the fleet: the last engine process SIGKILLed (and reaped) before a weight sync (phase one
    finds it: restarted inside the sync), during a rollout (``collect``: restarted, the version resynced, its
    share redone), in phase two of a sync (its manifest check skipped here, so the dead pipe shows on the
    closing bucket: restarted and sent the version alone), then once more than rollout.recovery.max_restarts."""
    import os
    import signal

    from grpo_megatron.rollout.engine import SamplingParams
    from grpo_megatron.rollout.fleet import RolloutFleet
    from grpo_megatron.rollout.recovery import Resync
    from grpo_megatron.training.job import engine_spec

    cfg, ps, hf, policy = _setup(hf_dir, ["rollout.embedded_process=true", "rollout.recovery.max_restarts=3"])
    fleet = RolloutFleet.build(engine_spec(cfg), hf, ps, resync=Resync(policy.model))
    recovery = fleet.recovery
    fleet.sync_weights(policy.model, version=1)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=7)
    owner = ps.rank == fleet.engine_ranks[-1]

    def kill_last_engine(skip_check: bool = False) -> None:
        if owner:
            proc = fleet.engine.proc  # type: ignore[union-attr]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            if skip_check:
                fleet.engine.check_manifest = lambda manifest, version: []  # type: ignore[union-attr]

    def restore_check() -> None:
        if owner:
            del fleet.engine.check_manifest  # type: ignore[union-attr]

    res: dict = {}
    kill_last_engine()
    fleet.sync_weights(policy.model, version=2)
    first = fleet.generate(PROMPTS, params)
    res["after_sync_restart"] = recovery.restarts
    kill_last_engine()
    again = fleet.generate(PROMPTS, params)
    res["same"] = _tokens(first) == _tokens(again) and [[c.logprobs for c in g] for g in first] == [
        [c.logprobs for c in g] for g in again
    ]
    res["versions"] = sorted({c.weight_version for g in [*first, *again] for c in g})
    kill_last_engine(skip_check=True)
    fleet.sync_weights(policy.model, version=3)
    restore_check()
    res["versions_3"] = sorted({c.weight_version for g in fleet.generate(PROMPTS, params) for c in g})
    res["restarts"], res["metrics"] = recovery.restarts, recovery.metrics()
    kill_last_engine()
    try:
        fleet.generate(PROMPTS, params)
    except RuntimeError as exc:
        res["past_bound"] = str(exc)
    fleet.shutdown()
    return res
