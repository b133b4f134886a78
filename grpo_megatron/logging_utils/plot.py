"""The end-of-run plot: reward and evaluation accuracy over iterations, as a PNG in the run directory.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend switch), so it works
on headless machines and leaves any other matplotlib user in the process alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of `key` over metrics records, skipping records where it is missing or null."""
    xs: list[int] = []
    ys: list[float] = []
    for record in records:
        value = record.get(key)
        if value is not None:
            xs.append(int(record["iteration"]))
            ys.append(float(value))
    return xs, ys


def write_plot(records: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Draw reward/mean (top) and eval/accuracy (bottom) against iteration and write a PNG atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6), dpi=100)
    FigureCanvasAgg(fig)
    ax_reward, ax_eval = fig.subplots(2, 1, sharex=True)

    xs, ys = series(records, "reward/mean")
    ax_reward.plot(xs, ys, color="tab:blue", linewidth=1.5, marker="." if len(xs) < 50 else None)
    ax_reward.set_ylabel("reward/mean")
    ax_reward.grid(alpha=0.3)

    xs, ys = series(records, "eval/accuracy")
    if xs:
        ax_eval.plot(xs, ys, color="tab:green", linewidth=1.5, marker="o")
    else:
        ax_eval.text(0.5, 0.5, "no evaluation logged", ha="center", va="center", transform=ax_eval.transAxes)
    ax_eval.set_ylabel("eval/accuracy")
    ax_eval.set_xlabel("iteration")
    ax_eval.grid(alpha=0.3)

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    # Agg picks the format from the file name; the tmp name ends in .tmp, so name it explicitly.
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path
