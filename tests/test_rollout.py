"""Rollout engines and the fleet: the embedded transformers engine in this process, and the fleet with
a real megatron policy on two processes (TP2, EP2, a dense model, a training step, a rejected sync)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_megatron.rollout.engine import Completion, SamplingParams
from grpo_megatron.rollout.fleet import prompt_slices
from grpo_megatron.training.phases.sync import ProbeBatch, probe_batch
from tests.helpers.dist import run_distributed
from tests.helpers.engines import load_weights, saved_model, tiny_engine, write_config
from tests.helpers.tiny_configs import TINY_CONFIGS, tiny_hf_config
from tests.workers.bridge_workers import batch_tokens

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13]]


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    """A qwen3_moe engine holding save_pretrained weights (version 1), and those weights."""
    saved, _ = saved_model("qwen3_moe", tmp_path_factory.mktemp("moe"))
    engine = tiny_engine("qwen3_moe")
    load_weights(engine, saved)
    return engine, saved


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_checkpoint_names_load_into_fused_model(model_type, tmp_path):
    """save_pretrained's per-expert checkpoint tensors, loaded by name into transformers' fused
    in-memory experts, give the saved model's logits exactly (all five architectures)."""
    from transformers import AutoModelForCausalLM

    saved, ref = saved_model(model_type, tmp_path)
    engine = tiny_engine(model_type)
    expected = set(engine.expected_tensors())
    tied = {"lm_head.weight"} if TINY_CONFIGS[model_type]["tie_word_embeddings"] else set()
    assert expected == set(saved) | tied
    load_weights(engine, saved)
    assert engine.weight_version == 1
    # Like with like: transformers loading the same files with the engine's own kernel choices
    # (eager experts on CPU) must give bit-identical logits, so every tensor landed where it belongs.
    same_kernels = AutoModelForCausalLM.from_pretrained(tmp_path / model_type, **engine.model_kwargs).eval()
    with torch.no_grad():
        logits = engine.model(batch_tokens()).logits
        assert torch.equal(logits, same_kernels(batch_tokens()).logits)
    # save_tiny_model's reference runs the same kernels (reference_kwargs), so it is bit-equal too.
    assert torch.equal(logits, ref["logits"])


def test_engine_leaves_global_rng_alone(moe_engine):
    engine, _ = moe_engine
    state = torch.get_rng_state()
    tiny_engine("qwen3")
    engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=3, seed=None))
    engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=3, seed=1))
    assert torch.equal(state, torch.get_rng_state())


def test_seeded_generation(moe_engine):
    engine, _ = moe_engine
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=11)
    first = engine.generate(PROMPTS, params)
    assert [len(group) for group in first] == [4] * len(PROMPTS)
    assert all(
        len(c.token_ids) == len(c.logprobs) == 8 and c.finish_reason == "length" for g in first for c in g
    )
    tokens = [[c.token_ids for c in g] for g in first]
    assert [[c.token_ids for c in g] for g in engine.generate(PROMPTS, params)] == tokens
    other = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=12)
    assert [[c.token_ids for c in g] for g in engine.generate(PROMPTS, other)] != tokens
    # Decoding a few rows at a time is seeded and deterministic too.
    chunked_engine_rows = engine.max_batch_rows
    engine.max_batch_rows = 5
    try:
        chunked = [[c.token_ids for c in g] for g in engine.generate(PROMPTS, params)]
        assert chunked == [[c.token_ids for c in g] for g in engine.generate(PROMPTS, params)]
    finally:
        engine.max_batch_rows = chunked_engine_rows


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_logprobs_equal_teacher_forced_scores(moe_engine, temperature):
    """Left-padded, KV-cached sampling reports the logprobs an unpadded forward computes (without
    truncation: with it the sampled logprobs are the truncated distribution's, tests/test_truncation.py)."""
    engine, _ = moe_engine
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=7, seed=3)
    completions = engine.generate(PROMPTS, params)
    probe = probe_batch(PROMPTS, [[c.token_ids for c in g] for g in completions], size=100)
    scored = engine.score(probe.sequences, probe.prompt_lens, temperature)
    sampled = [c.logprobs for g in completions for c in g]
    for got, want in zip(sampled, scored, strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)


