"""Dry run of a layout at full scale (up to 1024+ ranks) in one CPU process, with no real memory.

For a job config and a world size:

1. Rank mappings, every rank: megatron-core's own ``RankGenerator`` (the function
   ``initialize_model_parallel`` builds its groups from) lists every TP / PP / DP / CP / EP / ETP /
   EDP group of the world; each kind must partition the ranks into groups of the configured size,
   and the EP groups must hand every routed expert to exactly one member.
2. Real parallel state, per rank class: for representative ranks, torch's fake process group
   (``torch.testing._internal.distributed.fake_pg``, backend ``fake`` with a ``FakeStore``: every
   collective is a no-op) stands in for the world, megatron's ``initialize_model_parallel`` runs
   exactly as in a job, and the rank's groups and ranks must equal step 1's.
3. Parameter shapes, per rank class: our ``models.builder.build_gpt_model`` builds the rank's
   ``GPTModel`` on the meta device; every parameter's canonical name (``bridge.layout``) and shard
   shape must equal the planner's unsharded tensor table (``planner.model_states.canonical_tensors``)
   split by the layout, and the names must match the adapter's weight rules.
4. Per-rank parameter bytes for every rank (from its pipeline stage), cross-checked against the
   built models.

Rank classes: ranks of one pipeline stage hold equally shaped shards (TP/ETP split evenly, every EP
rank the same number of experts), so a class is a pipeline stage. Its representatives are the
stage's first and last rank (TP rank 0 and tp-1, EP rank 0 and ep-1, DP rank 0 and the last), so
both ends of every expert range are built; ``every_rank=True`` initialises and builds every rank.

Only for this dry run, ``_meta_device_for_megatron`` points ``torch.cuda.current_device()`` at the
meta device while a model is built (megatron creates its GPU-path tensors on that device; with the
meta device they take no memory) and restores it afterwards. It touches nothing else and never runs
in training: the dry run refuses to start inside an initialised process group.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_megatron.planner.memory import DTYPE_BYTES, human_count
from grpo_megatron.planner.model_states import (
    Layout,
    ModelDims,
    TensorSpec,
    canonical_tensors,
    rank_param_counts,
    rank_tensors,
)

if TYPE_CHECKING:
    from grpo_megatron.config import JobConfig
    from grpo_megatron.distributed.bootstrap import ParallelState

# megatron's default group order (initialize_model_parallel's `order`), used by our bootstrap too.
ORDER = "tp-cp-ep-dp-pp"


@dataclass(frozen=True)
class RankClass:
    """Ranks of one pipeline stage: same parameter shapes."""

    pp_rank: int
    ranks: int
    params: int
    param_bytes: int
    built_ranks: tuple[int, ...]


@dataclass
class DryRunReport:
    """What the dry run checked and found."""

    world_size: int
    layout: Layout
    classes: list[RankClass]
    param_bytes_by_rank: list[int]
    checks: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors


# ----------------------------------------------------------------------------------------------------
# 1. Every group of the world, from megatron's RankGenerator


def all_groups(layout: Layout) -> dict[str, list[list[int]]]:
    """Every process group of each kind, as lists of global ranks (megatron's own generator)."""
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order=ORDER)
    expert = RankGenerator(tp=layout.etp, ep=layout.ep, dp=layout.edp, pp=layout.pp, cp=1, order=ORDER)
    return {
        "tp": dense.get_ranks("tp"),
        "pp": dense.get_ranks("pp"),
        "cp": dense.get_ranks("cp"),
        "dp": dense.get_ranks("dp"),
        "dp_cp": dense.get_ranks("dp-cp"),
        "ep": expert.get_ranks("ep"),
        "etp": expert.get_ranks("tp"),
        "edp": expert.get_ranks("dp"),
        "expert_pp": expert.get_ranks("pp"),
    }


def group_sizes(layout: Layout) -> dict[str, int]:
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "cp": layout.cp,
        "dp": layout.dp,
        "dp_cp": layout.dp * layout.cp,
        "ep": layout.ep,
        "etp": layout.etp,
        "edp": layout.edp,
        "expert_pp": layout.pp,
    }


