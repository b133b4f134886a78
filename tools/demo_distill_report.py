"""The report of `make demo DISTILL=1` (examples/demo_distill.sh): held-out accuracy against
iterations of on-policy distillation beside plain GRPO from the same cold start, the teacher's
accuracy (the GRPO run's last evaluation: the teacher is that run's exported model) and the
iteration at which each run first reaches 90% of it. Writes report.md and distill_vs_grpo.png into --out.

    .venv/bin/python tools/demo_distill_report.py --grpo runs/demo --distill runs/demo-distill \
        --out runs/demo-distill
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FRACTION = 0.9
FRACTIONS = (0.5, 0.7, 0.8, 0.9, 0.95)
"""The other fractions of the teacher's accuracy the report names the first iteration of."""


def _show(iteration: int | None) -> str:
    return "-" if iteration is None else str(iteration)


def evaluations(run: Path) -> list[tuple[int, float]]:
    """(iteration, eval/accuracy) of every held-out evaluation in ``run``'s metrics.jsonl."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record: dict[str, Any] = json.loads(line)
        if record.get("eval/accuracy") is not None:
            out.append((int(record["iteration"]), float(record["eval/accuracy"])))
    return out


def first_reaching(curve: Sequence[tuple[int, float]], target: float) -> int | None:
    """The first evaluated iteration whose accuracy is at least ``target``; None if none is."""
    return next((it for it, acc in curve if acc >= target), None)


def seconds(run: Path) -> float | None:
    summary = run / "summary.json"
    return float(json.loads(summary.read_text())["seconds"]) if summary.is_file() else None


def report(grpo: Path, distill: Path) -> tuple[str, dict[str, list[tuple[int, float]]], float]:
    """The markdown table, the two curves and the target accuracy."""
    curves = {"GRPO": evaluations(grpo), "on-policy distillation": evaluations(distill)}
    teacher = curves["GRPO"][-1][1]
    target = FRACTION * teacher
    lines = [
        f"Teacher: {grpo}/hf, held-out accuracy {teacher:.1%} (the GRPO run's last evaluation, iteration "
        f"{curves['GRPO'][-1][0]}); target {FRACTION:.0%} of it = {target:.1%}.",
        "",
        "| run | before | first >= target (iteration) | evaluations | last | best | wall time |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, curve), run in zip(curves.items(), (grpo, distill), strict=True):
        reached = first_reaching(curve, target)
        where = f"{reached}" if reached is not None else f"not within {curve[-1][0]}"
        step = curve[1][0] - curve[0][0] if len(curve) > 1 else 0
        wall = seconds(run)
        lines.append(
            f"| {name} | {curve[0][1]:.1%} | {where} | every {step} | {curve[-1][1]:.1%} (it {curve[-1][0]}) "
            f"| {max(a for _, a in curve):.1%} | {f'{wall:.0f} s' if wall is not None else '-'} |"
        )
    lines += [
        "",
        "| fraction of the teacher | GRPO (iteration) | distillation (iteration) |",
        "|---|---|---|",
    ]
    for fraction in FRACTIONS:
        at = [first_reaching(c, fraction * teacher) for c in curves.values()]
        lines.append(f"| {fraction:.0%} ({fraction * teacher:.1%}) | " + " | ".join(map(_show, at)) + " |")
    grpo_at, distill_at = (first_reaching(c, target) for c in curves.values())
    if grpo_at and distill_at:
        lines += ["", f"Distillation reached the target in {distill_at / grpo_at:.2f}x GRPO's iterations."]
    return "\n".join(lines) + "\n", curves, target


def plot(curves: dict[str, list[tuple[int, float]]], target: float, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for (name, curve), color in zip(curves.items(), ("tab:blue", "tab:orange"), strict=True):
        ax.plot(
            [i for i, _ in curve], [a for _, a in curve], color=color, marker="o", markersize=3, label=name
        )
    ax.axhline(target, color="gray", linestyle="--", label=f"{FRACTION:.0%} of the teacher")
    ax.set_xlabel("iteration")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("make demo DISTILL=1: the same cold start, GRPO vs on-policy distillation")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpo", type=Path, required=True, help="the GRPO run (the teacher's run directory)")
    parser.add_argument("--distill", type=Path, required=True, help="the distillation run directory")
    parser.add_argument("--out", type=Path, required=True, help="where report.md and distill_vs_grpo.png go")
    args = parser.parse_args(argv)
    text, curves, target = report(args.grpo, args.distill)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(text)
    plot(curves, target, args.out / "distill_vs_grpo.png")
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
