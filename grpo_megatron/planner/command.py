"""`grpo-megatron plan CONFIG [overrides] --nodes N --gpus-per-node G [--gpu ...] [--dry-run]`.

The CLI validates the config at world size N x G before the handler runs (the two flags keep
``args.world_size`` equal to their product).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from grpo_megatron.config import JobConfig
    from grpo_megatron.planner.memory import MemoryPlan

EXIT_DOES_NOT_FIT = 1


class _WorldSize(argparse.Action):
    """Store --nodes / --gpus-per-node and keep world_size = nodes * gpus_per_node."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        if values < 1:
            parser.error(f"{option_string}={values} must be >= 1")
        setattr(namespace, self.dest, values)
        namespace.world_size = namespace.nodes * namespace.gpus_per_node


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, action=_WorldSize, help="number of nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=int, action=_WorldSize, help="GPUs per node (default 8)")
    parser.add_argument(
        "--gpu", choices=("h100", "h200", "custom"), default="h100", help="GPU model (default h100)"
    )
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="memory of a --gpu custom, in GiB")
    parser.add_argument(
        "--rollout-gpus-per-engine",
        type=int,
        default=None,
        help="override rollout.sglang.tp (GPUs one SGLang engine spans); printed as an override",
    )
    parser.add_argument(
        "--rollout-engine-ep",
        type=int,
        default=None,
        help="override rollout.sglang.ep (expert parallelism inside one SGLang engine); printed as an override",
    )
    parser.add_argument(
        "--offload-trainer",
        action="store_true",
        help="override train.offload_trainer=true; printed as an override",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="also build megatron's parallel state and the model's shapes on the meta device with a fake "
        "process group of the full world size, and check every shard and rank mapping",
    )
    parser.add_argument("--every-rank", action="store_true", help="dry run: initialise and build every rank")
    parser.add_argument(
        "--nvlink-gbps", type=float, default=370.0, help="weight-sync estimate: NVLink GB/s per GPU"
    )
    parser.add_argument(
        "--pcie-gbps", type=float, default=50.0, help="weight-sync estimate: PCIe GB/s per GPU"
    )
    parser.add_argument(
        "--ib-gbps", type=float, default=45.0, help="weight-sync estimate: InfiniBand GB/s per GPU"
    )
    parser.add_argument(
        "--copy-gbps", type=float, default=1300.0, help="weight-sync estimate: device copy GB/s"
    )
    parser.add_argument(
        "--phase-times",
        default=None,
        help="asynchronous layout: seconds per phase of a synchronous step, rollout=..,reward=..,train=..,sync=.. "
        "(or a synchronous run's metrics.jsonl) -> the expected asynchronous step time",
    )
    parser.add_argument(
        "--engine-gpus",
        type=int,
        default=None,
        help="asynchronous layout: GPUs of the engines (default: as the trainer)",
    )
    parser.add_argument(
        "--response-tokens",
        type=int,
        default=None,
        help="rollout time: the mean response length to plan for (default: half of rollout.max_new_tokens); "
        "a rollout beyond parallel.timeout_minutes or parallel.long_phase_timeout_s does not fit",
    )
    parser.add_argument(
        "--ckpt-gbps",
        type=float,
        default=2.0,
        help="stop on a signal: a node's checkpoint write bandwidth, GB/s",
    )
    parser.set_defaults(nodes=1, gpus_per_node=8, world_size=8)


OVERRIDES = (
    ("rollout_gpus_per_engine", "--rollout-gpus-per-engine", "rollout.sglang", "tp"),
    ("rollout_engine_ep", "--rollout-engine-ep", "rollout.sglang", "ep"),
    ("offload_trainer", "--offload-trainer", "train", "offload_trainer"),
)
"""Flags that change a config value: (argument, flag, section (dotted), field). ``plan`` says so when used."""


def apply_overrides(cfg: JobConfig, args: argparse.Namespace) -> tuple[JobConfig, list[str]]:
    """``cfg`` with the flags of ``OVERRIDES`` that were given, and one line per change."""
    import dataclasses

    said = []
    for arg, flag, section, name in OVERRIDES:
        value = getattr(args, arg, None)
        if value in (None, False):
            continue
        path = section.split(".")
        parts = [cfg]
        for key in path:
            parts.append(getattr(parts[-1], key))
        old = getattr(parts[-1], name)
        shown = [str(v).lower() if isinstance(v, bool) else str(v) for v in (value, old)]
        said.append(f"override: {section}.{name}={shown[0]} ({flag}; the config says {shown[1]})")
        changed: Any = dataclasses.replace(parts[-1], **{name: value})
        for key, parent in zip(reversed(path), reversed(parts[:-1]), strict=True):
            changed = dataclasses.replace(parent, **{key: changed})
        cfg = changed
    return cfg, said