def partition_errors(groups: Mapping[str, list[list[int]]], layout: Layout) -> list[str]:
    """Each kind of group must split range(world) into disjoint groups of the configured size."""
    errors = []
    world = set(range(layout.world_size))
    for kind, size in group_sizes(layout).items():
        seen: list[int] = [r for g in groups[kind] for r in g]
        bad_size = [g for g in groups[kind] if len(g) != size]
        if bad_size:
            errors.append(
                f"{kind} groups: {len(bad_size)} group(s) not of size {size}, e.g. {bad_size[0][:8]}"
            )
        if len(seen) != len(set(seen)) or set(seen) != world:
            errors.append(f"{kind} groups do not partition the {layout.world_size} ranks exactly once")
    if sorted(map(sorted, groups["pp"])) != sorted(map(sorted, groups["expert_pp"])):
        errors.append("expert pipeline groups differ from the dense pipeline groups")
    return errors


def expert_ownership_errors(groups: Mapping[str, list[list[int]]], num_experts: int, ep: int) -> list[str]:
    """Inside every EP group, member j owns experts [j*E/ep, (j+1)*E/ep): all E exactly once."""
    if not num_experts:
        return []
    local = num_experts // ep
    errors = []
    for group in groups["ep"]:
        owned = [e for j in range(len(group)) for e in range(j * local, (j + 1) * local)]
        if sorted(owned) != list(range(num_experts)):
            errors.append(f"EP group {group[:8]}...: experts not covered exactly once")
    return errors


def index_in(groups: list[list[int]], rank: int) -> tuple[list[int], int]:
    """The group holding ``rank`` and the rank's index in it."""
    for g in groups:
        if rank in g:
            return g, g.index(rank)
    raise ValueError(f"rank {rank} is in no group")


# ----------------------------------------------------------------------------------------------------
# 2./3. One rank's real megatron parallel state on the fake process group, and its model on meta


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, layout: Layout) -> Iterator[None]:
    """Default process group = torch's fake backend at (rank, world_size); megatron's groups on top.
    Torn down on exit, so the next rank starts clean."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            order=ORDER,
            create_gloo_process_groups=False,  # gloo cannot be created over a fake store
        )
        yield
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


def parallel_state_here(rank: int, layout: Layout, device: Any) -> ParallelState:
    """Our ParallelState read from megatron's parallel_state, exactly as bootstrap.init_distributed does."""
    from grpo_megatron.distributed.bootstrap import parallel_state_from_megatron

    return parallel_state_from_megatron(
        world_size=layout.world_size, rank=rank, local_rank=0, device=device, parallel=layout
    )


def state_errors(ps: ParallelState, groups: Mapping[str, list[list[int]]]) -> list[str]:
    """megatron's groups and ranks for this rank must equal the generator's."""
    import torch.distributed as dist

    errors = []
    for kind, group, rank_in in (
        ("tp", ps.tp_group, ps.tp_rank),
        ("pp", ps.pp_group, ps.pp_rank),
        ("cp", ps.cp_group, ps.cp_rank),
        ("dp", ps.dp_group, ps.dp_rank),
        ("dp_cp", ps.dp_cp_group, None),
        ("ep", ps.ep_group, ps.ep_rank),
        ("etp", ps.etp_group, ps.etp_rank),
        ("edp", ps.edp_group, None),
    ):
        expected, index = index_in(groups[kind], ps.rank)
        actual = dist.get_process_group_ranks(group)
        if sorted(actual) != sorted(expected):
            errors.append(
                f"rank {ps.rank}: megatron's {kind} group {actual[:8]} != generator's {expected[:8]}"
            )
        if rank_in is not None and rank_in != index:
            errors.append(
                f"rank {ps.rank}: megatron's {kind} rank {rank_in} != its index {index} in the group"
            )
    return errors


@contextlib.contextmanager
def _meta_device_for_megatron() -> Iterator[None]:
    """Dry run only: megatron's GPU-path tensors (``device=torch.cuda.current_device()``) and every
    factory call without a device land on the meta device while a model is built."""
    import torch

    def meta_device() -> Any:  # megatron passes it on as a device=: the meta device works there
        return torch.device("meta")

    original = torch.cuda.current_device
    torch.cuda.current_device = meta_device
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.cuda.current_device = original


