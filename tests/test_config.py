"""Job config: YAML loading, overrides, type errors, validation rules, and the CLI frame (no torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_megatron.cli import COMMANDS, main
from grpo_megatron.config import ConfigError, JobConfig, load_config, parse_override, validate
from grpo_megatron.distributed.config import ParallelConfig
from grpo_megatron.models.config import SUPPORTED_MODEL_TYPES, merge_overrides, num_routed_experts

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_moe.yaml"
TINY_MODEL = REPO / "examples" / "tiny_moe"


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def config_errors(overrides: list[str], world_size: int) -> list[str]:
    """The validation errors of the example config with `overrides` on `world_size` ranks."""
    cfg = load_config(EXAMPLE, overrides)
    with pytest.raises(ConfigError) as exc:
        validate(cfg, world_size)
    return exc.value.errors


# ---------------------------------------------------------------------------------------------------
# Loading


def test_example_loads_validates_and_resolves():
    cfg = load_config(EXAMPLE)
    validate(cfg, world_size=1)
    assert cfg.model.hf_path == str(TINY_MODEL)  # relative to the YAML file, stored absolute
    assert cfg.model.dtype == "float32"
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1e-3
    hf = cfg.model.load_hf_config()
    assert hf["model_type"] == "qwen3_moe" and num_routed_experts(hf) == 4
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["head_dim"]) == (
        128,
        2,
        4,
        32,
    )

    resolved = cfg.resolve(world_size=1).parallel
    assert (resolved.dp, resolved.etp, resolved.sequence_parallel) == (1, 1, False)
    assert cfg.parallel.dp is None  # resolve() returns a copy


def test_relative_model_path_does_not_depend_on_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(EXAMPLE)
    assert cfg.model.hf_path == str(TINY_MODEL)
    # A path typed on the command line is relative to the current directory instead.
    (tmp_path / "other").mkdir()
    cfg = load_config(EXAMPLE, ["model.hf_path=other", "data.train_path=train.jsonl"])
    assert cfg.model.hf_path == str(tmp_path.resolve() / "other")
    assert cfg.data.train_path == str(tmp_path.resolve() / "train.jsonl")


def test_overrides_scalars_nested_dicts_lists_and_strings():
    cfg = load_config(
        EXAMPLE,
        [
            "train.lr=1e-5",  # YAML 1.1 would read this as a string
            "parallel.tp=2",
            "parallel.dp=null",
            "parallel.sequence_parallel=true",
            "model.hf_overrides.num_experts=8",
            "reward.components[0].weight=2",
            "algorithm.kl.beta=0.01",
            "data.template=Q: {prompt} A:",  # not valid YAML: kept as typed for a str field
            "logging.wandb_project=2024",  # a number typed for a str field stays a string
        ],
    )
    assert cfg.train.lr == 1e-5 and isinstance(cfg.train.lr, float)
    assert (cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.sequence_parallel) == (2, None, True)
    assert cfg.model.hf_overrides == {"num_experts": 8}
    assert num_routed_experts(cfg.model.load_hf_config()) == 8
    assert cfg.reward.components[0].weight == 2.0
    assert cfg.algorithm.kl.beta == 0.01
    assert cfg.data.template == "Q: {prompt} A:"
    assert cfg.logging.wandb_project == "2024"


def test_hf_overrides_merge_nested_mappings(tmp_path):
    base = {"rope_scaling": {"type": "yarn", "factor": 4.0}, "num_experts": 4}
    assert merge_overrides(base, {"rope_scaling": {"factor": 8.0}, "num_experts": 8}) == {
        "rope_scaling": {"type": "yarn", "factor": 8.0},
        "num_experts": 8,
    }
    assert base["rope_scaling"]["factor"] == 4.0  # the input is not modified
    cfg = load_config(EXAMPLE, ["model.hf_overrides.rope_scaling.factor=2"])
    assert cfg.model.load_hf_config()["rope_scaling"] == {"factor": 2}  # config.json has rope_scaling: null


def test_parse_override_forms():
    assert parse_override("model.hf_overrides.num_experts=8") == (
        ("model", "hf_overrides", "num_experts"),
        "8",
    )
    assert parse_override("reward.components[1].weight=0.5") == (("reward", "components", 1, "weight"), "0.5")
    assert parse_override("reward.components.1.weight=a=b") == (("reward", "components", 1, "weight"), "a=b")
    for bad in ("train.lr", "lr=1", "=1", "train..lr=1"):
        with pytest.raises(ValueError, match="section.key=value"):
            parse_override(bad)


def test_unknown_keys_name_the_line_and_suggest(tmp_path):
    path = write_yaml(
        tmp_path,
        f"model:\n  hf_path: {TINY_MODEL}\ntrain:\n  seed: 1\n  lrr: 1.0e-5\nrolout:\n  top_k: 5\n",
    )
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert sorted(exc.value.errors) == [
        f"{path}:5: unknown key 'train.lrr' in 'train': did you mean 'train.lr'?",
        f"{path}:6: unknown key 'rolout' at the top level: did you mean 'rollout'?",
    ]


def test_unknown_override_keys_name_the_override():
    with pytest.raises(ConfigError) as exc:
        load_config(EXAMPLE, ["train.lrr=1", "paralel.tp=2", "train.lr.x=1", "reward.components[5].weight=1"])
    e1, e2, e3, e4 = exc.value.errors
    assert "override 'train.lrr=1'" in e1 and "did you mean 'train.lr'?" in e1
    assert "override 'paralel.tp=2'" in e2 and "did you mean 'parallel'?" in e2
    assert "override 'train.lr.x=1'" in e3 and "train.lr is a number" in e3
    assert "reward.components has 1 item(s), so index 5 does not exist" in e4


def test_moved_keys_name_their_new_place(tmp_path):
    """Issue 52 nested partial rollouts, SGLang and engine recovery: a config that still names an old
    flat key (a file's or an override's) fails naming the key it moved to."""
    path = write_yaml(
        tmp_path,
        f"model:\n  hf_path: {TINY_MODEL}\ntrain:\n  partial_rollout: true\nrollout:\n  sglang_tp: 2\n",
    )
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["rollout.partial_segment_tokens=3", "rollout.max_engine_restarts=1"])
    errors = sorted(exc.value.errors)
    assert len(errors) == 4
    for old, new in (
        ("train.partial_rollout", "rollout.partial.enabled"),
        ("rollout.sglang_tp", "rollout.sglang.tp"),
        ("rollout.partial_segment_tokens", "rollout.partial.segment_tokens"),
        ("rollout.max_engine_restarts", "rollout.recovery.max_restarts"),
    ):
        assert any(f"'{old}' has moved to '{new}'" in e for e in errors), (old, errors)
    assert f"{path}:4: 'train.partial_rollout' has moved" in "\n".join(errors)


def test_wrong_types_and_choices(tmp_path):
    path = write_yaml(
        tmp_path,
        "\n".join(
            [
                "model:",
                f"  hf_path: {TINY_MODEL}",
                "  dtype: fp32",  # line 3: a bad Literal
                "parallel:",
                "  tp: two",  # line 5
                "  sequence_parallel: 1",  # line 6: int for bool | None
                "train:",
                "  seed: true",  # line 8: bool is not an int
                "  lr: fast",  # line 9
                "data:",
                "  generator_kwargs: [1, 2]",  # line 11: list for a dict
                "logging: 3",  # line 12: a scalar for a section
            ]
        ),
    )
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    by_field = {e.split(": ", 1)[1].split("=", 1)[0]: e for e in exc.value.errors}
    assert set(by_field) == {
        "model.dtype",
        "parallel.tp",
        "parallel.sequence_parallel",
        "train.seed",
        "train.lr",
        "data.generator_kwargs",
        "logging",
    }
    assert by_field["model.dtype"].startswith(f"{path}:3:")
    assert "'float32', 'bfloat16', 'float16'" in by_field["model.dtype"]
    assert "did you mean 'float32'?" in by_field["model.dtype"]
    assert by_field["parallel.tp"].startswith(f"{path}:5:") and "'two'" in by_field["parallel.tp"]
    assert "must be an integer" in by_field["parallel.tp"]
    assert "must be true or false or null" in by_field["parallel.sequence_parallel"]
    assert "train.seed=true is a boolean, but it must be an integer" in by_field["train.seed"]
    assert by_field["train.lr"].startswith(f"{path}:9:") and "must be a number" in by_field["train.lr"]
    assert "must be a mapping" in by_field["data.generator_kwargs"]
    assert by_field["logging"].startswith(f"{path}:12:")


def test_missing_model_duplicate_keys_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"model is required: add 'model: \.\.\.' at the top level"):
        load_config(write_yaml(tmp_path, "train:\n  seed: 1\n"))
    with pytest.raises(
        ConfigError, match=r"model\.hf_path is required: add 'hf_path: \.\.\.' under 'model:'"
    ):
        load_config(write_yaml(tmp_path, "model:\n  dtype: float32\n"))
    with pytest.raises(ConfigError, match=r"job\.yaml:3: model\.dtype is given twice \(first at line 2\)"):
        load_config(
            write_yaml(tmp_path, f"model:\n  dtype: float32\n  dtype: float16\n  hf_path: {TINY_MODEL}\n")
        )
    empty_section = load_config(
        write_yaml(tmp_path, f"model:\n  hf_path: {TINY_MODEL}\ntrain:\n  # seed: 1\n")
    )
    assert empty_section.train == JobConfig(model=empty_section.model).train
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write_yaml(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write_yaml(tmp_path, "model: [\n"))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_round_trip(tmp_path):
    cfg = load_config(EXAMPLE, ["parallel.tp=2", "model.hf_overrides.num_hidden_layers=4"]).resolve(
        world_size=4
    )
    cfg.save(tmp_path / "resolved.yaml")
    again = load_config(tmp_path / "resolved.yaml")
    assert again == cfg
    assert again.to_dict()["parallel"] == {**cfg.to_dict()["parallel"], "dp": 2, "sequence_parallel": True}


# ---------------------------------------------------------------------------------------------------
# Validation rules (the example model: 4 heads, 4 KV heads, 2 layers, 4 experts)


def test_tp_must_divide_attention_heads():
    (error,) = config_errors(["parallel.tp=3"], world_size=3)
    # The acceptance example of issue 2: the field, both values, where the 4 comes from, and the fix.
    assert error.startswith("parallel.tp=3 does not divide model num_attention_heads=4 (from ")
    assert error.endswith("tiny_moe/config.json): choose parallel.tp in {1, 2, 4}")


def test_tp_and_kv_heads_divide_or_replicate():
    grouped = ["model.hf_overrides.num_attention_heads=12", "model.hf_overrides.num_key_value_heads=4"]
    (error,) = config_errors([*grouped, "parallel.tp=6"], world_size=6)
    assert "parallel.tp=6 neither divides model num_key_value_heads=4 (from model.hf_overrides)" in error
    assert error.endswith("choose parallel.tp in {1, 2, 4, 12}")
    for tp in (2, 4, 12):  # divides the KV heads, equals them, or replicates them
        validate(load_config(EXAMPLE, [*grouped, f"parallel.tp={tp}"]), world_size=tp)


def test_ep_must_divide_experts_for_every_family():
    (error,) = config_errors(["parallel.ep=3", "train.prompts_per_iteration=3"], world_size=3)
    assert error.startswith("parallel.ep=3 does not divide the model's num_experts=4")
    assert error.endswith("choose parallel.ep in {1, 2, 4}")
    deepseek = [
        "model.hf_overrides.model_type=deepseek_v3",
        "model.hf_overrides.num_experts=null",
        "model.hf_overrides.n_routed_experts=6",
    ]
    (error,) = config_errors([*deepseek, "parallel.ep=4"], world_size=4)
    assert error.startswith(
        "parallel.ep=4 does not divide the model's n_routed_experts=6 (from model.hf_overrides)"
    )
    assert (
        num_routed_experts({"num_local_experts": 8}) == 8 and num_routed_experts({"model_type": "qwen3"}) == 0
    )
    dense = ["model.hf_overrides.model_type=qwen3", "model.hf_overrides.num_experts=0"]
    (error,) = config_errors([*dense, "parallel.ep=2"], world_size=2)
    assert error.startswith("parallel.ep=2 but the model is dense")


def test_pp_must_divide_layers():
    (error,) = config_errors(["parallel.pp=4"], world_size=4)
    assert error.startswith("parallel.pp=4 does not divide model num_hidden_layers=2")
    assert error.endswith("choose parallel.pp in {1, 2}")


def test_world_size_must_match_the_layout():
    (error,) = config_errors(["parallel.tp=2"], world_size=3)
    assert error.startswith("parallel.tp*pp*cp=2*1*1=2 does not divide the world size 3")
    (error,) = config_errors(["parallel.tp=2", "parallel.dp=2"], world_size=8)
    assert error.startswith("parallel.tp*pp*cp*dp=2*1*1*2=4 != world size 8")
    assert "set parallel.dp=null" in error


def test_expert_layout_must_fit_the_dense_layout():
    (error,) = config_errors(["parallel.tp=2", "parallel.ep=4"], world_size=4)
    assert error.startswith("parallel.etp*ep=2*4=8 does not divide tp*cp*dp=2*1*2=4")
    assert error.endswith("choose parallel.ep in {1, 2}")
    # The same experts fit with etp=1: the 4 ranks re-partition as etp*ep*edp = 1*4*1.
    cfg = load_config(EXAMPLE, ["parallel.tp=2", "parallel.ep=4", "parallel.etp=1"])
    validate(cfg, world_size=4)
    resolved = cfg.resolve(world_size=4).parallel
    assert (resolved.dp, resolved.etp, resolved.expert_dp) == (2, 1, 1)


def test_sequence_parallel_required_for_moe_with_tp():
    (error,) = config_errors(["parallel.tp=2", "parallel.sequence_parallel=false"], world_size=2)
    assert error.startswith("parallel.sequence_parallel=false with parallel.tp=2 on an MoE model")
    cfg = load_config(EXAMPLE, ["parallel.tp=2"])
    validate(cfg, world_size=2)
    assert cfg.resolve(world_size=2).parallel.sequence_parallel is True  # auto turns it on
    dense = ["model.hf_overrides.model_type=qwen3", "model.hf_overrides.num_experts=0"]
    validate(
        load_config(EXAMPLE, [*dense, "parallel.tp=2", "parallel.sequence_parallel=false"]), world_size=2
    )


def test_context_parallelism_needs_packing():
    validate(load_config(EXAMPLE, ["parallel.cp=2"]), world_size=2)  # packing is the default
    (error,) = config_errors(["parallel.cp=2", "train.packing=false"], world_size=2)
    assert error.startswith("parallel.cp=2 needs train.packing=true")


def test_unknown_model_type_lists_supported_ones():
    (error,) = config_errors(["model.hf_overrides.model_type=llama"], world_size=1)
    assert error.startswith("model_type='llama' (from model.hf_overrides) is not supported")
    assert ", ".join(SUPPORTED_MODEL_TYPES) in error


def test_missing_config_json_names_model_hf_path(tmp_path):
    (error,) = config_errors([f"model.hf_path={tmp_path}"], world_size=1)
    assert error.startswith(f"model.hf_path='{tmp_path}': no config.json at {tmp_path / 'config.json'}")


def test_batch_must_split_over_updates_and_dp():
    (error,) = config_errors(["train.prompts_per_iteration=3", "train.updates_per_iteration=5"], world_size=2)
    assert error.startswith("train.prompts_per_iteration*rollout.n_samples_per_prompt=3*8=24 samples")
    assert error.endswith("make it a multiple of 10")
    validate(
        load_config(EXAMPLE, ["train.prompts_per_iteration=3", "train.updates_per_iteration=2"]), world_size=2
    )


def test_all_errors_are_reported_together():
    errors = config_errors(
        ["parallel.tp=3", "parallel.ep=3", "rollout.top_p=0", "train.lr=-1", "algorithm.clip_low=2"],
        world_size=9,
    )
    fields = [
        "rollout.top_p",
        "algorithm.clip_low",
        "train.lr",
        "parallel.tp=3 does not",
        "parallel.ep=3 does not",
    ]
    assert len(errors) == len(fields)
    for name in fields:
        assert any(e.startswith(name) for e in errors), (name, errors)


def test_parallel_config_section_rules():
    with pytest.raises(ValueError, match=r"parallel\.tp=0 must be >= 1\nparallel\.etp=0 must be >= 1"):
        ParallelConfig(tp=0, etp=0).validate()
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        ParallelConfig(tp=4).resolve(6)
    with pytest.raises(ValueError, match="needs a resolved config"):
        _ = ParallelConfig().expert_dp


# ---------------------------------------------------------------------------------------------------
# CLI


def test_cli_check_prints_resolved_config_and_errors_exit_2(capsys):
    tokenizer = f"data.tokenizer_path={REPO / 'examples' / 'demo'}"  # tiny_moe/ has none; train needs one
    assert main(["check", str(EXAMPLE), tokenizer, "parallel.ep=2", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("# resolved config for world size 2\n") and "  dp: 2\n" in out and "  ep: 2\n" in out
    )
    for command in ("check", "sanity"):  # a bad config stops before any handler (no torch, no process group)
        assert main([command, str(EXAMPLE), "parallel.tp=3"]) == 2
        captured = capsys.readouterr()
        assert "parallel.tp=3 does not divide model num_attention_heads=4" in captured.err
        assert "Traceback" not in captured.err


def test_cli_help_lists_commands_and_imports_no_torch():
    env = {**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "1"}
    help_text = subprocess.run(
        [sys.executable, "-m", "grpo_megatron", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for command in COMMANDS:
        assert command.name in help_text
    assert {"check", "sanity"} <= {c.name for c in COMMANDS}

    probe = (
        "import json, sys\n"
        "from grpo_megatron.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "rc = main(['check', 'examples/tiny_moe.yaml', 'data.tokenizer_path=examples/demo'])\n"
        "heavy = sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules)\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(result.stdout.splitlines()[-1]) == {"rc": 0, "heavy": []}


def test_job_config_defaults_are_valid_sections():
    cfg = JobConfig(model=load_config(EXAMPLE).model)
    validate(cfg, world_size=1)


def test_overlong_buffer_must_fit_inside_max_new_tokens():
    cfg = load_config(
        EXAMPLE,
        ["algorithm.overlong.enabled=true", "algorithm.overlong.buffer_len=64", "rollout.max_new_tokens=16"],
    )
    with pytest.raises(
        ConfigError, match=r"algorithm.overlong.buffer_len=64 must be < rollout.max_new_tokens=16"
    ):
        validate(cfg, 1)
    validate(load_config(EXAMPLE, ["algorithm.overlong.enabled=true", "algorithm.overlong.buffer_len=8"]), 1)


def test_routing_replay_and_truncated_sampling_rules(tmp_path):
    # YAML 1.1 reads a bare `off` as false: the loader takes it as the choice 'off'.
    path = write_yaml(tmp_path, f"model:\n  hf_path: {TINY_MODEL}\nalgorithm:\n  routing_replay: off\n")
    assert load_config(path).algorithm.routing_replay == "off"
    assert load_config(EXAMPLE, ["algorithm.routing_replay=off"]).algorithm.routing_replay == "off"
    validate(load_config(EXAMPLE, ["algorithm.routing_replay=r3"]), world_size=1)
    r2_unpacked = ["algorithm.routing_replay=r2", "train.packing=false"]
    validate(load_config(EXAMPLE, [*r2_unpacked, "train.updates_per_iteration=2"]), world_size=1)
    (error,) = config_errors(["algorithm.routing_replay=r2", "train.updates_per_iteration=2"], world_size=1)
    assert "train.packing=true" in error and "use r3" in error
    (error,) = config_errors(r2_unpacked, world_size=1)
    assert (
        error.startswith("algorithm.routing_replay=r2 replays the old-policy pass")
        and "use r3 or off" in error
    )
    dense = ["model.hf_overrides.model_type=qwen3", "model.hf_overrides.num_experts=0"]
    (error,) = config_errors([*dense, "algorithm.routing_replay=r3"], world_size=1)
    assert error.startswith("algorithm.routing_replay=r3 but the model is dense")
    # a recomputed forward replays its forward's experts (models/routing.py; tests/test_routing.py)
    validate(load_config(EXAMPLE, ["algorithm.routing_replay=r3", "model.recompute=full"]), world_size=1)
    # Truncated sampling: the trainer takes the same truncation (algorithm/truncation.py); SGLang cannot
    validate(load_config(EXAMPLE, ["rollout.top_p=0.9", "rollout.top_k=20"]), world_size=1)
    (error,) = config_errors(["rollout.top_p=0.9", "rollout.top_k=20", "rollout.engine=sglang"], world_size=1)
    assert error.startswith("rollout.top_p=0.9, top_k=20, min_p=0.0 with rollout.engine=sglang")
    assert "biases the importance ratio" in error


def test_sglang_requests_must_fit_the_models_context():
    # tiny_moe: max_position_embeddings 512, data.max_prompt_tokens 32; SGLang refuses prompt + new > 512.
    validate(load_config(EXAMPLE, ["rollout.engine=sglang", "rollout.max_new_tokens=480"]), 1)
    validate(load_config(EXAMPLE, ["rollout.max_new_tokens=481"]), 1)  # the embedded engine takes any length
    (error,) = config_errors(["rollout.engine=sglang", "rollout.max_new_tokens=481"], world_size=1)
    assert (
        error.startswith(
            "data.max_prompt_tokens=32 + rollout.max_new_tokens=481 = 513 tokens exceeds the "
            "model's context of 512 (max_position_embeddings in "
        )
        and "lower rollout.max_new_tokens" in error
    )
    (error,) = config_errors(
        [
            "rollout.engine=sglang",
            "rollout.sglang.server_args.context_length=256",
            "rollout.max_new_tokens=240",
        ],
        world_size=1,
    )
    assert "context of 256 (rollout.sglang.server_args.context_length)" in error
    multiturn = [
        "rollout.engine=sglang",
        "rollout.multiturn.enabled=true",
        "rollout.multiturn.max_total_tokens=500",
    ]
    (error,) = config_errors(multiturn, world_size=1)
    assert "rollout.multiturn.max_total_tokens=500 = 532 tokens" in error


def test_the_asynchronous_loop_needs_engines_generating_apart_and_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match=r"train.max_staleness=1 needs .*rollout.embedded_process=true"):
        validate(load_config(EXAMPLE, ["train.max_staleness=1"]), 1)
    with pytest.raises(ConfigError, match=r"algorithm.dynamic_sampling.enabled=true"):
        validate(
            load_config(
                EXAMPLE, ["rollout.embedded_process=true", "algorithm.dynamic_sampling.enabled=true"]
            ),
            1,
        )
    with pytest.raises(ConfigError, match=r"rollout.multiturn.enabled=true: the asynchronous producer"):
        validate(load_config(EXAMPLE, ["rollout.embedded_process=true", "rollout.multiturn.enabled=true"]), 1)
    with pytest.raises(ConfigError, match=r"train.max_staleness=-1 must be >= 0"):
        validate(load_config(EXAMPLE, ["train.max_staleness=-1"]), 1)
    validate(load_config(EXAMPLE, ["rollout.embedded_process=true", "train.max_staleness=2"]), 1)
    # issue 41: engines are restarted in place as engine processes or colocated SGLang engines; the bound and
    # deadline are checked
    with pytest.raises(
        ConfigError, match=r"rollout.recovery.max_restarts=2: .*rollout.embedded_process=true"
    ):
        validate(load_config(EXAMPLE, ["rollout.recovery.max_restarts=2"]), 1)
    with pytest.raises(ConfigError, match=r"rollout.recovery.max_restarts=1: disaggregated SGLang servers"):
        validate(
            load_config(
                EXAMPLE,
                [
                    "rollout.engine=sglang",
                    "rollout.recovery.max_restarts=1",
                    "rollout.sglang.mode=disaggregated",
                    "rollout.sglang.server_urls=[http://h:1]",
                ],
            ),
            1,
        )
    validate(load_config(EXAMPLE, ["rollout.engine=sglang", "rollout.recovery.max_restarts=1"]), 1)
    with pytest.raises(ConfigError, match=r"rollout.recovery.health_timeout_s=0.0 must be > 0"):
        validate(
            load_config(EXAMPLE, ["rollout.embedded_process=true", "rollout.recovery.health_timeout_s=0"]), 1
        )
    validate(load_config(EXAMPLE, ["rollout.embedded_process=true", "rollout.recovery.max_restarts=2"]), 1)
    sglang = load_config(EXAMPLE, ["rollout.engine=sglang", "train.max_staleness=1"])
    validate(sglang, 1)  # SGLang's schedulers are processes of their own
    assert sglang.producer_loop and not load_config(EXAMPLE, ["rollout.engine=sglang"]).producer_loop
    with pytest.raises(ConfigError, match=r"train.max_staleness=1 with train.offload_trainer=true"):
        validate(
            load_config(
                EXAMPLE, ["rollout.engine=sglang", "train.max_staleness=1", "train.offload_trainer=true"]
            ),
            1,
        )


def test_engines_across_nodes_with_restarts_pass_validation_plan_and_the_placement(capsys):
    """Issue 41: colocated SGLang engines across nodes restart in place too (each further node's part
    restarts with its leader, at the leader's fresh address: SGLangSyncMember.restart), so
    rollout.recovery.max_restarts > 0 with engines of 16 GPUs over nodes of 8 passes validation, the
    placement the runtime computes, and plan (which refused it before)."""
    from grpo_megatron.rollout.placement import decide_placement

    restarts = ["rollout.engine=sglang", "rollout.recovery.max_restarts=2", "rollout.sglang.ep=1"]
    across = load_config(EXAMPLE, [*restarts, "rollout.sglang.tp=16"])
    validate(across, 16)
    placement = decide_placement(
        across.rollout,
        offload_trainer=False,
        max_staleness=0,
        world_size=16,
        gpus_per_node=8,
        tp=1,
        pp=1,
        cp=1,
        hf=across.model.load_hf_config(),
    )
    assert placement.gpus_per_engine == 16 and placement.engines == (tuple(range(16)),)
    assert (
        main(
            ["plan", str(EXAMPLE), *restarts, "rollout.sglang.tp=16", "--nodes", "2", "--gpus-per-node", "8"]
        )
        == 0
    )
    assert "max_restarts" not in capsys.readouterr().err


def test_sglang_on_cuda_needs_a_head_size_its_rotary_kernel_has():
    """SGLang's CUDA rotary embedding has kernels for head sizes 64/128/256/512 only; with a bf16 KV
    cache any other fails the engine's first forward (seen on an H200): refused up front, naming the
    field and the fix. CPU engines, fp32 KV caches and head_dim 64 are fine."""
    sglang_cuda = ["rollout.engine=sglang", "parallel.backend=nccl", "model.dtype=bfloat16"]
    errors = config_errors(sglang_cuda, world_size=2)
    assert any("head_dim=32" in e and "model.hf_overrides.head_dim=64" in e for e in errors), errors
    for fine in (["model.hf_overrides.head_dim=64"], ["model.dtype=float32"], ["parallel.backend=gloo"]):
        validate(load_config(EXAMPLE, sglang_cuda + fine), 2)


def test_r3_with_sglang_needs_engines_that_report_routes():
    """SGLang's CPU engine cannot report routes (pinned memory needs CUDA): r3 with it is refused up
    front, not at the first rollout (seen in bench/gpu_check.sh --device cpu)."""
    r3_sglang = ["algorithm.routing_replay=r3", "rollout.engine=sglang", "model.hf_overrides.head_dim=64"]
    (error,) = config_errors([*r3_sglang, "parallel.backend=gloo"], world_size=1)
    assert "SGLang's CPU engine cannot report them" in error and "rollout.engine=embedded" in error
    validate(load_config(EXAMPLE, [*r3_sglang, "parallel.backend=nccl"]), 1)
