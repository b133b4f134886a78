"""Per-iteration metrics of a run: metrics.jsonl (the record of truth), wandb, TensorBoard, the console.

    logger = MetricsLogger(cfg.logging, run_dir=run_dir, job_config=cfg.to_dict(),
                           is_writer=ps.rank == 0, total_iterations=cfg.train.iterations,
                           start_iteration=start)     # start = 0 fresh, or the resumed iteration
    with logger:
        for it in range(start, cfg.train.iterations):
            ...
            logger.log(it, metrics)                   # every rank calls; only the writer writes
            logger.log_samples(it, rows)              # prompt, response, reward, answer (+ extra keys)
    # leaving the block (or logger.close()) writes run_dir/plot.png

Iterations count from 1 (0 = before training: an initial evaluation). Every line of metrics.jsonl has `iteration`, then every key of REQUIRED_KEYS
in that order (null where the trainer gave none this iteration, e.g. eval/accuracy between
evaluations), then the other keys sorted (reward/<component>, ...). Non-finite floats are written as
null so the file is strict JSON (jq, pandas). On resume, lines with iteration >= the resumed one are
dropped, so the file equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from grpo_megatron.fileio import write_text_atomic
from grpo_megatron.logging_utils.config import LoggingConfig
from grpo_megatron.logging_utils.console import ConsoleReporter, make_console
from grpo_megatron.logging_utils.plot import write_plot

# The stable keys of every metrics.jsonl line, in order (issue 6 item 6). `reward/<component>` keys
# (one per reward function) follow them, with any other metric the trainer logs.
REQUIRED_KEYS: tuple[str, ...] = (
    "iteration",
    "reward/mean",
    "eval/accuracy",
    "loss/policy",
    "kl",
    "clip_frac",
    "entropy",
    "response_len/mean",
    "mismatch/logprob_abs_diff",
    "time/rollout",
    "time/reward",
    "time/ref_logprob",
    "time/old_logprob",
    "time/train",
    "time/sync",
    "time/iteration",
    "throughput/tokens_per_s",
)

SAMPLE_KEYS: tuple[str, ...] = ("prompt", "response", "reward", "answer")
"""Keys every row given to MetricsLogger.log_samples must have."""

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
PLOT_FILE = "plot.png"
WANDB_ID_FILE = "wandb_run_id"


# ----------------------------------------------------------------------------------------------------
# Records and JSONL files (pure helpers)


def scalar(key: str, value: Any) -> int | float | None:
    """A metric value as a JSON number: ints stay ints, tensors/numpy scalars become Python numbers,
    NaN/inf and None become None. Anything else is a TypeError naming the key."""
    if value is None:
        return None
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalars
        try:
            value = value.item()
        except (ValueError, RuntimeError) as exc:
            raise TypeError(f"metric {key!r} is not a scalar ({exc}); log one number per key") from exc
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {key!r} has type {type(value).__name__}; log an int or float")


def metrics_record(
    iteration: int, metrics: Mapping[str, Any], required_keys: Sequence[str] = REQUIRED_KEYS
) -> dict[str, int | float | None]:
    """One metrics.jsonl line: iteration, ``required_keys`` in order (None where absent), then the rest sorted."""
    if "iteration" in metrics and metrics["iteration"] != iteration:
        raise ValueError(f"metrics['iteration']={metrics['iteration']} differs from iteration={iteration}")
    record: dict[str, int | float | None] = {"iteration": int(iteration)}
    for key in required_keys:
        if key != "iteration":
            record[key] = scalar(key, metrics.get(key))
    bad_names = [k for k in metrics if not isinstance(k, str)]
    if bad_names:
        raise TypeError(f"metric names must be strings, got {bad_names!r}")
    for key in sorted(k for k in metrics if k not in record):
        record[key] = scalar(key, metrics[key])
    return record


def json_line(record: Mapping[str, Any]) -> str:
    """The JSONL text of one record (deterministic: same record, same bytes)."""
    return json.dumps(record, ensure_ascii=False, allow_nan=False, default=_json_default) + "\n"


def _json_default(value: Any) -> Any:
    # Sample rows may carry tensors or numpy values in extra columns; anything else becomes its text.
    if hasattr(value, "tolist") and callable(value.tolist):
        return value.tolist()
    return str(value)


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of each line of a JSONL file. A torn last line (a write cut by a crash)
    is skipped; any other unreadable line is a ValueError naming file and line."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").split("\n")
    torn_tail = lines[-1] != ""  # a complete file ends with a newline
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            if torn_tail and number == len(lines):
                return
            raise ValueError(f"{path}:{number}: not a JSON line ({exc}); fix or delete that line") from exc
        if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
            raise ValueError(
                f"{path}:{number}: a record needs an integer 'iteration'; fix or delete that line"
            )
        yield number, record


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl / samples.jsonl file, in file order."""
    return [record for _, record in iter_jsonl(Path(path))]