def build_meta_model(hf: Mapping[str, Any], cfg: JobConfig, ps: ParallelState, seed: int) -> Any:
    """This rank's GPTModel with every parameter on the meta device (no memory)."""

    from grpo_megatron.distributed.megatron_compat import cpu_model_parallel_seed
    from grpo_megatron.models.builder import build_gpt_model

    # The dry run builds on the meta device in a process of its own (dry_run applied the CPU
    # fixes there, whatever the machine has): it seeds the CPU tracker.
    cpu_model_parallel_seed(seed)
    import warnings

    with _meta_device_for_megatron(), warnings.catch_warnings():
        # megatron warns for every expert layer with etp=1 under sequence parallelism: expected here
        warnings.filterwarnings("ignore", message=r"`sequence_parallel` is set to `True`, but tensor model")
        model, _ = build_gpt_model(hf, cfg.model, ps)
    return model


def shape_errors(
    model: Any, ps: ParallelState, layout: Layout, expected: list[tuple[TensorSpec, tuple[int, ...]]]
) -> list[str]:
    """Every built parameter against the planner's table: name, shard shape, partition dim."""
    from grpo_megatron.bridge.layout import shard_layouts

    want = {spec.name: (spec, shape) for spec, shape in expected}
    errors = []
    got: set[str] = set()
    for local_name, param, sl in shard_layouts(model, ps):
        got.add(sl.canonical_name)
        if sl.canonical_name not in want:
            errors.append(
                f"rank {ps.rank}: built {local_name} ({sl.canonical_name}) is not in the planner's table"
            )
            continue
        spec, shape = want[sl.canonical_name]
        if tuple(param.shape) != shape:
            errors.append(
                f"rank {ps.rank}: {sl.canonical_name} shard {tuple(param.shape)} != unsharded {spec.shape} "
                f"split by the layout = {shape}"
            )
        split = layout.etp if spec.is_expert else layout.tp
        if split > 1 and sl.partition_dim != spec.partition_dim:
            errors.append(
                f"rank {ps.rank}: {sl.canonical_name} split along {sl.partition_dim}, expected {spec.partition_dim}"
            )
        if sl.is_expert != spec.is_expert:
            errors.append(
                f"rank {ps.rank}: {sl.canonical_name} is_expert={sl.is_expert}, expected {spec.is_expert}"
            )
    missing = sorted(set(want) - got)
    if missing:
        errors.append(f"rank {ps.rank}: {len(missing)} expected parameter(s) not built, e.g. {missing[:3]}")
    return errors


def rule_name_errors(hf: Mapping[str, Any], tensors: list[TensorSpec]) -> list[str]:
    """The planner's tensor names must be exactly the adapter's canonical weight-rule names."""
    from grpo_megatron.models.registry import get_adapter

    ours = {t.name for t in tensors}
    # Buffers are not parameters; a load-only rule (the tied output layer) exists only where a
    # last pipeline stage holds its own copy.
    rules = {
        r.mcore for r in get_adapter(hf).weight_rules(hf) if not r.buffer and (r.export or r.mcore in ours)
    }
    if rules == ours:
        return []
    return [
        f"planner table vs adapter weight rules: only in the table {sorted(ours - rules)[:3]}, "
        f"only in the rules {sorted(rules - ours)[:3]}"
    ]


# ----------------------------------------------------------------------------------------------------
# The whole dry run


def representative_ranks(
    groups: Mapping[str, list[list[int]]], layout: Layout, every_rank: bool
) -> list[int]:
    """First and last rank of each pipeline stage (or all ranks)."""
    if every_rank:
        return list(range(layout.world_size))
    stage_of = {r: g.index(r) for g in groups["pp"] for r in g}
    picked: list[int] = []
    for stage in range(layout.pp):
        members = sorted(r for r, s in stage_of.items() if s == stage)
        picked += sorted({members[0], members[-1]})
    return picked


