"""`make demo` for several seeds, measured: the results table of docs/performance.md.

Runs ``examples/demo.sh`` once per seed (cold-start SFT, then GRPO, each a 2-process torchrun), one
seed after another, and reads what each phase wrote: ``<run>/sft/summary.json`` (the step whose
weights the cold start kept and their dev accuracy) and ``<run>/summary.json`` (held-out accuracy
before GRPO, at the last evaluation and at the best one, with their iterations). Per seed it also
records the wall time of each phase (as the phase reports it, start-up excluded) and of the whole
``demo.sh``, the CPU time of its processes (user + system of the children), and the 1-minute load
average before and after: on a machine shared with other work, wall time grows with the load while
CPU time hardly moves.

Prints a markdown table (one row per seed, then the acceptance figures: cold starts in the band,
median and minimum lift, largest drop from the best evaluation to the last, longest demo) with the
machine it ran on (CPU model, cores, memory, load), and writes it to ``--markdown``; ``--readme``
also replaces the part of that file (docs/performance.md) between the ``<!-- demo_seeds:begin -->`` and
``<!-- demo_seeds:end -->`` markers with it. Both are rewritten after every seed, and ``results.json``
keeps every row, so an interrupted run keeps what it measured: ``--from-results [MORE.json ...]``
redraws the table from ``<out>/results.json`` (and other runs' files) without running anything.

    .venv/bin/python bench/demo_seeds.py [--seeds 1234 7 3 11 42] [--out runs/demo_seeds] \
        [--readme docs/performance.md]

About 3-7 minutes a seed on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- demo_seeds:begin -->", "<!-- demo_seeds:end -->"


def machine() -> str:
    """CPU model, cores, memory, OS and Python, for the table's caption."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kib = int(
            next(
                x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")
            ).split()[1]
        )
        mem = f", {kib / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{model}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_seed(seed: int, run_dir: Path, python: str, overrides: list[str]) -> dict[str, object]:
    """One ``demo.sh`` for ``seed``; its log lands in ``run_dir.log``."""
    env = dict(os.environ, SEED=str(seed), RUN_DIR=str(run_dir), PYTHON=python)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_suffix(".log")
    load_before = os.getloadavg()[0]
    cpu_before = children_cpu_s()
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.run(
            ["bash", str(REPO / "examples" / "demo.sh"), *overrides],
            cwd=REPO,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            check=False,
        )
    wall = time.perf_counter() - start
    row: dict[str, object] = {
        "seed": seed,
        "returncode": proc.returncode,
        "wall_s": wall,
        "cpu_s": children_cpu_s() - cpu_before,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "log": str(log),
    }
    if proc.returncode != 0:
        print(f"seed {seed}: demo.sh exited {proc.returncode}; see {log}", file=sys.stderr)
        return row
    row["sft"] = json.loads((run_dir / "sft" / "summary.json").read_text())
    row["grpo"] = json.loads((run_dir / "summary.json").read_text())
    return row


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def mmss(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def table(rows: list[dict], band: tuple[float, float], caption: str) -> str:
    lines = [
        caption,
        "",
        "| seed | cold start: step kept (dev accuracy) | held-out accuracy before -> last (iteration) "
        "| best (iteration) | lift | last - best | wall: cold start / GRPO / `demo.sh` | CPU time | load before / after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    done = [r for r in rows if r["returncode"] == 0]
    for r in rows:
        if r["returncode"] != 0:
            lines.append(
                f"| {r['seed']} | failed (exit {r['returncode']}) | | | | | {mmss(r['wall_s'])} | "
                f"{r['cpu_s']:.0f} s | {r['load_before']:.1f} / {r['load_after']:.1f} |"
            )
            continue
        s, g = r["sft"], r["grpo"]
        lines.append(
            f"| {r['seed']} | {s['kept_step']} ({pct(s['eval/accuracy'])}) "
            f"| {pct(g['before'])} -> {pct(g['after'])} ({g['after_iteration']}) "
            f"| {pct(g['best'])} ({g['best_iteration']}) | {100 * (g['after'] - g['before']):+.1f} "
            f"| {100 * (g['after'] - g['best']):+.1f} "
            f"| {s['seconds']:.0f} s / {g['seconds']:.0f} s / {mmss(r['wall_s'])} | {r['cpu_s']:.0f} s "
            f"| {r['load_before']:.1f} / {r['load_after']:.1f} |"
        )
    if done:
        lifts = [100 * (r["grpo"]["after"] - r["grpo"]["before"]) for r in done]
        in_band = sum(band[0] <= r["sft"]["eval/accuracy"] <= band[1] for r in done)
        drop = max(100 * (r["grpo"]["best"] - r["grpo"]["after"]) for r in done)
        lines += [
            "",
            f"{len(done)} of {len(rows)} seeds ran; cold starts in the band {pct(band[0])}-{pct(band[1])}: "
            f"{in_band} of {len(done)}; lift median {statistics.median(lifts):+.1f}, minimum {min(lifts):+.1f} "
            f"points; largest drop from the best evaluation to the last: {drop:.1f} points; longest `demo.sh`: "
            f"{mmss(max(r['wall_s'] for r in done))}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 7, 3, 11, 42])
    parser.add_argument(
        "--out", type=Path, default=REPO / "runs" / "demo_seeds", help="one run directory per seed"
    )
    parser.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"))
    parser.add_argument("--markdown", type=Path, default=None, help="default: <out>/table.md")
    parser.add_argument(
        "--readme", type=Path, default=None, help="replace the table between the markers here"
    )
    parser.add_argument(
        "--from-results",
        type=Path,
        nargs="*",
        default=None,
        help="run nothing: redraw the table from <out>/results.json and these other results.json "
        "(an interrupted run and the seeds run after it)",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value, passed to the GRPO job")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from grpo_megatron.config import load_config

    band = load_config(REPO / "examples" / "demo.yaml").sft.target_accuracy_band or (0.0, 1.0)
    started = datetime.datetime.now(datetime.timezone.utc)
    commit = git_commit()  # the code the seeds run; taken before, as the tree may change while they run
    load_start = os.getloadavg()
    if args.from_results is not None:
        saved = [
            r
            for path in [args.out / "results.json", *args.from_results]
            for r in json.loads(path.read_text())
        ]
        info = saved[0].get("run", {}) if saved else {}
        started = datetime.datetime.fromisoformat(info.get("started", started.isoformat()))
        args.seeds = [r["seed"] for r in saved]
        write_table(
            args, saved, band, started, info.get("commit", "unknown"), tuple(info.get("load_start", ()))
        )
        return 0
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args.out / f"seed{seed}", args.python, args.overrides))
        rows[-1]["run"] = {"started": started.isoformat(), "commit": commit, "load_start": list(load_start)}
        print(json.dumps(rows[-1]), flush=True)
        (args.out / "results.json").write_text(
            json.dumps(rows, indent=1) + "\n"
        )  # kept if a later seed hangs
        write_table(args, rows, band, started, commit, load_start)
    return 0 if all(r["returncode"] == 0 for r in rows) else 1


def write_table(
    args: argparse.Namespace,
    rows: list[dict],
    band: tuple[float, float],
    started: datetime.datetime,
    commit: str,
    load_start: tuple[float, ...],
) -> None:
    """The table so far, to --markdown and --readme (after every seed: an interrupted run keeps its rows)."""
    # load averages (1/5/15 min) at the start and the end; redrawn from results.json, the 1-minute ones
    load_end = (rows[-1]["load_after"],) if args.from_results is not None else os.getloadavg()
    load_start = load_start or (rows[0]["load_before"],)
    caption = (
        f"Output of `bench/demo_seeds.py` ({started:%Y-%m-%d}, commit {commit}) on {machine()}; "
        f"load average {'/'.join(f'{x:.1f}' for x in load_start)} at the start, "
        f"{'/'.join(f'{x:.1f}' for x in load_end)} at the end. Lift = last - before, in points; "
        "wall times grow with the load, CPU time (all processes of the seed) hardly does."
    )
    commits: dict[str, list[str]] = {}  # rows redrawn from several runs' results.json name each run's code
    for r in rows:
        commits.setdefault(r.get("run", {}).get("commit", commit), []).append(str(r["seed"]))
    if len(commits) > 1:
        which = "; ".join(f"{c} for seed{'s' * (len(v) > 1)} {', '.join(v)}" for c, v in commits.items())
        caption = caption.replace(f"commit {commit}", f"commits {which}")
    text = table(rows, band, caption)
    if len(rows) == len(args.seeds):
        print(text)
    out_md = args.markdown or args.out / "table.md"
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(text)
    if args.readme:
        readme = args.readme.read_text()
        if BEGIN not in readme or END not in readme:
            raise SystemExit(f"{args.readme}: add the markers {BEGIN} and {END} around the table to replace")
        head, rest = readme.split(BEGIN, 1)
        args.readme.write_text(f"{head}{BEGIN}\n{text}{END}{rest.split(END, 1)[1]}")


def git_commit() -> str:
    """HEAD's short hash, with "+changes" when tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + (
            "+changes" if git("status", "--porcelain", "-uno") else ""
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
