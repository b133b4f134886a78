"""Imports point one way: no module of grpo_megatron/ imports a module of a higher layer.

The layers (lowest first) are the ones docs/architecture.md ("Layering") describes. A package's
``config.py`` (its config section) sits in the lowest layer whatever its package, so any component
may read another's section while the job config that assembles them sits above the components.
Packages of one layer do not import each other either (except in the base layer). Every import counts: module level, inside
functions (lazy imports) and under ``if TYPE_CHECKING:``, since a type names a dependency too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "grpo_megatron"

LAYERS: tuple[tuple[str, ...], ...] = (
    # package root, file helpers, every <package>/config.py, and the modules a section validates
    # against (the problem generators' names and arguments: pure Python, used by data.generator's check;
    # the SGLang CPU path a CPU job's engines take, and the compatibility module it reads, which imports
    # nothing of the package; the sampler's truncation, pure tensor math the rollout section names)
    (
        "grpo_megatron",
        "fileio",
        "<section>",
        "data.generators",
        "rollout.sglang.cpu_path",
        "rollout.sglang.compat",
        "algorithm.truncation",
    ),
    ("distributed", "logging_utils", "algorithm", "rewards", "data"),
    ("models",),
    ("bridge",),
    ("config",),  # config/: JobConfig (the sections assembled), the YAML loader, cross-section validation
    ("rollout", "checkpoint"),
    ("training",),
    ("planner", "commands"),
    ("cli",),
    ("__main__",),
)
"""Units, lowest layer first. A unit is a top-level module or package of grpo_megatron, or
``<section>`` for a package's config section, or a module named ``package.module`` (listed where
it serves a lower layer than its package)."""

KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}
"""(file, imported module) pairs allowed to point upward for now, each with the issue removing it."""

RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    """The layering unit of a dotted module name inside grpo_megatron."""
    parts = module.split(".")
    if len(parts) == 1:
        return "grpo_megatron"
    if len(parts) == 3 and parts[2] == "config" and (PACKAGE / parts[1]).is_dir():
        return "<section>"
    for depth in (4, 3):
        if ".".join(parts[1:depth]) in RANK:
            return ".".join(parts[1:depth])
    return parts[1]


def is_module(dotted: str) -> bool:
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every grpo_megatron module ``path`` imports, anywhere in the file.
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                found.append((node.lineno, candidate if is_module(candidate) else source))
    return [
        (line, name) for line, name in found if name == "grpo_megatron" or name.startswith("grpo_megatron.")
    ]


def layering_violations() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        here = unit_of(module_name(path))
        for line, target in imported_modules(path):
            there = unit_of(target)
            if there == here or RANK[there] < RANK[here] or RANK[there] == RANK[here] == 0:
                continue
            if (rel, target) in KNOWN_EXCEPTIONS:
                continue
            problems.append(
                f"{rel}:{line}: {here} (layer {RANK[here]}) imports {target} from {there} (layer {RANK[there]}): "
                + (
                    "packages of one layer must not import each other"
                    if RANK[there] == RANK[here]
                    else "upward"
                )
            )
    return problems


def test_every_unit_has_a_layer():
    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    missing = sorted(units - RANK.keys())
    assert not missing, f"add {missing} to LAYERS in tests/test_layering.py and docs/architecture.md"


def test_imports_point_down():
    problems = layering_violations()
    assert not problems, "lower layers import higher ones:\n" + "\n".join(problems)


def test_known_exceptions_still_exist():
    """An exception whose import is gone must be deleted, so the list only shrinks."""
    present = {
        (path.relative_to(PACKAGE.parent).as_posix(), target)
        for path in PACKAGE.rglob("*.py")
        for _, target in imported_modules(path)
    }
    stale = sorted(set(KNOWN_EXCEPTIONS) - present)
    assert not stale, f"delete these from KNOWN_EXCEPTIONS in tests/test_layering.py: {stale}"


@pytest.mark.parametrize(
    ("source", "importer", "expected"),
    [
        ("from grpo_megatron.training.forward_backward import MicroBatch\n", "bridge/x.py", "upward"),
        ("def f():\n    from grpo_megatron.training import grpo\n", "models/x.py", "upward"),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo_megatron.config import JobConfig\n",
            "models/x.py",
            "upward",
        ),
        ("from grpo_megatron.checkpoint import manager\n", "rollout/x.py", "must not import each other"),
        ("from ..models.registry import get_adapter\n", "training/x.py", None),
        ("from grpo_megatron.rollout.config import RolloutConfig\n", "models/x.py", None),
        ("from grpo_megatron.models.registry import get_adapter\n", "models/config.py", "upward"),
    ],
)
def test_the_checker_sees_every_kind_of_import(tmp_path, monkeypatch, source, importer, expected):
    """The checker itself, on a throwaway copy of the package layout: module-level, function-level,
    TYPE_CHECKING and relative imports, and the config-section rule."""
    import shutil

    fake = tmp_path / "grpo_megatron"
    shutil.copytree(PACKAGE, fake, ignore=shutil.ignore_patterns("__pycache__"))
    target = fake / importer
    target.write_text(source)
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    problems = [p for p in layering_violations() if p.startswith(f"grpo_megatron/{importer}:")]
    if expected is None:
        assert not problems
    else:
        assert len(problems) == 1 and expected in problems[0], problems


MAX_FUNCTION_LINES = 90
"""The longest function (``def`` to its last line, docstring included) the package may hold."""

JOB_CONFIG_TAKERS = (
    "config/",
    "training/job.py",
    "training/grpo.py",
    "training/sft.py",
    "training/sanity.py",
    "commands/",
    "planner/",
    "cli.py",
)
"""Where a function may take the whole ``JobConfig``: the config package, the training wiring and the
loops' entry points, and the commands (``planner/`` is the ``plan`` command, layer 7). Everything else
takes its config sections."""


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((rel, node))
    return found


def test_no_function_is_longer_than_the_limit():
    too_long = [
        f"grpo_megatron/{rel}:{fn.lineno} {fn.name}: {fn.end_lineno - fn.lineno + 1} lines"
        for rel, fn in _functions()
        if fn.end_lineno is not None and fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(too_long)


def test_components_take_their_config_sections_not_the_job_config():
    takers = []
    for rel, fn in _functions():
        args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
        if any(a.annotation is not None and "JobConfig" in ast.unparse(a.annotation) for a in args):
            if not rel.startswith(JOB_CONFIG_TAKERS):
                takers.append(f"grpo_megatron/{rel}:{fn.lineno} {fn.name}")
    assert not takers, "these take the whole JobConfig; pass them their sections instead:\n" + "\n".join(
        takers
    )