def dry_run(
    cfg: JobConfig, hf: Mapping[str, Any], world_size: int, *, every_rank: bool = False, build: bool = True
) -> DryRunReport:
    """Check ``cfg``'s layout at ``world_size`` ranks (the config must validate at that size)."""
    import torch
    import torch.distributed as dist

    from grpo_megatron.distributed.bootstrap import quiet_expected_warnings
    from grpo_megatron.models.builder import padded_vocab_size

    if dist.is_initialized():
        raise RuntimeError(
            "dry_run needs a process without a process group: run it from `grpo-megatron plan`"
        )
    start = time.perf_counter()
    quiet_expected_warnings()
    from grpo_megatron.distributed.megatron_compat import apply_megatron_compat

    # No device here (meta tensors, fake process groups): megatron's CUDA assumptions are worked
    # around as for a CPU job, so the planner runs the same on a laptop and a GPU node.
    apply_megatron_compat("cpu")
    layout = Layout.from_config(cfg.parallel, world_size)
    dims = ModelDims.from_hf(hf)
    vp = padded_vocab_size(dims.vocab, cfg.model.make_vocab_size_divisible_by, layout.tp)
    # The builder on this machine uses megatron's local spec: compare with that table.
    tensors = canonical_tensors(hf, padded_vocab=vp, pp=layout.pp, te=False)
    pbytes = DTYPE_BYTES[cfg.model.dtype]

    groups = all_groups(layout)
    errors = partition_errors(groups, layout)
    errors += expert_ownership_errors(groups, dims.num_experts, layout.ep)
    errors += rule_name_errors(hf, tensors)
    checks = [
        f"{kind} groups partition {world_size} ranks ({len(groups[kind])} x {size})"
        for kind, size in group_sizes(layout).items()
    ]
    if dims.num_experts:
        checks.append(f"{len(groups['ep'])} EP groups each own all {dims.num_experts} experts exactly once")

    stage_of = {r: g.index(r) for g in groups["pp"] for r in g}
    counts = {s: rank_param_counts(tensors, layout, dims, s) for s in range(layout.pp)}
    bytes_by_rank = [counts[stage_of[r]].total * pbytes for r in range(world_size)]

    built: dict[int, list[int]] = {s: [] for s in range(layout.pp)}
    for rank in representative_ranks(groups, layout, every_rank):
        with fake_world(rank, world_size, layout):
            ps = parallel_state_here(rank, layout, torch.device("meta"))
            errors += state_errors(ps, groups)
            if build:
                model = build_meta_model(hf, cfg, ps, cfg.train.seed)
                expected = rank_tensors(tensors, layout, dims, ps.pp_rank, ps.ep_rank)
                errors += shape_errors(model, ps, layout, expected)
                n = sum(p.numel() for p in model.parameters())
                if n != counts[ps.pp_rank].total:
                    errors.append(
                        f"rank {rank}: built {n} parameters, planner says {counts[ps.pp_rank].total}"
                    )
                built[ps.pp_rank].append(rank)
                del model
    n_built = sum(len(v) for v in built.values())
    checks.append(
        f"megatron parallel state on the fake process group matches the generator at {n_built or 'the sampled'} rank(s)"
    )
    if build:
        checks.append(
            f"{n_built} meta-device models: every shard shape equals the unsharded shape split by the layout"
        )

    classes = [
        RankClass(
            pp_rank=s,
            ranks=sum(1 for r in stage_of if stage_of[r] == s),
            params=counts[s].total,
            param_bytes=counts[s].total * pbytes,
            built_ranks=tuple(built[s]),
        )
        for s in range(layout.pp)
    ]
    return DryRunReport(
        world_size=world_size,
        layout=layout,
        classes=classes,
        param_bytes_by_rank=bytes_by_rank,
        checks=checks,
        errors=errors,
        seconds=time.perf_counter() - start,
    )


def render(report: DryRunReport) -> Any:
    """A rich renderable: checks, per-class parameter bytes, errors."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"dry run: {report.world_size} ranks, parameters per rank", title_justify="left")
    for col in ("pipeline stage", "ranks", "parameters", "GiB", "built at ranks"):
        table.add_column(col, justify="right" if col != "built at ranks" else "left")
    for c in report.classes:
        shown = ", ".join(map(str, c.built_ranks[:4])) + (" ..." if len(c.built_ranks) > 4 else "")
        table.add_row(
            str(c.pp_rank), str(c.ranks), human_count(c.params), f"{c.param_bytes / 2**30:.2f}", shown
        )
    parts: list[Any] = [table]
    parts += [Text(f"ok: {c}") for c in report.checks]
    parts += [Text(f"error: {e}", style="red") for e in report.errors[:50]]
    verdict = "dry run passed" if report.ok else f"dry run FAILED ({len(report.errors)} problem(s))"
    parts.append(
        Text(f"{verdict} in {report.seconds:.1f} s", style="bold green" if report.ok else "bold red")
    )
    return Group(*parts)