def test_ragged_prefill_samples_what_an_unpadded_forward_scores(moe_engine):
    """SamplingParams.ragged_prefill (a continuous round: short new prompts beside long continued ones):
    prefilled in batches of similar lengths, decoded as one batch; each row's sampled logprobs are
    still those of an unpadded forward, its budget kept, and greedy tokens those of the plain path."""
    engine, _ = moe_engine
    prompts = [[3, 5], [7, 7, 20], [9] * 30 + [4], [2, 8] * 12, [11]]
    budgets = (4, 6, 3, 5, 6)
    params = SamplingParams(
        n=1, temperature=1.0, max_new_tokens=6, max_new_tokens_each=budgets, seed=3, ragged_prefill=True
    )
    completions = engine.generate(prompts, params)
    assert [len(c.token_ids) for (c,) in completions] == list(budgets)
    probe = probe_batch(prompts, [[c.token_ids] for (c,) in completions], size=100)
    scored = engine.score(probe.sequences, probe.prompt_lens, 1.0)
    for (c,), want in zip(completions, scored, strict=True):
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(want), atol=1e-5)
    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=6)
    ragged = engine.generate(prompts, dataclasses.replace(greedy, ragged_prefill=True))
    assert [g[0].token_ids for g in ragged] == [engine.generate([p], greedy)[0][0].token_ids for p in prompts]


def test_greedy_ignores_seed_and_stops_at_stop_token(moe_engine):
    engine, _ = moe_engine
    greedy = SamplingParams(n=2, max_new_tokens=10, greedy=True, seed=1)
    base = engine.generate(PROMPTS, greedy)
    again = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=10, greedy=True, seed=2))
    assert [[c.token_ids for c in g] for g in base] == [[c.token_ids for c in g] for g in again]
    assert base[0][0].token_ids == base[0][1].token_ids
    row = base[1][0].token_ids
    stop = row[2]
    cut = row.index(stop) + 1
    stopped = engine.generate(
        PROMPTS, SamplingParams(n=1, max_new_tokens=10, greedy=True, stop_token_ids=(stop,))
    )
    assert stopped[1][0].token_ids == row[:cut]  # the stop token is kept
    assert stopped[1][0].finish_reason == "stop"
    for prompt_out, full in zip(stopped, base, strict=True):  # other rows: cut at their own first stop
        ids = full[0].token_ids
        want = ids[: ids.index(stop) + 1] if stop in ids else ids
        assert prompt_out[0].token_ids == want