def run(cfg: JobConfig, args: argparse.Namespace) -> int:
    """Print the placement, every phase's memory and the weight-sync estimate (and the dry run);
    exit 1 if it does not fit or the dry run fails."""
    from rich.console import Console
    from rich.text import Text

    from grpo_megatron.planner import memory, sync

    if args.gpu == "custom":
        if args.gpu_memory_gb is None:
            print("grpo-megatron plan: error: --gpu custom needs --gpu-memory-gb X")
            return 2
        gpu = memory.custom_gpu(args.gpu_memory_gb)
    else:
        gpu = memory.GPUS[args.gpu]
    cfg, overrides = apply_overrides(cfg, args)
    opts = memory.PlanOptions(gpus_per_node=args.gpus_per_node, gpu=gpu)
    hf = cfg.model.load_hf_config()
    console = Console(width=160)
    for line in overrides:
        console.print(Text(line, style="bold yellow"))
    try:
        plan = memory.plan_memory(cfg, hf, args.world_size, opts)
    except ValueError as exc:  # the placement refuses the config at this cluster, naming the field
        console.print(Text(f"grpo-megatron plan: {exc}", style="bold red"))
        return EXIT_DOES_NOT_FIT
    if not plan.fits:
        plan.suggestions = memory.suggest(cfg, hf, args.world_size, opts, plan)
    links = sync.Links(args.nvlink_gbps, args.pcie_gbps, args.ib_gbps, args.copy_gbps)
    placement = plan.placement
    estimates = []
    if placement.engines:
        estimates = sync.plan_sync(
            hf,
            plan.layout,
            gpus_per_node=args.gpus_per_node,
            gpus_per_engine=args.world_size // len(placement.engines),
            export_bytes=memory.engine_weight_bytes(cfg.model.dtype),
            links=links,
            engine_ep=placement.engine_ep,
        )
    receives = min((e.engine_gpu.received for e in estimates), default=None)
    console.print(memory.render(plan, cfg, receives / sync.GB if receives is not None else None))
    if estimates:
        console.print(sync.render(estimates, links), markup=False)
    if args.phase_times or cfg.generation_overlaps_training > 0:
        console.print(async_section(cfg, args, colocated=placement.colocated_sglang), markup=False)
    rc = 0 if plan.fits else EXIT_DOES_NOT_FIT
    rc = rollout_section(cfg, hf, plan, args, console) or rc
    sync_s = min((e.seconds for e in estimates), default=0.0)
    console.print(preemption_section(cfg, hf, plan, args, sync_s), markup=False)
    if args.dry_run:
        from grpo_megatron.planner.dry_run import dry_run
        from grpo_megatron.planner.dry_run import render as render_dry_run

        report = dry_run(cfg, hf, args.world_size, every_rank=args.every_rank)
        console.print(render_dry_run(report))
        rc = rc or (0 if report.ok else EXIT_DOES_NOT_FIT)
    return rc


def rollout_section(
    cfg: JobConfig, hf: Mapping[str, Any], plan: MemoryPlan, args: argparse.Namespace, console: Console
) -> int:
    """The rollout's time beside the timeouts it runs under (planner/rollout_time.py), at the mean
    response ``--response-tokens`` (default half of rollout.max_new_tokens); EXIT_DOES_NOT_FIT when it
    outlasts them, else 0. Nothing for engines without a planned KV pool."""
    from rich.text import Text

    from grpo_megatron.planner.rollout_time import render, rollout_time

    given = args.response_tokens
    if given is not None and not 0 < given <= cfg.rollout.max_new_tokens:
        console.print(
            Text(
                f"--response-tokens={given} must be in 1..rollout.max_new_tokens="
                f"{cfg.rollout.max_new_tokens}",
                style="bold red",
            )
        )
        return EXIT_DOES_NOT_FIT
    response = planned_response(cfg, args)
    estimate = rollout_time(cfg, hf, plan, response)
    if estimate is None:
        return 0
    planned_by = "--response-tokens" if given else "half of rollout.max_new_tokens; --response-tokens"
    console.print(render(estimate, cfg, planned_by), markup=False)
    verdict = ("rollout FITS its timeout" if estimate.fits else "rollout DOES NOT FIT its timeout") + (
        f": ~{estimate.seconds / 60:.0f} of {estimate.timeout_s / 60:.0f} min"
    )
    console.print(Text(verdict, style="bold green" if estimate.fits else "bold red"))
    return 0 if estimate.fits else EXIT_DOES_NOT_FIT


def planned_response(cfg: JobConfig, args: argparse.Namespace) -> int:
    """The mean response the estimates plan for: ``--response-tokens``, else half the limit."""
    return int(args.response_tokens or max(1, cfg.rollout.max_new_tokens // 2))


def preemption_section(
    cfg: JobConfig, hf: Mapping[str, Any], plan: MemoryPlan, args: argparse.Namespace, sync_s: float
) -> str:
    """How long a stop on a signal takes and the Slurm settings that cover it (planner/preemption.py)."""
    from grpo_megatron.planner.preemption import render, stop_time

    stop = stop_time(
        cfg, hf, plan, response_tokens=planned_response(cfg, args), sync_s=sync_s, write_gbps=args.ckpt_gbps
    )
    return render(stop, cfg)


def async_section(cfg: JobConfig, args: argparse.Namespace, *, colocated: bool) -> str:
    """The asynchronous layout (engine GPUs vs trainer GPUs, or ``colocated``: the engines on the
    trainer's GPUs, as the runtime places them) and its expected step time (planner/async_layout.py)."""
    from pathlib import Path

    from grpo_megatron.planner import async_layout

    staleness = max(cfg.train.max_staleness, 1)
    if colocated and not args.phase_times:
        return f"Asynchronous layout (train.max_staleness={staleness}): " + async_layout.COLOCATED.format(
            gpus=args.world_size
        )
    if not args.phase_times:
        return (
            f"Asynchronous layout (train.max_staleness={cfg.train.max_staleness}): trainer GPUs {args.world_size}, "
            f"engine GPUs {args.engine_gpus or args.world_size} of their own; give --phase-times (a synchronous "
            "run's metrics.jsonl, or rollout=..,train=..) for the expected step time"
        )
    path = Path(args.phase_times)
    times = (
        async_layout.PhaseTimes.from_metrics(path)
        if path.is_file()
        else async_layout.PhaseTimes.parse(args.phase_times)
    )
    if colocated:
        return async_layout.render(async_layout.time_sliced(times, args.world_size), staleness)
    estimate = async_layout.estimate(times, args.world_size, args.engine_gpus or args.world_size)
    return async_layout.render(estimate, staleness)
