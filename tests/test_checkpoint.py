"""Checkpoints: resumed equals uninterrupted (bitwise, fp32, gloo), layout changes, atomicity.

Two launches of 2 ranks share the work: the first trains each case 3 iterations saving at 2;
the second resumes each from its directory (where decoy directories were planted: a temporary
one and one without the completion marker), crashes one save before it is published, and loads
checkpoints at other layouts.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_megatron.checkpoint.config import CheckpointConfig
from grpo_megatron.checkpoint.manager import CheckpointManager, find_latest
from grpo_megatron.checkpoint.marker import MARKER, CheckpointError, read_marker
from grpo_megatron.training.config import TrainConfig
from grpo_megatron.training.policy import build_scheduler
from tests.helpers.dist import run_distributed

_WORKERS = "tests.workers.checkpoint_workers:cases"
TOTAL, SAVED_AT = 3, 2
_SCHEDULE = [
    "train.iterations=3",
    "train.lr_warmup_iterations=1",
    "train.lr_decay=cosine",
    "train.min_lr=1e-4",
]
CASES = {
    "ep2_distopt": ["parallel.ep=2", "parallel.use_distributed_optimizer=true"],
    "ep2_distopt_dp_reshardable": [
        "parallel.ep=2",
        "parallel.use_distributed_optimizer=true",
        "checkpoint.optimizer_format=dp_reshardable",
    ],
    "ep2_plain": ["parallel.ep=2", "parallel.use_distributed_optimizer=false"],
    "tp2_distopt": ["parallel.tp=2", "parallel.use_distributed_optimizer=true"],
    # LoRA (models/lora.py): adapters and their Adam state only, base weights frozen.
    "ep2_distopt_lora": ["parallel.ep=2", "parallel.use_distributed_optimizer=true", "model.lora.rank=4"],
    "tp2_plain_lora": ["parallel.tp=2", "parallel.use_distributed_optimizer=false", "model.lora.rank=4"],
}


def _overrides(case: str) -> list[str]:
    return [*CASES[case], *_SCHEDULE, f"checkpoint.save_interval={SAVED_AT}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {case: str(root / case) for case in CASES}
    first = run_distributed(
        _WORKERS,
        2,
        timeout_s=400,
        calls=[
            (
                "run_case",
                dict(overrides=_overrides(c), ckpt_dir=dirs[c], total=TOTAL, record_weights_at=(SAVED_AT,)),
            )
            for c in CASES
        ],
    )[0]
    uninterrupted = dict(zip(CASES, first, strict=True))
    # Decoys resume=auto must never take: a newer save that never finished, a newer directory
    # without the completion marker (both look like checkpoints otherwise).
    for case in CASES:
        saved = Path(dirs[case]) / "iter_0000002"
        shutil.copytree(saved, Path(dirs[case]) / "iter_0000003.tmp-deadbeef")
        unmarked = Path(dirs[case]) / "iter_0000009"
        shutil.copytree(saved, unmarked)
        (unmarked / MARKER).unlink()
    ep2_ckpt = str(Path(dirs["ep2_distopt"]) / "iter_0000002")
    tp2_ckpt = str(Path(dirs["tp2_distopt"]) / "iter_0000002")
    calls = [("run_case", dict(overrides=_overrides(c), ckpt_dir=dirs[c], total=TOTAL)) for c in CASES] + [
        (
            "interrupted_save",
            dict(overrides=_overrides("ep2_plain"), ckpt_dir=dirs["ep2_plain"], iteration=3),
        ),
        # EP2 (two chained optimizers) -> TP2 (one): the model loads; the optimizer cannot.
        (
            "load_elsewhere",
            dict(overrides=["parallel.tp=2", "checkpoint.load_optimizer=false", *_SCHEDULE], ckpt=ep2_ckpt),
        ),
        ("load_elsewhere", dict(overrides=["parallel.tp=2"], ckpt=ep2_ckpt, expect_error=True)),
        # TP2 -> DP2 with the fully_reshardable distributed optimizer: model and optimizer reshard.
        ("load_elsewhere", dict(overrides=[*_SCHEDULE], ckpt=tp2_ckpt, step_iteration=3)),
    ]
    second = run_distributed(_WORKERS, 2, timeout_s=400, calls=calls)
    resumed = dict(zip(CASES, second[0][: len(CASES)], strict=True))
    interrupted, ep2_at_tp2, ep2_at_tp2_optimizer, tp2_at_dp2 = second[0][len(CASES) :]
    return {
        "dirs": dirs,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "resumed_rank1": dict(zip(CASES, second[1][: len(CASES)], strict=True)),
        "interrupted": interrupted,
        "ep2_at_tp2": ep2_at_tp2,
        "ep2_at_tp2_optimizer": ep2_at_tp2_optimizer,
        "tp2_at_dp2": tp2_at_dp2,
    }


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a and a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.mark.launches
@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_equals_uninterrupted_bitwise(runs: dict, case: str) -> None:
    full, resumed = runs["uninterrupted"][case], runs["resumed"][case]
    assert full["resumed_at"] == 0 and resumed["resumed_at"] == SAVED_AT
    assert resumed["trainer_state"] == {"iteration": SAVED_AT, "consumed_prompts": 4 * SAVED_AT}
    # The learning rate continues the schedule, the losses and final weights are bit for bit the same.
    assert resumed["lr_after_resume"] == full["lrs"][SAVED_AT]
    for iteration in range(SAVED_AT + 1, TOTAL + 1):
        assert resumed["lrs"][iteration] == full["lrs"][iteration]
        assert resumed["losses"][iteration] == full["losses"][iteration], iteration
    _assert_same_weights(resumed["final_weights"], full["final_weights"])
    # Adam's step counters: one per optimizer step, never shared (the silent megatron bug).
    for result in (resumed, runs["resumed_rank1"][case]):
        assert result["adam_steps_after_resume"] and set(result["adam_steps_after_resume"]) == {SAVED_AT}
        assert set(result["adam_steps"]) == {TOTAL}


@pytest.mark.launches
def test_schedule_warms_up_and_decays(runs: dict) -> None:
    lrs = runs["uninterrupted"]["ep2_distopt"]["lrs"]
    assert lrs[1] == pytest.approx(1e-3)  # warm-up of one iteration: the first step already learns
    assert 1e-4 < lrs[2] < 1e-3 and lrs[3] == pytest.approx(1e-4)


@pytest.mark.launches
def test_resume_auto_skips_temporary_and_unmarked_directories(runs: dict) -> None:
    for case, directory in runs["dirs"].items():
        assert runs["resumed"][case]["resumed_at"] == SAVED_AT
        assert find_latest(directory) == Path(directory) / "iter_0000002"
        (Path(directory) / "latest").unlink()  # without the pointer: the newest complete one
        assert find_latest(directory) == Path(directory) / "iter_0000002"


@pytest.mark.launches
def test_interrupted_save_leaves_latest_at_the_previous_checkpoint(runs: dict) -> None:
    assert "simulated crash" in runs["interrupted"]["error"]
    directory = Path(runs["dirs"]["ep2_plain"])
    # The failed save removed its temporary; the resume before it pruned the decoy one.
    assert not list(directory.glob("iter_0000003.tmp-*"))
    assert not (directory / "iter_0000003").exists()


@pytest.mark.launches
def test_model_loads_at_another_layout(runs: dict) -> None:
    saved = runs["uninterrupted"]["ep2_distopt"]["weights"][SAVED_AT]
    at_tp2 = runs["ep2_at_tp2"]
    _assert_same_weights(at_tp2["weights"], saved)
    assert at_tp2["trainer_state"]["iteration"] == SAVED_AT
    assert at_tp2["lr"] == runs["uninterrupted"]["ep2_distopt"]["lrs"][SAVED_AT]


@pytest.mark.launches
def test_optimizer_layout_change_megatron_cannot_do_names_the_fix(runs: dict) -> None:
    error = runs["ep2_at_tp2_optimizer"]["error"]
    assert "2 chained optimizer(s)" in error and "checkpoint.load_optimizer=false" in error


@pytest.mark.launches
def test_distributed_optimizer_reshards_tp2_to_dp2(runs: dict) -> None:
    full = runs["uninterrupted"]["tp2_distopt"]
    at_dp2 = runs["tp2_at_dp2"]
    _assert_same_weights(at_dp2["weights"], full["weights"][SAVED_AT])
    # One more step at the new layout matches the TP2 run up to summation order; a lost Adam
    # state would move the weights by about lr per element instead.
    assert math.isclose(at_dp2["loss"], full["losses"][TOTAL], rel_tol=1e-5)
    worst = max(
        (at_dp2["weights_after_step"][k] - v).abs().max().item() for k, v in full["final_weights"].items()
    )
    assert worst < 1e-6, worst


@pytest.mark.launches
@pytest.mark.parametrize("case", ["ep2_distopt_lora", "tp2_plain_lora"])
def test_lora_checkpoint_holds_adapter_optimizer_state_only(runs: dict, case: str) -> None:
    """The model part holds the frozen base and the adapters; the optimizer part, only the adapters'
    Adam state (the base has none); the marker records the adapters."""
    from grpo_megatron.checkpoint.integrity import read_dcp_metadata

    ckpt = Path(runs["dirs"][case]) / "iter_0000002"
    keys = list(read_dcp_metadata(ckpt).state_dict_metadata)
    optimizer = [k for k in keys if k.startswith("optimizer") and ("decoder." in k or "embedding" in k)]
    assert optimizer and all("_lora." in k for k in optimizer), [k for k in optimizer if "_lora." not in k][
        :3
    ]
    model = [
        k for k in keys if not k.startswith("optimizer")
    ]  # megatron's keys: decoder.layers.<...> (layers stacked)
    assert any("_lora." in k for k in model) and any(k.endswith("linear_qkv.weight") for k in model), model[
        :8
    ]
    assert json.loads((ckpt / MARKER).read_text())["model"]["lora"]["rank"] == 4


# ----------------------------------------------------------------------------------------------
# Without processes


def _fake_checkpoint(directory: Path, name: str, complete: bool = True) -> Path:
    path = directory / name
    path.mkdir(parents=True)
    (path / "metadata.json").write_text("{}")
    if complete:
        (path / MARKER).write_text('{"kind": "train", "iteration": 1}')
    return path


def test_find_latest_and_explicit_paths(tmp_path: Path) -> None:
    assert find_latest(tmp_path / "missing") is None
    good = _fake_checkpoint(tmp_path, "iter_0000004")
    _fake_checkpoint(tmp_path, "iter_0000008", complete=False)
    _fake_checkpoint(tmp_path, "iter_0000009.tmp-1234")
    assert find_latest(tmp_path) == good
    (tmp_path / "latest").write_text("iter_0000008\n")  # names an unmarked directory: ignored
    assert find_latest(tmp_path) == good

    def manager(resume: str) -> CheckpointManager:
        return CheckpointManager(CheckpointConfig(dir=str(tmp_path), resume=resume), tmp_path, ps=None)

    # resume_path verifies candidates (tests/test_faults.py does it on real checkpoints): these
    # fakes hold no shards, so only the choices that need no verification are checked here.
    assert manager("none").resume_path() is None
    assert (
        CheckpointManager(CheckpointConfig(), tmp_path / "run", ps=None).dir
        == tmp_path / "run" / "checkpoints"
    )
    for bad, message in (
        (tmp_path / "iter_0000008", f"has no {MARKER}"),
        (tmp_path / "iter_0000009.tmp-1234", "did not finish"),
        (tmp_path / "nowhere", "does not exist"),
    ):
        with pytest.raises(CheckpointError, match=message) as info:
            manager(str(bad)).resume_path()
        assert str(bad) in str(info.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_marker(tmp_path / "nowhere")


def _lrs(**train: object) -> list[float]:
    cfg = TrainConfig(lr=1.0, **train)
    optimizer = SimpleNamespace(param_groups=[{}])  # megatron's scheduler only sets lr / wd here
    scheduler = build_scheduler(optimizer, cfg)
    lrs = []
    for _ in range(cfg.iterations * cfg.updates_per_iteration):
        scheduler.step(1)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_scheduler_counts_optimizer_steps() -> None:
    assert _lrs(iterations=3) == [1.0, 1.0, 1.0]
    # 2 warm-up iterations of 2 updates each = 4 warm-up steps, then linear decay to min_lr.
    lrs = _lrs(iterations=4, updates_per_iteration=2, lr_warmup_iterations=2, lr_decay="linear", min_lr=0.5)
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4:] == pytest.approx([0.875, 0.75, 0.625, 0.5])
    cosine = _lrs(iterations=5, lr_decay="cosine", min_lr=0.0)
    assert cosine[-1] == 0.0 and all(a > b for a, b in zip(cosine[:-1], cosine[1:], strict=True))
    assert _lrs(iterations=2, lr_warmup_iterations=2) == [0.5, 1.0]  # warm-up over the whole run


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="checkpoint.optimizer_format='zero'"):
        CheckpointConfig(optimizer_format="zero").validate()  # type: ignore[arg-type]


def test_should_save_every_interval_and_after_the_last_iteration(tmp_path):
    """The trainer's save rule (training/grpo.py calls should_save with the run's last iteration)."""
    from grpo_megatron.checkpoint.config import CheckpointConfig
    from grpo_megatron.checkpoint.manager import CheckpointManager

    every3 = CheckpointManager(CheckpointConfig(save_interval=3), tmp_path, ps=None)
    assert [i for i in range(1, 8) if every3.should_save(i, final_iteration=7)] == [3, 6, 7]
    never = CheckpointManager(CheckpointConfig(save_interval=0), tmp_path, ps=None)
    assert not any(never.should_save(i, final_iteration=7) for i in range(1, 8))
