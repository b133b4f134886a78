"""Metrics logging: metrics.jsonl keys and resume truncation, wandb offline, TensorBoard, the console
(progress bar on a terminal, plain lines otherwise), sample tables, the final plot, non-writer ranks."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from grpo_megatron.config import ConfigError, load_config
from grpo_megatron.logging_utils.config import LoggingConfig
from grpo_megatron.logging_utils.console import cut_middle, format_line
from grpo_megatron.logging_utils.metrics import (
    REQUIRED_KEYS,
    MetricsLogger,
    metrics_record,
    read_jsonl,
)
from tests.helpers.metrics import missing_required_keys

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_moe.yaml"
JOB = {"train": {"iterations": 6, "seed": 1}, "model": {"hf_path": "examples/tiny_moe"}}


def iteration_metrics(it: int) -> dict[str, Any]:
    """Deterministic metrics of iteration `it`: every required key, two reward components, an
    evaluation every third iteration."""
    metrics: dict[str, Any] = {key: 0.1 * it + k for k, key in enumerate(REQUIRED_KEYS[1:])}
    metrics["reward/mean"] = 0.1 + 0.1 * it
    metrics["reward/format"] = 0.5
    metrics["reward/accuracy"] = 0.05 * it
    del metrics["eval/accuracy"]
    if it % 3 == 0:
        metrics["eval/accuracy"] = 0.2 + 0.05 * it
    return metrics


def sample_rows(it: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt": f"What is {it} + {j}?",
            "response": f"<answer>{it + j}</answer>",
            "reward": 1.0,
            "answer": str(it + j),
            "advantage": 0.5 - j,
        }
        for j in range(2)
    ]


def text_console(terminal: bool = False) -> Console:
    """A console writing into a string buffer, as a terminal or as a log file."""
    return Console(file=io.StringIO(), force_terminal=terminal, width=120, color_system=None)


def make_logger(tmp_path: Path, cfg: LoggingConfig | None = None, **kwargs: Any) -> MetricsLogger:
    kwargs.setdefault("is_writer", True)
    kwargs.setdefault("console", text_console())
    return MetricsLogger(
        cfg or LoggingConfig(), run_dir=tmp_path / "run", job_config=JOB, total_iterations=6, **kwargs
    )


def run(logger: MetricsLogger, iterations: range) -> Path | None:
    with logger:
        for it in iterations:
            logger.log(it, iteration_metrics(it))
            logger.log_samples(it, sample_rows(it))
    return logger.close()


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep wandb's own files inside tmp_path, and away from any account or network."""
    for var in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_BASE_URL", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")


# ---------------------------------------------------------------------------------------------------
# metrics.jsonl


def test_jsonl_one_line_per_iteration_with_stable_keys_in_order(tmp_path: Path) -> None:
    run(make_logger(tmp_path), range(6))
    path = tmp_path / "run" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 6
    records = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}")) for line in lines
    ]
    extras = ["reward/accuracy", "reward/format"]
    for it, record in enumerate(records):
        assert list(record) == list(REQUIRED_KEYS) + extras
        assert record["iteration"] == it
        assert record["reward/mean"] == pytest.approx(0.1 + 0.1 * it)
        # eval/accuracy is present on every line, null between evaluations
        assert (record["eval/accuracy"] is None) == (it % 3 != 0)
    assert missing_required_keys(records) == []
    assert read_jsonl(path) == records


def test_record_values_normalised() -> None:
    record = metrics_record(
        3,
        {
            "kl": torch.tensor(0.25),
            "entropy": float("nan"),
            "clip_frac": float("inf"),
            "response_len/mean": 7,
            "reward/format": True,
        },
    )
    assert record["iteration"] == 3
    assert record["kl"] == 0.25 and isinstance(record["kl"], float)
    assert record["entropy"] is None and record["clip_frac"] is None  # strict JSON: no NaN/inf
    assert record["response_len/mean"] == 7 and record["reward/format"] == 1
    assert record["time/train"] is None  # a required key the trainer did not give
    assert missing_required_keys([record]) == [
        k for k in REQUIRED_KEYS if k not in ("iteration", "kl") and k != "response_len/mean"
    ]
    with pytest.raises(TypeError, match="'loss/policy'"):
        metrics_record(0, {"loss/policy": "high"})
    with pytest.raises(TypeError, match="'kl'"):
        metrics_record(0, {"kl": torch.ones(2)})
    with pytest.raises(ValueError, match="iteration"):
        metrics_record(0, {"iteration": 1})


