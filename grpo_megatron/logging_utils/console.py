"""Console output of a run: a rich progress bar with the live reward on a terminal, plain lines in logs.

On a terminal the bar stays at the bottom and the per-iteration lines and sample tables scroll above it
(rich's Live redirects other prints there too). When stdout is not a terminal (CI, Slurm logs, `| tee`)
there is no bar and no cursor movement: one line per logged iteration, never wrapped, no colour codes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

# (key, label, format) of the values in one iteration's line, in this order; missing/null ones are left out.
LINE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward/mean", "reward", "{:.4f}"),
    ("eval/accuracy", "eval_acc", "{:.4f}"),
    ("loss/policy", "loss", "{:.4g}"),
    ("sft/loss", "sft_loss", "{:.4g}"),
    ("kl", "kl", "{:.3g}"),
    ("clip_frac", "clip", "{:.3g}"),
    ("entropy", "entropy", "{:.3g}"),
    ("response_len/mean", "resp_len", "{:.1f}"),
    ("time/iteration", "time", "{:.2f}s"),
    ("throughput/tokens_per_s", "tok/s", "{:.0f}"),
)

# Width of the console when stdout is not a terminal and COLUMNS is unset (rich would use 80, which
# squeezes the sample table into unreadable columns).
LOG_WIDTH = 160


def make_console() -> Console:
    """A console on stdout; wider than rich's default 80 columns when writing to a log file."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = LOG_WIDTH
    return console


def format_line(iteration: int, total_iterations: int, record: Mapping[str, Any]) -> str:
    """One concise line for an iteration, e.g. `it 7/100 reward=0.4125 loss=-0.0123 time=3.21s`."""
    parts = [f"it {iteration}/{total_iterations}"]
    for key, label, fmt in LINE_FIELDS:
        value = record.get(key)
        if value is not None:
            parts.append(f"{label}={fmt.format(value)}")
    return " ".join(parts)


def cut_middle(text: str, max_chars: int) -> str:
    """`text` shortened to at most max_chars by replacing its middle with ' … ' (start and end of a
    response both matter: the reasoning opens, the answer closes)."""
    if len(text) <= max_chars:
        return text
    keep = max_chars - 3
    head = (keep + 1) // 2
    return text[:head] + " … " + text[len(text) - (keep - head) :]


def samples_table(iteration: int, rows: Sequence[Mapping[str, Any]], max_chars: int) -> Table:
    """A rich table of sample rollouts: prompt, response, answer, reward."""
    table = Table(title=f"sample rollouts, iteration {iteration}", show_lines=True, expand=True)
    table.add_column("prompt", ratio=3, overflow="fold")
    table.add_column("response", ratio=5, overflow="fold")
    table.add_column("answer", ratio=1, overflow="fold")
    table.add_column("reward", justify="right", no_wrap=True)
    for row in rows:
        reward = row["reward"]
        table.add_row(
            cut_middle(str(row["prompt"]), max_chars),
            cut_middle(str(row["response"]), max_chars),
            cut_middle(str(row["answer"]), max_chars),
            "-" if reward is None else f"{float(reward):.3f}",
        )
    return table


class ConsoleReporter:
    """Progress bar (terminal only) plus one line per logged iteration and the sample tables."""

    def __init__(self, console: Console, total_iterations: int, progress_bar: bool):
        self.console = console
        self.total_iterations = total_iterations
        self.use_bar = progress_bar and console.is_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._completed = 0
        self._reward: float | None = None
        self._accuracy: float | None = None

    def _status(self) -> str:
        reward = "-" if self._reward is None else f"{self._reward:.4f}"
        accuracy = "-" if self._accuracy is None else f"{self._accuracy:.4f}"
        return f"reward {reward}  eval_acc {accuracy}"

    def _ensure_bar(self) -> None:
        # Started at the first update rather than at construction, so the redirect of stdout/stderr
        # that rich's Live does lasts only while iterations run.
        if not self.use_bar or self._progress is not None:
            return
        self._progress = Progress(
            TextColumn("[bold]GRPO"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            refresh_per_second=2,
        )
        self._task = self._progress.add_task(
            "grpo", total=self.total_iterations, completed=self._completed, status=self._status()
        )
        self._progress.start()

    def start_at(self, iteration: int) -> None:
        """Resume: iterations before `iteration` count as done."""
        self._completed = min(max(iteration, 0), self.total_iterations)
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=self._completed)

    def update(self, iteration: int, record: Mapping[str, Any], print_line: bool) -> None:
        """Advance the bar to iteration done (iterations count from 1), refresh the live reward/accuracy, maybe print a line."""
        if record.get("reward/mean") is not None:
            self._reward = float(record["reward/mean"])
        if record.get("eval/accuracy") is not None:
            self._accuracy = float(record["eval/accuracy"])
        self._completed = min(max(iteration, 0), self.total_iterations)
        if print_line:
            self.console.print(
                format_line(iteration, self.total_iterations, record),
                soft_wrap=True,
                markup=False,
                highlight=False,
            )
        self._ensure_bar()
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=self._completed, status=self._status(), refresh=True)

    def print_samples(self, iteration: int, rows: Sequence[Mapping[str, Any]], max_chars: int) -> None:
        self.console.print(samples_table(iteration, rows, max_chars))

    def print(self, text: str) -> None:
        self.console.print(text, soft_wrap=True, markup=False, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