def _char_tokenizer(vocab_size: int):
    """A real fast tokenizer (tokenizers WordLevel) with one character per token id."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(ord("A") + i) for i in range(vocab_size)]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="A"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_stop_strings(moe_engine):
    engine, _ = moe_engine
    greedy = SamplingParams(n=1, max_new_tokens=10, greedy=True)
    row = engine.generate(PROMPTS[:1], greedy)[0][0].token_ids
    tokenizer = _char_tokenizer(TINY_CONFIGS["qwen3_moe"]["vocab_size"])
    stop_text = tokenizer.decode(row[2:4])
    with pytest.raises(ValueError, match="stop_strings needs a tokenizer"):
        engine.generate(
            PROMPTS[:1], SamplingParams(max_new_tokens=10, greedy=True, stop_strings=(stop_text,))
        )
    engine.tokenizer = tokenizer
    try:
        out = engine.generate(
            PROMPTS[:1], SamplingParams(max_new_tokens=10, greedy=True, stop_strings=(stop_text,))
        )
    finally:
        engine.tokenizer = None
    text = tokenizer.decode(row)
    end = text.index(stop_text) + len(stop_text)  # one character per token
    assert out[0][0].token_ids == row[:end]
    assert out[0][0].finish_reason == "stop"


def test_sample_next_filters_and_logprob_convention():
    from grpo_megatron.rollout.embedded import sample_next

    logits_rv = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    want_lp = torch.log_softmax(logits_rv / 0.7, dim=-1)
    for params in (
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=0.7, top_p=1e-6),
        SamplingParams(temperature=0.7, greedy=True),
    ):
        token_r, lp_r = sample_next(logits_rv, params, torch.Generator().manual_seed(1))
        assert torch.equal(token_r, logits_rv.argmax(-1))
        # truncated to one token: probability 1 (algorithm/truncation.py); greedy: the full distribution's
        want = want_lp.gather(-1, token_r[:, None])[:, 0] if params.greedy else torch.zeros(6)
        assert torch.allclose(lp_r, want)
    # top_k=3: only the three most likely tokens are ever drawn.
    top3 = torch.topk(logits_rv, 3, dim=-1).indices
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        token_r, _ = sample_next(logits_rv, SamplingParams(temperature=0.7, top_k=3), gen)
        assert bool((top3 == token_r[:, None]).any(-1).all())


def test_rejected_updates_keep_the_old_weights(moe_engine):
    engine, saved = moe_engine
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    names = sorted(saved)
    gate = "model.layers.1.mlp.experts.2.gate_proj.weight"
    cases = {
        "missing": ([(n, saved[n]) for n in names if n != gate], f"missing ['{gate}']"),
        "misshapen": ([(n, saved[n][:-1] if n == gate else saved[n]) for n in names], "wrong shapes"),
        "dtype": ([(n, saved[n].double() if n == gate else saved[n]) for n in names], "wrong dtypes"),
        "unexpected": ([*((n, saved[n]) for n in names), ("model.extra.weight", saved[gate])], "unexpected"),
    }
    for case, (bucket, message) in cases.items():
        engine.update_weights(bucket[:5], version=7, last=False)
        with pytest.raises(ValueError, match="rejected, the engine keeps v1") as err:
            engine.update_weights(bucket[5:], version=7, last=True)
        assert message in str(err.value), case
        assert gate in str(err.value) or case == "unexpected"
        assert engine.weight_version == 1
        assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items()), case
    with pytest.raises(ValueError, match="sent twice"):
        engine.update_weights([(gate, saved[gate])], version=8, last=False)
        engine.update_weights([(gate, saved[gate])], version=8, last=True)
    # A new version after a failed one starts clean, and a good update still commits.
    changed = {n: t + 0.5 if n == gate else t for n, t in saved.items()}
    load_weights(engine, changed, version=9)
    assert engine.weight_version == 9
    assert torch.equal(engine.model.model.layers[1].mlp.experts.gate_up_proj[2, :32], changed[gate])
    load_weights(engine, saved, version=10)
    # A narrower float is widened exactly (a bf16 export into tensors transformers keeps in fp32).
    load_weights(engine, {n: t.bfloat16() if n == gate else t for n, t in saved.items()}, version=11)
    assert torch.equal(
        engine.model.model.layers[1].mlp.experts.gate_up_proj[2, :32], saved[gate].bfloat16().float()
    )
    load_weights(engine, saved, version=12)


def test_manifest_check_then_load_in_place(moe_engine):
    """The fleet's path: the engine judges a manifest (names, shapes, dtypes) before any byte, keeping
    its version on a rejection; an accepted version is copied straight into the live weights (partial,
    version -1, until the last bucket), a place offered by ``load_target`` is taken as is, and a tensor
    outside the manifest leaves the weights marked partial."""
    engine, saved = moe_engine
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    names = sorted(saved)
    gate = "model.layers.1.mlp.experts.2.gate_proj.weight"
    manifest = [(n, tuple(saved[n].shape), saved[n].dtype) for n in names]
    bad = [(n, shape[:-1] + (shape[-1] - 1,) if n == gate else shape, dt) for n, shape, dt in manifest]
    (problem,) = engine.check_manifest(bad, version=20)
    assert "rejected, the engine keeps v12" in problem and "wrong shapes" in problem and gate in problem
    assert "listed twice" in engine.check_manifest([*manifest, manifest[0]], version=20)[0]
    engine.abort_update(20)
    assert engine.weight_version == 12 and engine.load_target(gate) is None  # nothing accepted: no place
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())

    changed = {n: t + 0.25 for n, t in saved.items()}
    assert engine.check_manifest(manifest, version=21) == []
    place = engine.load_target(gate)  # the transport writes there itself, then hands on the place
    assert place is not None and engine.weight_version == -1
    place.copy_(changed[gate])
    engine.update_weights(
        [(gate, place), *((n, changed[n]) for n in names[:5] if n != gate)], version=21, last=False
    )
    assert engine.weight_version == -1
    engine.update_weights([(n, changed[n]) for n in names[5:] if n != gate], version=21, last=True)
    assert engine.weight_version == 21
    assert torch.equal(engine.model.model.layers[1].mlp.experts.gate_up_proj[2, :32], changed[gate])
    assert engine.check_manifest(manifest, version=22) == []  # the same manifest: accepted again
    with pytest.raises(ValueError, match="outside its manifest"):
        engine.update_weights([("model.extra.weight", saved[gate])], version=22, last=False)
    assert engine.weight_version == -1  # partial: nothing to fall back on, the fleet raises everywhere
    load_weights(engine, saved, version=12)  # a full staged update brings it back


def test_tied_lm_head_may_be_absent(tmp_path):
    saved, ref = saved_model("qwen3", tmp_path)
    assert "lm_head.weight" not in saved
    engine = tiny_engine("qwen3")
    load_weights(engine, saved)
    with torch.no_grad():
        # Bit equality holds: qwen3 is dense, so the engine and the reference run the same kernels.
        assert torch.equal(engine.model(batch_tokens()).logits, ref["logits"])


def test_prompt_slices_and_probe_batch():
    assert prompt_slices(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert prompt_slices(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    groups = [
        [Completion([5], [-1.0], "length"), Completion([], [], "stop")],
        [Completion([6, 7], [0, 0], "stop")],
    ]
    responses = [[c.token_ids for c in g] for g in groups]
    assert probe_batch([[1], [2, 3]], responses, size=5) == ProbeBatch([[1, 5], [2, 3, 6, 7]], [1, 2])
    assert probe_batch([[1], [2, 3]], responses, size=1) == ProbeBatch([[1, 5]], [1])


@pytest.mark.launches
@pytest.mark.timeout(400)
def test_fleet_sync_generate_probe_train_on_two_ranks(tmp_path):
    """At TP2 (MoE, then dense with tied embeddings) and EP2 (two engines: the second gets the
    weights by broadcast): after a sync the engines' sampled and scored logprobs equal the trainer's
    within 1e-4; after a training step and another sync they change and still match; engines built
    from another config reject the sync on every rank and keep their weights. (The fleet with SGLang's
    real engine: tests/test_sglang_train.py.)"""
    moe = write_config(tmp_path / "moe", tiny_hf_config("qwen3_moe"))
    dense = write_config(tmp_path / "dense", tiny_hf_config("qwen3"))
    bad = write_config(tmp_path / "bad", tiny_hf_config("qwen3_moe", moe_intermediate_size=16))
    cases = {
        "train": (moe, ["parallel.tp=2"]),
        "ep2": (moe, ["parallel.ep=2"]),
        "dense_tp2": (dense, ["parallel.tp=2"]),
    }
    results = run_distributed(
        "tests.workers.rollout_workers:sync_cases",
        world_size=2,
        timeout_s=380,
        cases=cases,
        bad_hf_dir=bad,
    )
    for case in cases:
        per_rank = [r[case] for r in results]
        for res in per_rank:
            assert res["gen_vs_trainer"] < 1e-4, (case, res["gen_vs_trainer"])
            assert res["probe_max"] < 1e-4 and res["probe_max_t07"] < 1e-4, case
            assert res["same_seed_same"] and res["other_seed_differs"], case
            assert res["sync_bytes"] > 0 and res["sync_buckets"] > 1, case  # 16 KiB buckets: several
            # The probe's plain and replayed copies in one forward: the figures of two passes.
            assert res["probe"].keys() == res["probe_two_passes"].keys(), case
            assert all(abs(v - res["probe_two_passes"][k]) < 1e-7 for k, v in res["probe"].items()), case
        assert per_rank[0]["tokens"] == per_rank[1]["tokens"], case  # every rank gets every result
        engines = [res["version"] for res in per_rank if res["has_engine"]]
        assert engines == [1] * len(per_rank[0]["engine_ranks"]), case
    assert results[0]["ep2"]["engine_ranks"] == [0, 1]  # DP2 through EP: one engine per replica
    assert results[0]["train"]["engine_ranks"] == [0] and results[0]["dense_tp2"]["engine_ranks"] == [0]
    assert results[0]["ep2"]["probe_tokens"] == 2 * results[0]["train"]["probe_tokens"]  # both engines probed

    train = results[0]["train"]
    assert train["version_after_train"] == 2 and train["version_end"] == 2
    assert train["first_logprob_change"] > 1e-3
    assert train["gen_vs_trainer_after"] < 1e-4 and train["probe_max_after"] < 1e-4
    for res in results:
        assert "weight sync of version 3 rejected" in res["train"]["bad_error"]
        assert (
            "wrong shapes" in res["train"]["bad_error"] and "experts.0.gate_proj" in res["train"]["bad_error"]
        )
    assert train["bad_version"] == -1 and train["bad_unchanged"]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_generate_reports_each_fed_token_routes(model_type, tmp_path):
    """Completion.routed_experts: [moe layers, prompt + response - 1, top_k], dense layers skipped,
    and every position (prompt prefill, then one decode step per response token) holds the experts a
    plain teacher-forced forward of the whole sequence chooses: the KV-cached decode and the left
    padding put each token's routes where the trainer's inputs are."""
    from grpo_megatron.rollout.hf_routes import RouteLayout

    saved, _ = saved_model(model_type, tmp_path)
    engine = tiny_engine(model_type)
    load_weights(engine, saved)
    layout = RouteLayout.from_hf(tiny_hf_config(model_type))
    assert layout is not None
    n_moe = len(layout.moe_layers)
    assert n_moe == (1 if model_type == "deepseek_v3" else 2)  # first_k_dense_replace=1
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=3, routes=True)
    groups = engine.generate(PROMPTS, params)
    sequences = [list(p) + c.token_ids for p, cs in zip(PROMPTS, groups, strict=True) for c in cs]
    _, scored = engine.score_with_routes(sequences, [len(p) for p in PROMPTS for _ in range(2)], 1.0)
    assert scored is not None
    completions = [c for cs in groups for c in cs]
    for seq, c, ref in zip(sequences, completions, scored, strict=True):
        routes = c.routed_experts
        assert routes is not None and routes.shape == (n_moe, len(seq) - 1, layout.top_k)
        assert 0 <= int(routes.min()) and int(routes.max()) < layout.num_experts
        assert torch.equal(routes.sort(-1).values, ref.sort(-1).values)


def test_routes_only_when_asked(moe_engine):
    """record_routes=False (routing replay off): the same responses without routes, asked or not;
    scoring still reports them (the mismatch probe's routing figures). An engine that records routes
    reports them only for requests that ask (SamplingParams.routes: the training rollouts under r3)."""
    engine, saved = moe_engine
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=5, routes=True)
    quiet = tiny_engine("qwen3_moe", record_routes=False)
    load_weights(quiet, saved)
    groups = quiet.generate(PROMPTS, params)
    assert all(c.routed_experts is None for g in groups for c in g)
    assert quiet.score_with_routes([list(PROMPTS[0]) + [1]], [len(PROMPTS[0])], 1.0)[1] is not None
    recorded = engine.generate(PROMPTS, params)
    assert all(c.routed_experts is not None for g in recorded for c in g)
    assert [[c.token_ids for c in g] for g in groups] == [[c.token_ids for c in g] for g in recorded]
    unasked = engine.generate(PROMPTS, dataclasses.replace(params, routes=False))
    assert all(c.routed_experts is None for g in unasked for c in g)
    assert [[c.token_ids for c in g] for g in unasked] == [[c.token_ids for c in g] for g in recorded]


@pytest.mark.launches
@pytest.mark.timeout(400)
def test_rollout_results_reach_each_rank_as_it_needs_them_at_world_4(tmp_path):
    """TP2 x DP2 on 4 ranks, two engines (ranks 0 and 2): every rank gets every completion's tokens
    and logprobs, bit for bit what its engine sampled; routes travel only after the update's plan,
    and each rank receives exactly the routes of the samples its data-parallel replica trains. When
    one engine's share fails, every rank raises naming it, and the fleet generates afterwards. With
    ``payload="owners"`` each replica receives only its responses (``_each_replica_receives_its_share``);
    and every process group of the job, megatron's included, has parallel.timeout_minutes."""
    moe = write_config(tmp_path / "moe", tiny_hf_config("qwen3_moe"))
    per_rank = run_distributed(
        "tests.workers.rollout_workers:rollout_results_at_scale",
        world_size=4,
        timeout_s=380,
        hf_dir=moe,
        overrides=["parallel.tp=2", "algorithm.routing_replay=r3", "parallel.timeout_minutes=97"],
    )
    first = per_rank[0]
    held = {rid: t for r in per_rank for rid, t in r["held"].items()}
    assert [bool(r["held"]) for r in per_rank] == [True, False, True, False]  # only the engines' ranks
    sample_rids = [rid for g in first["route_ids"] for rid in g]
    assert sorted(held) == sorted(sample_rids)
    for rank, res in enumerate(per_rank):
        assert res["tokens"] == first["tokens"] and res["logprobs"] == first["logprobs"], rank
        assert res["route_ids"] == first["route_ids"] and not res["routes_in_results"]
        assert res["versions"] == [1], rank  # the weight version that sampled them travels too
        assert res.get("direct", True), rank  # the fleet returns what the engine sampled, bit for bit
        mine = {k for k, d in enumerate(res["owners"]) if d == res["replica"]}
        assert set(res["routes"]) == mine and 0 < len(mine) < len(sample_rids), rank  # its share, no other
        assert all(torch.equal(res["routes"][k], held[sample_rids[k]]) for k in mine), rank
        assert res["left_held"] == 0
        assert res["failure"].startswith(
            "rollout generate failed on 1 rank(s):\n  rank 2: ValueError: generate:"
        ), rank
        assert res["after_failure"] == first["after_failure"] and len(res["after_failure"]) == 2, rank
    assert {r["replica"] for r in per_rank} == {0, 1}
    _each_replica_receives_its_share(per_rank)
    for rank, res in enumerate(per_rank):  # issue 36: every group takes parallel.timeout_minutes (97 here)
        assert {desc: set(minutes) for desc, minutes in res["timeouts"].items()} == {
            desc: {97.0} for desc in res["timeouts"]
        }, (rank, res["timeouts"])
        assert {"default_pg", "ROLLOUT_DATA", "EXPERT_DATA_PARALLEL_GROUP_GLOO"} <= set(res["timeouts"]), rank
        assert ("ROLLOUT_ENGINES" in res["timeouts"]) == (rank in (0, 2)), (
            rank
        )  # NCCL-style: its members only
        # megatron-core 0.16.1 alone gives this one torch's 30 minutes (megatron_compat.groups_take_timeout)
        assert res["megatron_missed"] == ["EXPERT_DATA_PARALLEL_GROUP_GLOO"], rank


def _each_replica_receives_its_share(per_rank: list[dict]) -> None:
    """``payload="owners"`` (issue 36): after the rollout rank 0 holds every response whole (it scores
    and logs them), an engine's rank its engine's, the others headers only (72 bytes each); after the
    update's plan each rank receives exactly its replica's responses, and its samples and plan equal
    those made from the whole batch bit for bit. The TCP bytes each rank received (the kernel's
    count) match: a rank that neither runs an engine nor collects receives the headers and its
    share, not the batch."""
    count = len(per_rank[0]["payload_bytes"])
    engine_of = {0: set(range(count // 2)), 2: set(range(count // 2, count))}  # engines on ranks 0 and 2
    headers = 72 * count
    for rank, res in enumerate(per_rank):
        held = set(range(count)) if rank == 0 else engine_of.get(rank, set())
        assert res["whole_after_rollout"] == sorted(held), rank
        assert res["whole_after_delivery"] == sorted(held | set(res["mine"])), rank
        assert res["plan_same"] and res["samples_same"] and res["sizes_agree"], rank
        assert res["batch_totals"][:2] == res["batch_totals"][2:] and res["left_held"] == 0, rank
        payload = res["payload_bytes"]
        expected = sum(payload[i] for i in res["mine"] if i not in held)
        assert 0 <= res["bytes_owners_delivery"] - expected <= 512, (
            rank,
            res["bytes_owners_delivery"],
            expected,
        )
        if rank in (1, 3):  # the whole batch everywhere, headers only with owners (gloo's framing aside)
            saved = res["bytes_everywhere"] - res["bytes_owners_rollout"]
            assert abs(saved - (sum(payload) - headers)) <= 512, (rank, saved, sum(payload) - headers)
            assert res["bytes_owners_rollout"] + res["bytes_owners_delivery"] < res["bytes_everywhere"], rank


def test_rollout_results_layout_round_trips_every_field():
    """``rollout/results.py``: what the fixed layout carries comes back bit for bit (loss masks of
    multi-turn trajectories, weight versions, float logprobs) and routes only as their shape."""
    from grpo_megatron.rollout.results import pack, unpack

    routes = torch.randint(0, 8, (2, 6, 2), dtype=torch.int16)
    sent = [
        Completion([5, 6, 7], [-0.1, -1e-30, -2.5], "stop", routes, loss_mask=[1, 0, 1], weight_version=3),
        Completion([], [], "length", weight_version=0),
        Completion([9], [float(torch.tensor(-0.3, dtype=torch.float32))], "length", weight_version=-1),
    ]
    got, shapes = unpack(*pack(sent), len(sent))
    for a, b in zip(sent, got, strict=True):
        assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
        assert (a.loss_mask, a.weight_version, b.routed_experts) == (b.loss_mask, b.weight_version, None)
    assert shapes == [((2, 6, 2), torch.int16), None, None]
    # The headers alone (what every rank but the collector gets with payload="collector"/"owners"):
    # sizes, finish, version and route shapes; payload_numel sizes a receive buffer of pack's layout.
    from grpo_megatron.rollout.results import HEADER, fill, payload_numel, unpack_headers

    ints, logprobs = pack(sent)
    heads, head_shapes = unpack_headers(ints[: len(sent) * HEADER], len(sent))
    assert head_shapes == shapes
    for a, h in zip(sent, heads, strict=True):
        assert (h.token_ids, h.logprobs, h.loss_mask) == ([], [], None)
        assert (h.num_tokens, h.num_sampled, h.finish_reason, h.weight_version) == (
            a.num_tokens,
            a.num_sampled,
            a.finish_reason,
            a.weight_version,
        )
    assert [h.sizes for h in heads] == [(3, 2), (0, 0), (1, 1)]
    rows = ints[: len(sent) * HEADER].view(len(sent), HEADER).tolist()
    assert payload_numel(rows) == (ints.numel(), logprobs.numel())
    assert payload_numel(rows[2:]) == tuple(t.numel() for t in pack(sent[2:]))
    fill(heads[0], got[0])
    assert (heads[0].token_ids, heads[0].loss_mask, heads[0].sizes) == ([5, 6, 7], [1, 0, 1], None)


def test_transfer_pairs_send_each_item_once_to_each_rank_that_lacks_it():
    from grpo_megatron.rollout.results import transfer_pairs

    needs = {0: [1, 2, 3], 1: [0, 1], 2: [2, 3], 3: [2, 2]}
    source = {0: 0, 1: 2, 2: 2, 3: 0}
    assert transfer_pairs(needs, source) == {
        (0, 1): [0],
        (0, 2): [0, 3],
        (0, 3): [0],
        (2, 0): [1],
        (2, 1): [1],
        (2, 3): [2],
    }
    # rank 0 (the collector) holds every item already: nothing is sent to it
    assert transfer_pairs(needs, source, (0,)) == {
        (0, 1): [0],
        (0, 2): [0, 3],
        (0, 3): [0],
        (2, 1): [1],
        (2, 3): [2],
    }


def test_an_interrupted_engine_ends_each_row_after_its_current_step(moe_engine):
    """Issue 51 item 5: ``interrupt`` (a preemption signal's watcher, from another thread) ends the
    generation after the step each row is at: every row keeps at least one token, none runs on; a
    generation started while interrupted stops after its first step; ``interrupt(False)`` ends it."""
    import threading

    moe_engine, _ = moe_engine
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=1)
    prompts = [[1, 5, 9, 3], [1, 7, 7]]
    full = moe_engine.generate(prompts, params)
    assert all(len(c.token_ids) == 24 for g in full for c in g)
    moe_engine.interrupt()
    try:
        assert [len(c.token_ids) for g in moe_engine.generate(prompts, params) for c in g] == [1, 1, 1, 1]
    finally:
        moe_engine.interrupt(False)
    steps = []
    original = moe_engine.model.forward

    def forward(*args, **kwargs):  # the interrupt arrives from another thread during the 4th step
        steps.append(1)
        if len(steps) == 4:
            threading.Thread(target=moe_engine.interrupt).start()
            threading.Event().wait(0.2)
        return original(*args, **kwargs)

    moe_engine.model.forward = forward
    try:
        cut = moe_engine.generate(prompts, params)
    finally:
        del moe_engine.model.forward
        moe_engine.interrupt(False)
    assert [len(c.token_ids) for g in cut for c in g] == [4] * 4, cut
    assert [c.token_ids for g in cut for c in g] == [c.token_ids[:4] for g in full for c in g]