def test_truncate_from_makes_resumed_files_equal_uninterrupted(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    run(make_logger(reference), range(6))

    # Interrupted after iteration 4, with a line torn by the kill; the checkpoint is from iteration 3.
    for start_kwargs in ({}, {"start_iteration": 3}):
        resumed = tmp_path / f"resumed{len(start_kwargs)}"
        run(make_logger(resumed), range(5))
        with open(resumed / "run" / "metrics.jsonl", "a") as f:
            f.write('{"iteration": 5, "reward/me')
        logger = make_logger(resumed, **start_kwargs)
        if not start_kwargs:
            with pytest.raises(ValueError, match="truncate_from"):
                logger.log(3, iteration_metrics(3))  # would duplicate iteration 3
            logger.truncate_from(3)
        run(logger, range(3, 6))
        for name in ("metrics.jsonl", "samples.jsonl"):
            assert (resumed / "run" / name).read_bytes() == (reference / "run" / name).read_bytes(), name
        assert not list((resumed / "run").glob(".*.tmp"))


def test_corrupt_line_in_the_middle_names_file_and_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"iteration": 0}\nnot json\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        make_logger(tmp_path, start_iteration=1)


# ---------------------------------------------------------------------------------------------------
# Samples and console


def test_samples_jsonl_and_row_validation(tmp_path: Path) -> None:
    logger = make_logger(tmp_path)
    with pytest.raises(ValueError, match="row 1 lacks answer"):
        logger.log_samples(0, [sample_rows(0)[0], {"prompt": "p", "response": "r", "reward": 0.0}])
    logger.log_samples(0, sample_rows(0))
    logger.close()
    records = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert [r["answer"] for r in records] == ["0", "1"]
    assert list(records[0]) == ["iteration", "prompt", "response", "reward", "answer", "advantage"]


def test_console_without_terminal_prints_plain_lines(tmp_path: Path) -> None:
    console = text_console(terminal=False)
    cfg = LoggingConfig(log_interval=2, samples_max_chars=40)
    with make_logger(tmp_path, cfg, console=console) as logger:
        for it in range(6):
            logger.log(it, iteration_metrics(it))
        logger.log_samples(5, [{"prompt": "p", "response": "x" * 100 + "END", "reward": None, "answer": "a"}])
    out = console.file.getvalue()
    assert "\x1b" not in out and "\r" not in out  # no cursor movement or colour in a log file
    lines = [line for line in out.splitlines() if line.startswith("it ")]
    # every 2nd iteration, plus iteration 3 (an evaluation) and 5 (the last)
    assert [line.split()[1] for line in lines] == ["0/6", "2/6", "3/6", "4/6", "5/6"]
    assert lines[1].startswith("it 2/6 reward=0.3000 loss=")
    assert "eval_acc=0.3500" in lines[2]
    assert "END" in out and "x" * 41 not in out  # the response was cut in the middle
    assert "plot.png" in out


def test_console_on_terminal_shows_progress_bar(tmp_path: Path) -> None:
    console = text_console(terminal=True)
    with make_logger(tmp_path, console=console) as logger:
        assert logger._reporter is not None and logger._reporter.use_bar
        for it in range(3):
            logger.log(it, iteration_metrics(it))
    out = console.file.getvalue()
    assert "GRPO" in out and "reward 0.3000" in out and "eval_acc 0.2000" in out
    no_bar = make_logger(tmp_path / "b", LoggingConfig(progress_bar=False), console=text_console(True))
    assert no_bar._reporter is not None and not no_bar._reporter.use_bar
    no_bar.close()


