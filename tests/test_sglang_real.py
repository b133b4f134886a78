"""The SGLang adapter against SGLang's real engine (0.5.23, on CPU), not against our reading of it.

One engine start serves every scenario: ``tests/workers/sglang_workers.py`` runs them in a process of
its own (a crash of SGLang's scheduler kills the process tree that started it) and reports what each
measured; each test here checks one scenario. The bf16 noise floor is measured in the same run: the
embedded (transformers) engine in bf16 against itself in fp32 on the same weights and sequences.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.sglang_env import ENGINE_TIMEOUT_S, require_sglang_engine

pytestmark = pytest.mark.launches  # every test here: a job, the real engine or ranks of their own

ROOT = Path(__file__).resolve().parents[1]
FLOOR_FACTOR = 2.0
"""Two bf16 implementations of one model differ from the fp32 reference by different roundings: the
engine's distance to fp32 may be up to this many times the embedded engine's (measured: 1.56x)."""


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict[str, Any]:
    require_sglang_engine()
    work = tmp_path_factory.mktemp("sglang_real")
    out = work / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.workers.sglang_workers", str(out), str(work)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    results = json.loads(out.read_text()) if out.is_file() else {}
    if proc.returncode != 0 or not results:
        pytest.fail(f"the SGLang worker exited {proc.returncode}; last output:\n{proc.stderr[-4000:]}")
    return results


def scenario(results: dict[str, Any], name: str) -> dict[str, Any]:
    got = results.get(name)
    assert got is not None, f"scenario {name} did not run (the worker stopped before it)"
    assert "error" not in got, f"scenario {name} failed: {got['error']}"
    return got


def test_the_engine_starts_through_the_adapter_with_the_compat_fixes(scenarios) -> None:
    start = scenario(scenarios, "start")
    assert "torchvision_missing_ops" in start["compat_applied"]
    assert start["update_sessions"] is True  # 0.5.23 has begin/end_weight_update
    assert start["tied_head"] is True


def test_greedy_generation_equals_the_embedded_engine_within_the_bf16_floor(scenarios) -> None:
    got = scenario(scenarios, "greedy_vs_embedded")
    assert got["same_tokens"]
    assert got["bf16_floor"] > 0
    assert got["sglang_vs_fp32"] <= FLOOR_FACTOR * got["bf16_floor"], got
    assert got["max_dlogprob"] <= 2 * FLOOR_FACTOR * got["bf16_floor"], got
    # A tied checkpoint served without its head would be uniform (log 1/32 = -3.47 per token).
    assert got["mean_logprob"] > -2.5


def test_the_trainers_signal_handlers_survive_the_engine(scenarios) -> None:
    assert scenario(scenarios, "signals_kept") == {
        "sigterm_is_the_trainers": True,
        "sigquit_names_the_engine": True,
        "loop_handlers_removed": [True, True],
        "sigterm_during_a_request": True,
        "engine_not_draining": True,
        "serves_after": True,
    }


def test_sampled_logprobs_equal_the_engines_and_the_embedded_scores(scenarios) -> None:
    floor = scenario(scenarios, "greedy_vs_embedded")["bf16_floor"]
    got = scenario(scenarios, "sampled_and_scored")
    assert got["groups"] == 6 and got["samples"] == 24
    assert got["distinct_samples"] > 6  # the n samples of a prompt differ
    assert got["all_logprobs_valid"]
    # Against SGLang's own score of the same sequences (decode against prefill), as in the multi-turn
    # test: every token but at most one within the bf16 floor. One near-tie token may round otherwise
    # in the two batch shapes: seen with the AVX2 build (torch's 256-bit bf16 paths), deterministically
    # 0.1498 against a floor of 0.0514, every other token within it (other seeds: 0.047, 0.047, and one
    # token of 0.204).
    own = got["sampled_vs_own_top3"]
    assert own[1] <= FLOOR_FACTOR * floor and own[0] < 2.0, got
    # Against the embedded engine's fp32 score of the same sequences (as the greedy test: the engine's
    # distance to fp32): every token but at most one within twice the bf16 floor's bound. One sampled
    # token whose router sits on a near-tie may take another expert (what routing replay exists for)
    # and move by about 1. Not against the embedded engine in bf16, a second bf16 implementation with
    # near-ties of its own: on an AVX2 EPYC its bf16 scores sat 1.16 and 0.30 from SGLang's on two
    # tokens, deterministically, where SGLang's stayed within 0.106 of fp32 on every token.
    top = got["sampled_vs_fp32_top3"]
    assert top[1] <= 2 * FLOOR_FACTOR * floor and top[0] < 2.0, got


def test_a_version_through_the_flattened_bucket_transport_is_bit_exact(scenarios) -> None:
    """SGLang has no get_weights_by_name for its Qwen models (only Llama, Granite, OPT, ...): the
    read-back is its own disk loader on the same weights, compared output for output, bit for bit."""
    got = scenario(scenarios, "flattened_bucket_update")
    assert got["disk_load_ok"] and got["version"] == 2
    assert got["b_differs_from_a"]
    assert got["adapter_equals_disk_bitwise"]
    assert got["back_to_a_bitwise"]


def test_a_tied_model_gets_its_output_head_from_the_adapter(scenarios) -> None:
    """With a zero lm_head (what SGLang's Qwen3-MoE holds for a tied checkpoint) every next-token
    distribution is uniform; the adapter's next version (embedding sent as lm_head) restores it."""
    got = scenario(scenarios, "named_tensor_head")
    assert got["zero_head_uniform"] < 1e-5
    assert got["restored_bitwise"]


def test_a_refused_bucket_leaves_the_engine_on_its_version(scenarios) -> None:
    got = scenario(scenarios, "rejected_version")
    assert got == {"refused_naming_tensor": True, "version_kept": True, "outputs_kept_bitwise": True}


def test_release_and_resume_in_the_trainers_order_from_the_first_sync(scenarios) -> None:
    """The run's first sync resumes ``weights`` the engine never released: SGLang's scheduler would
    raise KeyError and kill the trainer; the adapter resumes only what it released."""
    got = scenario(scenarios, "memory_in_trainer_order")
    assert got["released"] == ["cuda_graph", "kv_cache", "weights"]
    assert got["generate_refused_while_released"]
    assert got["first_sync_bitwise"] and got["after_cycle_bitwise"]
    assert got["nothing_left_released"]


def test_colocated_memory_moves_the_real_engine_by_the_placements_phases(scenarios) -> None:
    """training/offload.py:ColocatedMemory in the trainer's order (start-up, sync, probe, rollout, train,
    save) with rollout/placement.py's phases: the engine releases all its memory for training with and
    without trainer offload, takes its weights back for the sync and its caches for the probe, keeps
    its weights through a save; the trainer's state is off the device while the engines are built;
    generation after every cycle is the engine's own, bit for bit."""
    got = scenario(scenarios, "phases_in_trainer_order")
    cycle = [
        ("sync", ["cuda_graph", "kv_cache"]),
        ("probe", []),
        ("rollout", []),
        ("train", ["cuda_graph", "kv_cache", "weights"]),
    ]
    for mode in ("resident", "offload"):
        run = got[mode]
        steps = [tuple(s) for s in run["steps"]]
        assert steps[:9] == [
            ("start-up, then train", ["cuda_graph", "kv_cache", "weights"]),
            *cycle,
            *cycle,
        ], mode
        save = ["cuda_graph", "kv_cache"] if mode == "offload" else []  # the save keeps the engine's weights
        assert steps[9:] == [("save", save), ("rollout", [])], mode
        assert run["trainer_bytes_while_engines_start"] == 0 and run["trainer_bytes_in_train"] > 0, mode
        assert (run["grad_bytes_in_save"] == 0) is (mode == "offload"), mode  # a save reads no gradients
        assert run["bitwise"], mode


def test_kept_kv_serves_a_continued_response_from_the_prefix_cache_across_a_weight_update(scenarios) -> None:
    """rollout.partial.keep_kv: after a load that keeps the cache, each continued request finds its
    prompt and first segment in SGLang's prefix cache (all but the last token, which was never fed);
    a load past max_staleness flushes it. The continued tokens carry the new version, and their
    logprobs are the new weights' over the kept (old) KV: on average within the bf16 floor of that
    float32 reference, and far from the one over recomputed KV (measured: mean 0.076 against 3.25;
    single tokens move more, up to 1.29: bf16 KV built token by token under other weights, and MoE
    router near-ties, as in the sampled test above)."""
    floor = scenario(scenarios, "greedy_vs_embedded")["bf16_floor"]
    got = scenario(scenarios, "kept_prefix_kv")
    assert got["cached_tokens"] == [n - 1 for n in got["prompt_tokens"]], got
    assert got["cached_after_flush"] == [0] * len(got["prompt_tokens"]), got
    assert got["oldest_after_21"] == 20
    assert got["versions"] == [[20] * 6, [21] * 6]
    assert got["vs_stale_mean"] <= 2 * FLOOR_FACTOR * floor, got
    assert got["vs_fresh_mean"] > 10 * got["vs_stale_mean"], got


def test_a_hung_scheduler_is_lost_past_the_health_deadline_and_the_engine_restarts(scenarios) -> None:
    """Issue 41: a scheduler alive but hung (neither dead nor stopped) while a generation is awaited:
    its state request unanswered past rollout.recovery.health_timeout_s (2 s) is the engine lost; a memory
    release sent to it then is watched the same way, ends past the deadline without raising and keeps
    the loss for the next call (check_alive); the engine restarts in place and generates again, and the
    scenarios after this one run on the restarted engine."""
    got = scenario(scenarios, "hang_restart")
    assert (
        "left a state request unanswered" in got["lost"]
        and "rollout.recovery.health_timeout_s=2" in got["lost"]
    )
    assert all(state in ("sleeping", "running", "disk-sleep") for state in got["states"]), got["states"]
    assert 2.0 <= got["lost_s"] < 2.0 + 3.0 + 1.0, got  # the deadline, a probe interval, a watch tick
    assert 2.0 <= got["memory_s"] < 2.0 + 3.0 + 1.0 and "left a state request unanswered" in got["kept"], got
    assert len(got["tokens"]) == 6 and got["old_gone"], got


def test_a_preemption_interrupts_the_generation_in_flight(scenarios) -> None:
    """Issue 51 item 5: SGLangEngine.interrupt (a signal's watcher, another thread) aborts the requests
    in flight: the generation returns early with what it had, later ones ask one token each until
    interrupt(False)."""
    got = scenario(scenarios, "interrupted")
    # seen on 2 loaded cores: 1485 tokens in 53 s uninterrupted, 556 in 11.5 s interrupted after a fifth
    assert got["cut_tokens"] < got["full_tokens"] and got["cut_s"] < got["full_s"], got
    assert set(got["cut_finish"]) <= {"length", "stop"} and got["responses"] == 6 * 8, (
        got
    )  # an abort: "length"
    assert got["after_tokens"] <= 6 * 8 and got["again"] == 8, got  # one token each; then the engine's own


def test_the_engines_processes_survive_a_preemption_sigterm(scenarios) -> None:
    got = scenario(scenarios, "sigterm_survived")
    assert got["procs"] > 0 and got["all_alive"] and got["generates"] and got["trainer_handler_kept"]


def test_the_engine_shuts_down_and_only_its_own_processes(scenarios) -> None:
    got = scenario(scenarios, "shutdown")
    assert got["ok"] and got["engine_procs"] > 0 and got["engine_left"] == []
    assert got["bystander_alive"]  # SGLang alone would kill every child of the rank


@pytest.fixture(scope="module")
def engine_group(tmp_path_factory) -> list[dict[str, Any]]:
    """A real TP2 SGLang engine on CPU led by rank 0, rank 1 its member (tests/workers/sglang_workers.py)."""
    require_sglang_engine()
    from tests.helpers.dist import run_distributed
    from tests.workers.sglang_workers import save_model

    work = tmp_path_factory.mktemp("sglang_group")
    save_model(work / "a", seed=0)
    save_model(work / "b", seed=1)
    return run_distributed(
        "tests.workers.sglang_workers:engine_group",
        2,
        timeout_s=ENGINE_TIMEOUT_S,
        model_dir=str(work / "a"),
        other_dir=str(work / "b"),
    )


def test_every_rounds_payloads_reach_their_engine_gpu(engine_group) -> None:
    """Each trainer rank serializes its share on its own device, the leader loads both in one call:
    SGLang's TP rank 1 took rank 1's payload (the outputs equal SGLang loading the same weights from
    disk, bit for bit)."""
    leader, member = engine_group
    assert leader["version"] == member["version"] == 1
    assert leader["rounds_equal_disk_bitwise"]


def test_a_failure_on_the_leader_before_the_gather_ends_every_rank_with_it(engine_group) -> None:
    for rank in engine_group:
        failed = rank["leader_fails"]
        assert "a weight-update session is already open" in failed["error"], failed
        assert failed["seconds"] < 10  # not the group's timeout


def test_a_failure_on_a_member_ends_every_rank_with_it(engine_group) -> None:
    for rank in engine_group:
        failed = rank["member_fails"]
        assert (
            "engine GPU 1" in failed["error"]
            and "model.embed_tokens.weight: shape (32, 127)" in failed["error"]
        )
        assert failed["seconds"] < 10


def test_multi_turn_episodes_continue_from_the_exact_ids(scenarios) -> None:
    # rollout/multiturn.py with SGLang: later turns go in as input_ids; the trajectory is the engine's
    # ids plus the observation ids, bit for bit; the sampled logprobs are the engine's teacher-forced
    # ones of the whole trajectory (model tokens only) within the bf16 noise floor, every token but at
    # most one (a later turn is sampled and the trajectory scored in other batches: under load one
    # token came 0.13 off, a router near a tie; see the sampled-logprob test above).
    floor = scenario(scenarios, "greedy_vs_embedded")["bf16_floor"]
    got = scenario(scenarios, "multiturn")
    assert got["exact"] and got["trajectories"] == 6
    assert got["multi_turn"] > 0 and got["generate_calls"] >= 2
    top = got["sampled_vs_own_top3"]
    assert top[1] <= FLOOR_FACTOR * floor and top[0] < 2.0, got


def test_each_episode_is_asked_for_its_own_budget_at_the_context_edge(scenarios) -> None:
    # rollout/multiturn.py: turn 2 of an episode with 13 tokens left beside one with 24; asking both for
    # 24 passes the first's context (64), and SGLang refuses that request (before: the whole batch).
    got = scenario(scenarios, "multiturn_context_edge")
    assert got["context"] == 64 and got["turns"] == [2, 2], got
    assert got["budgets"] == [13, 24] and got["inputs"][0] + got["budgets"][0] == 64, got
    assert got["inputs"][0] + max(got["budgets"]) > 64 and "context length" in got["refused_uniform"], got
    # SGLang's scheduler stops a request 2 tokens short of the context (max_req_len - input - 1)
    assert all(s <= b for s, b in zip(got["sampled"], got["budgets"], strict=True)), got
    assert got["sampled"][0] >= 11 or got["finish"][0] == "stop", got
    assert 1 <= got["edge_prompt_sampled"] <= 7, got  # 57 + 8 > 64: the adapter asked for 7, SGLang took it


def test_an_engine_that_fails_while_it_starts_is_named_with_its_log(tmp_path) -> None:
    """A scheduler that fails at start (here: SGLang's weight loader on a checkpoint whose final norm
    has half its width) ends the rank with the engine, rank, host,
    cause and the log's last lines on the console, not SGLang's silent SIGKILL of the rank's tree
    (on an H200 torchrun reported only "Signal 9"). Either path may come first: the start's
    exception (``EngineStartError``, exit 3 in the worker) or the scheduler's SIGQUIT
    (``health.sigquit_while_starting``, ``EXIT_ENGINE_DIED``)."""
    require_sglang_engine()
    import socket

    from grpo_megatron.rollout.sglang.health import EXIT_ENGINE_DIED

    proc = subprocess.run(
        [sys.executable, "-m", "tests.workers.sglang_start_failure", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    assert proc.returncode in (3, EXIT_ENGINE_DIED), (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.splitlines()
    first = next((i for i, x in enumerate(lines) if x.startswith("grpo-megatron: error")), None)
    assert first is not None, proc.stderr[-3000:]
    message = "\n".join(lines[first:])
    logs = list((tmp_path / "logs").glob("engine-rank0-*.log"))
    assert len(logs) == 1, logs
    assert f"SGLang engine of rank 0 on {socket.gethostname()} failed to start" in lines[first], message
    assert str(logs[0]) in message, message  # the log named ...
    assert "Traceback" in logs[0].read_text()  # ... holds the scheduler's traceback
    assert "Traceback" in message or "Error" in message, message  # and its tail is on the console


def test_a_quantized_deepseek_v3_written_by_transformers_starts_unquantized_and_serves_the_trainers_weights(
    tmp_path,
) -> None:
    """Issue 36 items 2 and 11, one engine start of its own (a DeepSeek-V3; every other scenario here
    serves a Qwen3-MoE): the tiny FP8 DeepSeek-V3 of ``tests/helpers/fp8_deepseek.py``, config.json as
    transformers writes it plus ``quantization_config``. SGLang is started through the adapter from an
    engine-side config without the quantization (and with the fields SGLang's DeepSeek reads) on dummy
    weights; a manifest with a float8 tensor and a misshapen one is refused naming both before any
    byte moves; the trainer's dequantized weights are synced one tensor per bucket (every fused
    q_a/kv_a pair split across buckets) and the engine then serves exactly, bit for bit, what SGLang
    serves when it reads the same bf16 weights from disk itself.

    Not asserted, measured: SGLang's CPU DeepSeek-V3 (0.5.23, torch_native attention, AVX2 kernels)
    differs from transformers' on the same weights by far more than the bf16 floor (max 4.5 against
    0.26 here), already at the first position (one key: rope plays no part) and with plain routing
    (n_group 1, routed_scaling_factor 1), with weights read from disk as well as synced: the CPU
    engine's DeepSeek model, not the sync or the config, which the bit-exact comparison above isolates."""
    require_sglang_engine()
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.workers.sglang_workers", "fp8_deepseek", str(out), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    got = json.loads(out.read_text()) if out.is_file() else {}
    assert proc.returncode == 0 and got, f"the worker exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    assert "error" not in got, got["error"]
    assert got["server_args"]["load_format"] == "dummy" and got["server_args"]["quantization"] is None
    assert got["server_args"]["model_path"].startswith(str(tmp_path / "logs"))  # the engine-side folder
    config = got["engine_config"]
    assert not config["quantized"] and (config["moe_layer_freq"], config["topk_method"]) == (1, "noaux_tc")
    assert config["rope"]["rope_type"] == "yarn" and config["rope"]["factor"] == 1.0
    (refusal,) = got["refused"]
    assert (
        "q_b_proj.weight: dtype torch.float8_e4m3fn" in refusal and "o_proj.weight: shape (3, 3)" in refusal
    )
    assert got["version_after_refusal"] == -1 and got["accepted"] == [] and got["version"] == 1
    assert got["synced_vs_disk"] == 0.0, got  # the sync lands exactly what SGLang's own loader reads
    assert got["dummy_vs_disk"] > 0.1, got  # and it replaced the dummy weights
    assert got["bf16_floor"] > 0 and got["sglang_vs_fp32"] >= 0  # reported (the docstring's gap)


def test_weight_updates_on_sglangs_intel_amx_path_leave_the_layouts_a_fresh_start_packs(tmp_path) -> None:
    """Issue 50, one engine start of its own: SGLang's intel_amx CPU path repacks weights after
    loading (VNNI blocks, a small router transposed to fp32, fp32 biases), which an update met in the
    checkpoint's layout (seen on an AMX Xeon: the router's AssertionError). A DeepSeek-V3 engine on that
    path (``GRPO_SGLANG_AMX=pretend`` where the CPU has no AMX: packing and updates run on any CPU, a
    forward only on AMX) started from checkpoint A takes B through the adapter's bucketed sync and A
    again by named tensors: every parameter, as the engine holds it (packed), is then bit for bit what
    the fresh start from A packed (SGLang's own per-parameter checksums)."""
    require_sglang_engine()
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.workers.sglang_workers", "amx_layouts", str(out), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    got = json.loads(out.read_text()) if out.is_file() else {}
    assert proc.returncode == 0 and got, f"the worker exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    assert "error" not in got, got["error"]
    assert got["amx"] and "amx_packed_weights_reload" in got["compat_applied"], got
    assert len(got["b_differs"]) >= got["parameters"] - 1, (
        got
    )  # B reached every parameter (a zero bias twice)
    assert got["back_differs"] == [], got


def test_fp8_engines_take_quantized_syncs_equal_to_a_checkpoint_loaded_from_disk(tmp_path) -> None:
    """Issue 54 (FP8 rollout), one engine start per architecture: for Qwen3-MoE and Mixtral the
    adapter starts an SGLang engine with ``rollout.weight_dtype=fp8`` from a bf16 checkpoint A:
    DeepSeek-V3's block-FP8 quantization config, dummy weights. Its manifest check refuses bf16 where
    it holds float8 and weights without their scales; it takes A through the sync's quantizer in
    buckets (state S1), then B, then A again (S2); then SGLang itself loads from disk A written through
    that quantizer as a checkpoint (S3). S1, S2 and S3 hold every parameter (float8 weights, scales,
    bf16 rest, as the engine packs them) bit for bit alike: the sync lands what SGLang's own loader
    reads from a block-FP8 checkpoint.

    Which CPU ran it: SGLang's CPU FP8 layers exist only on its intel_amx path, so the worker runs it
    (``GRPO_SGLANG_AMX=pretend`` where the CPU has no AMX: loading, FP8 packing and updates run, a
    forward cannot); on an AVX2-only CPU no FP8 forward runs, and the logprob gap is measured without
    the engine (test_fp8_rollout.py). DeepSeek-V3 is not run here: SGLang's MLA post-processing of a
    weight update fails on its CPU FP8 path (``FP8_ENGINE_TYPES``)."""
    require_sglang_engine()
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.workers.sglang_workers", "fp8_engines", str(out), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2 * ENGINE_TIMEOUT_S,
    )
    results = json.loads(out.read_text()) if out.is_file() else {}
    assert proc.returncode == 0 and results, f"the worker exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    assert set(results) == {"qwen3_moe", "mixtral"}
    for model_type, got in results.items():
        assert "error" not in got, (model_type, got["error"])
        assert got["server_args"]["load_format"] == "dummy", got
        assert got["engine_quantization_config"]["weight_block_size"] == [128, 128], got
        assert "the engine holds it as torch.float8_e4m3fn" in got["refused_bf16"][0], got
        assert "weight_scale_inv" in got["refused_no_scales"][0] and got["accepted"] == [], got
        assert got["fp8_parameters"] and len(got["scale_parameters"]) == len(got["fp8_parameters"]), got
        assert got["b_differs"] > len(got["fp8_parameters"]), got  # B reached the FP8 weights too
        assert got["s2_differs"] == [], (model_type, got["s2_differs"])  # A again: bit for bit S1
        assert got["disk_differs"] == [], (model_type, got["disk_differs"])  # SGLang's loader: the same
