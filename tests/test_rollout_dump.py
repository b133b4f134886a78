"""The rollout dump's reader (training/rollout_dump.py), in this process: a round trip, and each bad
input refused with the file and the fix. The dump-then-replay run is in tests/test_train.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from grpo_megatron.data import PromptRecord
from grpo_megatron.rollout.engine import Completion
from grpo_megatron.training.phases.reward import Group
from grpo_megatron.training.rollout_dump import (
    IDENTITY,
    ReplaySource,
    iteration_stem,
    read_iteration,
    run_identity,
    write_iteration,
)

PS = SimpleNamespace(world_size=2, tp=1, pp=1, cp=1, ep=2, dp=2)
HF = {"model_type": "qwen3_moe", "hidden_size": 8}
VOCAB = {"a": 0, "b": 1, "<eos>": 2}


def _groups() -> list[Group]:
    routes = torch.arange(2 * 3 * 2, dtype=torch.int32).reshape(2, 3, 2)  # [layers, positions, top_k]
    first = [
        Completion([5, 6], [-0.25, -1 / 3], "stop", routed_experts=routes, weight_version=3),
        Completion([7], [-2.0], "length", loss_mask=[1], weight_version=2),
    ]
    second = [
        Completion([8, 9, 10], [-0.5, -0.0, -1e-30], "stop", loss_mask=[1, 0, 1], weight_version=3),
        Completion([11], [-0.125], "stop", weight_version=3),
    ]
    record = PromptRecord("1+2=", "3", {"x": [1, 2]}, (1, 2))
    return [
        Group(record, first, [1.0, 0.0], ["t0", "t1"]),
        Group(PromptRecord("p", "", {}, (4,)), second, [0.1, 0.7], ["t2", "t3"]),
    ]


def _fields(groups: list[Group]) -> list:
    return [
        (
            g.record,
            g.rewards,
            g.texts,
            [
                (
                    c.token_ids,
                    c.logprobs,
                    c.finish_reason,
                    c.loss_mask,
                    c.weight_version,
                    None if c.routed_experts is None else c.routed_experts.tolist(),
                )
                for c in g.completions
            ],
        )
        for g in groups
    ]


def test_an_iteration_reads_back_exactly_and_a_replay_checks_the_dump_first(tmp_path):
    write_iteration(tmp_path, 1, _groups(), {"reward/mean": 0.45})
    groups, metrics = read_iteration(tmp_path, 1)
    assert _fields(groups) == _fields(_groups()) and metrics == {"reward/mean": 0.45}
    assert groups[0].completions[0].routed_experts.dtype == torch.int32

    identity = run_identity(HF, VOCAB, PS)
    replay = ReplaySource(tmp_path, identity, last_iteration=2)
    with pytest.raises(ValueError, match=f"no {IDENTITY}; point it at a directory"):
        replay.start(0)
    (tmp_path / IDENTITY).write_text(json.dumps(identity))
    with pytest.raises(ValueError, match=r"iteration-000002\.json is missing.*set train\.iterations=1"):
        replay.start(0)
    ReplaySource(tmp_path, identity, last_iteration=1).start(0)  # a whole dump: no error

    # another layout, model and tokenizer: each named, with the fix
    other = run_identity(
        {**HF, "hidden_size": 16}, {**VOCAB, "c": 3}, SimpleNamespace(**{**vars(PS), "ep": 1})
    )
    with pytest.raises(
        ValueError, match=r"dump\.json: the rollout dump was made by another run: model"
    ) as err:
        ReplaySource(tmp_path, other, last_iteration=1).start(0)
    assert "tokenizer (vocabulary)" in str(err.value) and "layout (parallel sizes)" in str(err.value)
    assert "parallel.* sizes" in str(err.value)


def test_a_damaged_or_inconsistent_iteration_is_refused_naming_its_file(tmp_path):
    from safetensors.torch import load, save

    write_iteration(tmp_path, 1, _groups(), {})
    stem = tmp_path / iteration_stem(1)
    tensors_file, meta_file = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    meta = json.loads(meta_file.read_text())

    tensors = load(tensors_file.read_bytes())
    tensors["logprobs"] = tensors["logprobs"][:-1]  # one logprob short of the response tokens
    data = save(tensors)
    tensors_file.write_bytes(data)
    with pytest.raises(ValueError, match=r"does not match the sha256"):
        read_iteration(tmp_path, 1)
    import hashlib

    meta_file.write_text(json.dumps({**meta, "safetensors_sha256": hashlib.sha256(data).hexdigest()}))
    with pytest.raises(
        ValueError,
        match=r"iteration-000001\.safetensors: logprobs has 6 entries where the dump's "
        r"sizes say 7.*dump that iteration again",
    ):
        read_iteration(tmp_path, 1)

    with pytest.raises(ValueError, match=r"iteration-000002\.json is missing.*set train\.iterations=1"):
        read_iteration(tmp_path, 2)
    meta_file.write_text("{not json")
    with pytest.raises(ValueError, match=r"iteration-000001\.json is not readable JSON"):
        read_iteration(tmp_path, 1)


def test_check_refuses_a_replay_dir_that_holds_no_dump_and_a_dump_dir_over_it(tmp_path, capsys):
    from grpo_megatron.cli import main
    from tests.helpers.dist import REPO_ROOT

    example = REPO_ROOT / "examples" / "tiny_moe.yaml"
    base = ["check", str(example), f"data.tokenizer_path={REPO_ROOT / 'examples' / 'demo'}"]
    assert main([*base, f"rollout.replay_dir={tmp_path}", "--world-size", "1"]) == 2
    assert f"rollout.replay_dir={tmp_path}: no dump.json there" in capsys.readouterr().err
    (tmp_path / IDENTITY).write_text("{}")
    assert main([*base, f"rollout.replay_dir={tmp_path}", "--world-size", "1"]) == 0
    capsys.readouterr()
    assert (
        main([*base, f"rollout.replay_dir={tmp_path}", f"rollout.dump_dir={tmp_path}", "--world-size", "1"])
        == 2
    )
    assert "a replay would write over the dump it reads" in capsys.readouterr().err