def test_line_and_cut_helpers() -> None:
    assert format_line(0, 10, {"reward/mean": 0.5, "eval/accuracy": None}) == "it 0/10 reward=0.5000"
    assert cut_middle("abcdefghijklmnopqrstuvwxyz", 9) == "abc … xyz"
    assert cut_middle("short", 9) == "short"


# ---------------------------------------------------------------------------------------------------
# wandb, TensorBoard, plot


@pytest.mark.launches
@pytest.mark.usefixtures("wandb_env")
def test_wandb_offline_writes_run_directory_and_resume_continues_it(tmp_path: Path) -> None:
    cfg = LoggingConfig(wandb_mode="offline", wandb_run_name="unit")
    run(make_logger(tmp_path, cfg), range(3))
    wandb_dir = tmp_path / "run" / "wandb"
    runs = sorted(wandb_dir.glob("offline-run-*"))
    assert len(runs) == 1
    run_id = (tmp_path / "run" / "wandb_run_id").read_text().strip()
    assert runs[0].name.endswith(run_id)
    data_file = runs[0] / f"run-{run_id}.wandb"
    assert data_file.stat().st_size > 0
    assert list((runs[0] / "files" / "media" / "table").glob("samples_*.table.json"))

    # A resumed job continues the same wandb run; a fresh start in the same directory gets a new one.
    run(make_logger(tmp_path, cfg, start_iteration=2), range(2, 4))
    assert (tmp_path / "run" / "wandb_run_id").read_text().strip() == run_id
    run(make_logger(tmp_path, cfg, start_iteration=0), range(1))
    assert (tmp_path / "run" / "wandb_run_id").read_text().strip() != run_id


def test_tensorboard_event_file_has_the_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(make_logger(tmp_path, LoggingConfig(tensorboard=True)), range(4))
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    rewards = acc.Scalars("reward/mean")
    assert [e.step for e in rewards] == [0, 1, 2, 3]
    assert [e.value for e in rewards] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [0, 3]


def test_plot_png_written(tmp_path: Path) -> None:
    from matplotlib.image import imread

    path = run(make_logger(tmp_path), range(6))
    assert path == tmp_path / "run" / "plot.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(path).shape
    assert (width, height) == (800, 600)
    # a run that logged nothing has nothing to plot
    assert make_logger(tmp_path / "empty").close() is None


@pytest.mark.usefixtures("wandb_env")
def test_non_writer_ranks_write_nothing(tmp_path: Path) -> None:
    console = text_console()
    cfg = LoggingConfig(wandb_mode="offline", tensorboard=True)
    logger = make_logger(tmp_path, cfg, is_writer=False, console=console)
    with logger:
        logger.truncate_from(0)
        for it in range(2):
            logger.log(it, iteration_metrics(it))
            logger.log_samples(it, sample_rows(it))
    assert logger.close() is None
    assert not (tmp_path / "run").exists()
    assert console.file.getvalue() == ""


# ---------------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"log_interval": 0}, "logging.log_interval"),
        ({"wandb_mode": "sometimes"}, "logging.wandb_mode"),
        ({"wandb_mode": "offline", "wandb_project": ""}, "logging.wandb_project"),
        ({"samples_max_chars": 5}, "logging.samples_max_chars"),
        ({"run_dir": ""}, "logging.run_dir"),
    ],
)
def test_bad_config_values_name_the_field(tmp_path: Path, changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LoggingConfig(**changes).validate()
    with pytest.raises(ValueError, match=field):
        make_logger(tmp_path, LoggingConfig(**changes))
    assert not (tmp_path / "run").exists()


def test_config_file_override_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="logging.wandb_mode"):
        load_config(EXAMPLE, ["logging.wandb_mode=sometimes"])
    cfg = load_config(EXAMPLE, ["logging.samples_max_chars=500", "logging.progress_bar=false"])
    assert cfg.logging.samples_max_chars == 500 and cfg.logging.progress_bar is False
    assert math.isclose(cfg.logging.log_interval, 1)