def truncate_jsonl(path: Path, iteration: int) -> int | None:
    """Keep only the lines with iteration < `iteration` (and drop a torn last line); atomic (tmp +
    rename). Returns the last kept iteration, or None when no line is left."""
    if not path.exists():
        return None
    kept = [record for _, record in iter_jsonl(path) if record["iteration"] < iteration]
    write_text_atomic(path, "".join(json_line(record) for record in kept))
    return max((record["iteration"] for record in kept), default=None)


# ----------------------------------------------------------------------------------------------------
# The logger


class MetricsLogger:
    """Metrics sinks of one run. Built on every rank; only the writer (is_writer=True, rank 0) creates
    files, starts wandb/TensorBoard and prints; on the other ranks every method returns at once."""

    def __init__(
        self,
        cfg: LoggingConfig,
        *,
        run_dir: Path,
        job_config: dict[str, Any],
        is_writer: bool,
        total_iterations: int,
        start_iteration: int | None = None,
        console: Any = None,
        required_keys: Sequence[str] = REQUIRED_KEYS,
    ):
        """start_iteration: the first iteration this process will log (0 for a fresh run, the resumed
        iteration otherwise); later lines in the run directory's files are dropped before anything
        starts, and wandb continues the same run when earlier lines remain. None = keep the files as
        they are (call truncate_from before logging when resuming).
        console: a rich Console to print to (tests); default stdout.
        required_keys: keys every line carries (null where absent); GRPO's stable keys by default,
        fewer for runs that are not GRPO (the SFT cold start)."""
        cfg.validate()
        if total_iterations < 1:
            raise ValueError(f"total_iterations={total_iterations} must be >= 1 (train.iterations)")
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.is_writer = is_writer
        self.total_iterations = total_iterations
        self.required_keys = tuple(required_keys)
        self._closed = False
        self._plot_path: Path | None = None
        self._metrics_file: IO[str] | None = None
        self._last_iteration: int | None = None
        self._wandb_run: Any = None
        self._tb_writer: Any = None
        self._reporter: ConsoleReporter | None = None
        if not is_writer:
            return

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.samples_path = self.run_dir / SAMPLES_FILE
        self._job_config = job_config
        self._reporter = ConsoleReporter(console or make_console(), total_iterations, cfg.progress_bar)
        # Truncation (which also drops a torn last line) comes before the sinks open, so wandb knows
        # whether this continues a run and TensorBoard purges the dropped steps.
        first = start_iteration if start_iteration is not None else sys.maxsize
        self._last_iteration = truncate_jsonl(self.metrics_path, first)
        truncate_jsonl(self.samples_path, first)
        self._reporter.start_at(0 if self._last_iteration is None else self._last_iteration)
        self._metrics_file = open(self.metrics_path, "a", encoding="utf-8", buffering=1)
        if cfg.wandb_mode != "disabled":
            self._wandb_run = self._start_wandb()
        if cfg.tensorboard:
            resumed = start_iteration is not None and start_iteration > 0
            self._tb_writer = self._start_tensorboard(purge_step=start_iteration if resumed else None)

    # -- sinks ---------------------------------------------------------------------------------------

    def _start_wandb(self) -> Any:
        mode = self.cfg.wandb_mode
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(
                f"logging.wandb_mode={mode} needs the wandb package: pip install wandb, "
                "or set logging.wandb_mode=disabled"
            ) from exc
        # One wandb run per run directory: a resumed job (earlier lines kept) continues it; a fresh
        # start in the same directory gets a new id, so its steps are not dropped as already seen.
        id_path = self.run_dir / WANDB_ID_FILE
        if self._last_iteration is not None and id_path.exists():
            run_id = id_path.read_text(encoding="utf-8").strip()
        else:
            run_id = secrets.token_hex(4)
            write_text_atomic(id_path, run_id + "\n")
        try:
            return wandb.init(
                mode=mode,
                project=self.cfg.wandb_project,
                name=self.cfg.wandb_run_name or self.run_dir.resolve().name,
                dir=str(self.run_dir),
                config=self._job_config,
                id=run_id,
                resume="allow",
                settings=wandb.Settings(quiet=True),
            )
        except Exception as exc:  # wandb raises several types (UsageError, CommError, ...)
            raise RuntimeError(
                f"wandb.init failed with logging.wandb_mode={mode} "
                f"(logging.wandb_project={self.cfg.wandb_project!r}): {exc}. Fix the login/network, or "
                "set logging.wandb_mode=offline (then `wandb sync <run_dir>/wandb/offline-run-*`) "
                "or logging.wandb_mode=disabled"
            ) from exc

    def _start_tensorboard(self, purge_step: int | None) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError(
                f"logging.tensorboard=true needs the tensorboard package ({exc}): pip install tensorboard, "
                "or set logging.tensorboard=false"
            ) from exc
        # purge_step makes TensorBoard discard the events of the dropped iterations on resume.
        writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=purge_step)
        if purge_step is None:
            config_text = json.dumps(self._job_config, indent=2, default=str)
            writer.add_text("config", "```\n" + config_text + "\n```", global_step=0)
        return writer

    # -- public API ----------------------------------------------------------------------------------

    def log(self, iteration: int, metrics: Mapping[str, Any]) -> None:
        """Record one iteration's metrics: a line in metrics.jsonl (always), wandb/TensorBoard and the
        console line every logging.log_interval iterations (and with every evaluation and the last
        iteration), the progress bar every call."""
        if not self.is_writer:
            return
        self._check_open()
        record = metrics_record(iteration, metrics, self.required_keys)
        if self._last_iteration is not None and iteration <= self._last_iteration:
            raise ValueError(
                f"iteration {iteration} logged after iteration {self._last_iteration} in {self.metrics_path}; "
                f"when resuming, pass start_iteration={iteration} or call truncate_from({iteration}) first"
            )
        assert self._metrics_file is not None
        self._metrics_file.write(json_line(record))
        self._metrics_file.flush()
        self._last_iteration = iteration

        report = (
            iteration % self.cfg.log_interval == 0
            or iteration == self.total_iterations - 1
            or record["eval/accuracy"] is not None
        )
        assert self._reporter is not None
        self._reporter.update(iteration, record, print_line=report)
        if not report:
            return
        values = {k: v for k, v in record.items() if k != "iteration" and v is not None}
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=iteration)
        if self._tb_writer is not None:
            for key, value in values.items():
                self._tb_writer.add_scalar(key, value, global_step=iteration)
            self._tb_writer.flush()

    def log_samples(self, iteration: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """A table of sample rollouts (each row: prompt, response, reward, answer, plus any extra keys):
        printed as a rich table, appended to samples.jsonl (one line per row), and a wandb.Table."""
        if not self.is_writer:
            return
        self._check_open()
        for index, row in enumerate(rows):
            missing = [k for k in SAMPLE_KEYS if k not in row]
            if missing:
                raise ValueError(
                    f"log_samples row {index} lacks {', '.join(missing)}; every row needs "
                    f"{', '.join(SAMPLE_KEYS)}"
                )
        if not rows:
            return
        records = []
        for row in rows:
            record: dict[str, Any] = {"iteration": int(iteration)}
            record.update({k: row[k] for k in SAMPLE_KEYS})
            record["reward"] = scalar("reward", row["reward"])
            record.update({k: row[k] for k in row if k not in record})
            records.append(record)
        with open(self.samples_path, "a", encoding="utf-8") as f:
            f.writelines(json_line(r) for r in records)

        assert self._reporter is not None
        self._reporter.print_samples(iteration, rows, self.cfg.samples_max_chars)
        if self._wandb_run is not None:
            import wandb

            columns = list(records[0])
            for r in records[1:]:
                columns += [k for k in r if k not in columns]
            data = [[_wandb_cell(r.get(c)) for c in columns] for r in records]
            self._wandb_run.log({"samples": wandb.Table(columns=list(columns), data=data)}, step=iteration)

    def truncate_from(self, iteration: int) -> None:
        """Resume at `iteration`: drop the lines of metrics.jsonl and samples.jsonl with iteration >=
        it, and the TensorBoard events from that step on. wandb keeps what it has (its server ignores
        steps it has already seen); metrics.jsonl is the record of truth."""
        if not self.is_writer:
            return
        self._check_open()
        assert self._metrics_file is not None and self._reporter is not None
        self._metrics_file.close()
        self._last_iteration = truncate_jsonl(self.metrics_path, iteration)
        truncate_jsonl(self.samples_path, iteration)
        self._metrics_file = open(self.metrics_path, "a", encoding="utf-8", buffering=1)
        self._reporter.start_at(iteration)
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = self._start_tensorboard(purge_step=iteration)

    def close(self) -> Path | None:
        """Flush and close every sink, stop the progress bar, and write run_dir/plot.png (reward/mean
        and eval/accuracy over iterations, from the whole metrics.jsonl). Returns the plot's path on
        the writer when at least one iteration was logged, else None. Safe to call twice."""
        return self._close(exit_code=0)

    def _close(self, exit_code: int) -> Path | None:
        if not self.is_writer or self._closed:
            return self._plot_path
        self._closed = True
        assert self._reporter is not None
        self._reporter.close()
        if self._metrics_file is not None:
            self._metrics_file.flush()
            os.fsync(self._metrics_file.fileno())
            self._metrics_file.close()
        if self._tb_writer is not None:
            self._tb_writer.close()
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=exit_code)
        records = read_jsonl(self.metrics_path)
        if records:
            self._plot_path = write_plot(records, self.run_dir / PLOT_FILE, title=self.run_dir.resolve().name)
            self._reporter.print(f"metrics: {self.metrics_path}  plot: {self._plot_path}")
        return self._plot_path

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MetricsLogger used after close()")

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close(exit_code=0 if exc_type is None else 1)


def _wandb_cell(value: Any) -> Any:
    # wandb.Table cells must be JSON-like; tensors and other objects go in as lists or text.
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return _json_default(value)
