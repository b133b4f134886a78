"""Every example in README.md and docs/ works as written, so that a renamed flag, field, target or
file fails here and not for a reader.

Each ``bash`` block is read command by command (continuation lines joined, comments dropped):

- ``grpo-megatron ...``, ``python -m grpo_megatron ...``, ``torchrun ... -m grpo_megatron ...``,
  ``launch/local.sh ...`` and ``launch/slurm/train.sbatch ...`` lines parse with the real CLI parser;
  their config loads with its overrides (``config/loader.py``: every key names a field, every value
  has its type); a config of the user's own (``my_job.yaml``) still has its overrides checked;
- ``make`` targets and variables exist in the Makefile;
- ``tools/`` and ``bench/`` scripts exist and know every ``--flag`` given to them (their ``--help``);
- every path into the repository exists;
- ``grpo-megatron check`` commands on the repository's configs run and exit 0, except in blocks
  marked ``<!-- cluster-only -->`` (the line before the fence), which need a cluster and are checked
  statically only.

In the prose, every inline code span that names a config field (``train.max_staleness``,
``rollout.engine=sglang``) must name a real one, and every one naming a source file
(``rollout/sglang/launch.py:CPU_SERVER_ARGS``) a file that exists, holding the name after the colon.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import re
import shlex
import subprocess
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from grpo_megatron.cli import build_parser
from grpo_megatron.config import ConfigError, JobConfig, load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
GENERATED = REPO / "docs" / "reference"
"""Pages generated from the code (tests/test_docs_reference.py keeps them true): commands only."""
CLUSTER_ONLY = "<!-- cluster-only -->"
SHELL = {"bash", "sh", "shell", "console"}
TOP_DIRS = ("examples", "tools", "launch", "docs", "tests", "bench", "requirements", "grpo_megatron", ".ci")
SECTIONS = tuple(f.name for f in dataclasses.fields(JobConfig))


@dataclass(frozen=True)
class Command:
    where: str
    """file:line of the command."""
    tokens: tuple[str, ...]
    env: dict[str, str]
    cluster_only: bool


def _fenced_blocks(path: Path) -> list[tuple[int, str, str, bool]]:
    """(line, language, text, cluster-only) of every fenced block of ``path``."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        match = re.match(r"^(```+)\s*(\w*)", lines[i])
        if not match:
            i += 1
            continue
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(match.group(1)))
        out.append((i + 1, match.group(2), "\n".join(lines[i + 1 : end]), previous == CLUSTER_ONLY))
        i = end + 1
    return out


def _commands(path: Path) -> list[Command]:
    found = []
    for line, lang, text, cluster_only in _fenced_blocks(path):
        if lang not in SHELL:
            continue
        for offset, logical in enumerate(text.replace("\\\n", " ").splitlines()):
            tokens = shlex.split(logical, comments=True)
            while tokens:  # `a && b`: each its own command
                cut = tokens.index("&&") if "&&" in tokens else len(tokens)
                head, tokens = tokens[:cut], tokens[cut + 1 :]
                env = {}
                while head and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", head[0]):
                    name, _, value = head.pop(0).partition("=")
                    env[name] = value
                if head:
                    where = f"{path.relative_to(REPO)}:{line + 1 + offset}"
                    found.append(Command(where, tuple(head), env, cluster_only))
    return found


COMMANDS = [c for path in DOCS if not path.is_relative_to(GENERATED) for c in _commands(path)]


def test_the_docs_have_examples_and_cluster_only_ones_are_marked() -> None:
    assert len(COMMANDS) > 40
    unmarked = [
        c.where
        for c in COMMANDS
        if c.tokens[0] in ("sbatch", "srun", "squeue", "sacct") and not c.cluster_only
    ]
    assert not unmarked, (
        f"{unmarked}: these need a cluster: put <!-- cluster-only --> on the line before their block's fence"
    )


# ----------------------------------------------------------------------------------------------------
# Config keys


def key_problem(key: str) -> str | None:
    """Why ``section.key`` (``reward.components[0].weight``) names no config field, or None."""
    cls: type = JobConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        match = re.fullmatch(r"(\w+)(\[\w+\])?", part)
        if match is None:
            return f"{key}: {part!r} is not a field name"
        name, index = match.groups()
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        if name not in fields:
            known = ", ".join(sorted(fields))
            return f"{'.'.join(parts[: i + 1])}: no field {name!r} in {cls.__name__} (fields: {known})"
        tp = hints[name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
            tp = args[0]
        if typing.get_origin(tp) is dict:
            return None  # model.hf_overrides.num_hidden_layers: the keys are the user's
        if typing.get_origin(tp) is list and index:
            tp = typing.get_args(tp)[0]
        if i == len(parts) - 1:
            return None
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            return f"{key}: {'.'.join(parts[: i + 1])} is a value, not a section"
        cls = tp
    return None


def test_key_problem_names_the_unknown_part() -> None:
    assert key_problem("train.max_staleness") is None
    assert key_problem("reward.components[0].weight") is None
    assert key_problem("model.hf_overrides.num_hidden_layers") is None
    assert key_problem("algorithm.kl") is None
    assert "no field 'max_stale'" in (key_problem("train.max_stale") or "")
    assert "is a value" in (key_problem("train.lr.x") or "")


# ----------------------------------------------------------------------------------------------------
# Commands


def _cli_args(c: Command) -> list[str] | None:
    """The arguments ``grpo-megatron`` gets from this command line, or None if it runs no CLI."""
    tokens = list(c.tokens)
    if tokens[0] == "grpo-megatron":
        return tokens[1:]
    for i, t in enumerate(tokens[:-1]):
        if t == "-m" and tokens[i + 1] == "grpo_megatron":
            return tokens[i + 2 :]
        if t.endswith(("launch/slurm/train.sbatch", "launch/slurm/node.sh")):
            return [c.env.get("COMMAND", "train"), *tokens[i + 1 :]]
    if tokens[0].endswith("launch/local.sh"):
        return tokens[1:]
    return None


def _parse(args: list[str], where: str) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: `grpo-megatron {' '.join(args)}` does not parse: {err.getvalue().strip()}")


def _in_repo(token: str) -> bool:
    return token.split("/", 1)[0] in TOP_DIRS and "/" in token and not re.search(r"[<*{]", token)


def _check_cli(c: Command, args: list[str]) -> list[str]:
    ns = _parse(args, c.where)
    if not ns.takes_config:
        return []
    problems = [f"{c.where}: {o}: {p}" for o in ns.overrides if (p := key_problem(o.split("=", 1)[0]))]
    config = REPO / ns.config
    if config.is_file():
        try:
            load_config(config, ns.overrides)
        except ConfigError as exc:
            problems.append(f"{c.where}: {exc}")
    elif _in_repo(ns.config):
        problems.append(f"{c.where}: no config {ns.config}")
    return problems


@functools.cache
def make_names() -> tuple[set[str], set[str]]:
    """The Makefile's targets and variables."""
    text = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M))
    variables = set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*[?:]?=", text, re.M))
    return targets, variables


def _check_make(c: Command) -> list[str]:
    targets, variables = make_names()
    problems = []
    for arg in c.tokens[1:]:
        if "=" in arg:
            if arg.split("=", 1)[0] not in variables:
                problems.append(f"{c.where}: make variable {arg.split('=', 1)[0]} is not in the Makefile")
        elif not arg.startswith("-") and arg not in targets:
            problems.append(f"{c.where}: make target {arg!r} is not in the Makefile")
    return problems


@functools.cache
def script_help(script: str) -> str:
    out = subprocess.run(
        [sys.executable, str(REPO / script), "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"{script} --help: {out.stderr[-2000:]}"
    return out.stdout


def _check_script(c: Command) -> list[str]:
    script = next((t for t in c.tokens if re.fullmatch(r"(tools|bench)/\w+\.py", t)), None)
    if script is None or not (REPO / script).is_file():
        return []
    text = script_help(script)
    return [
        f"{c.where}: {script} has no option {t}"
        for t in c.tokens
        if t.startswith("--") and t.split("=")[0] not in text
    ]


@pytest.mark.launches
def test_every_command_of_the_docs_checks_statically() -> None:
    problems = []
    for c in COMMANDS:
        values = [t.split("=", 1)[-1] for t in c.tokens]
        problems += [
            f"{c.where}: no such path {v}" for v in values if _in_repo(v) and not (REPO / v).exists()
        ]
        args = _cli_args(c)
        if args is not None:
            problems += _check_cli(c, args)
        elif c.tokens[0] == "make":
            problems += _check_make(c)
        problems += _check_script(c)
    assert not problems, "\n".join(problems)


@pytest.mark.launches
def test_the_check_commands_of_the_docs_run() -> None:
    runs = []
    for c in COMMANDS:
        args = _cli_args(c)
        if c.cluster_only or not args or args[0] != "check" or not (REPO / args[1]).is_file():
            continue
        out = subprocess.run(
            [sys.executable, "-m", "grpo_megatron", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        runs.append(c.where)
        assert out.returncode == 0, f"{c.where}: grpo-megatron {' '.join(args)}: {out.stderr[-3000:]}"
    assert runs, "no runnable `grpo-megatron check` example found"


# ----------------------------------------------------------------------------------------------------
# Prose


def _code_spans(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every inline code span outside fenced blocks."""
    spans, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            spans += [(number, m.group(2)) for m in re.finditer(r"(`+)(.+?)\1", line)]
    return spans


CONFIG_SPAN = re.compile(rf"^((?:{'|'.join(SECTIONS)})(?:\.\w+(?:\[\w+\])?)+)(?:\s*[=:].*)?$")
SOURCE_SPAN = re.compile(
    r"^((?:[\w.-]+/)+[\w.-]+\.(?:py|sh|yaml|sbatch|toml|txt|in|json))(?::([A-Za-z_][\w.]*))?"
)


@functools.cache
def source_roots() -> frozenset[str]:
    """First components a path of ours can start with: the repository's folders and every folder of
    the package (prose writes ``rollout/sglang/launch.py`` and ``phases/train.py`` alike)."""
    package = REPO / "grpo_megatron"
    return frozenset(
        [*TOP_DIRS, *(p.name for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__")]
    )


def _source_problem(path_text: str, symbol: str | None) -> str | None:
    """Why the span ``path_text[:symbol]`` names no file of ours (or no such name in it), or None."""
    if path_text.split("/", 1)[0] not in source_roots():
        return None  # another project's path (SGLang's srt/...), a placeholder (DIR/...), an output
    package = REPO / "grpo_megatron"
    found = next((p for p in (REPO / path_text, package / path_text) if p.is_file()), None)
    found = found or next(
        (p for p in sorted(package.rglob(Path(path_text).name)) if p.as_posix().endswith("/" + path_text)),
        None,
    )
    if found is None:
        return f"no file {path_text} in the repository or grpo_megatron/"
    first = symbol.split(".")[0] if symbol else None
    if first and not re.search(
        rf"^\s*(?:async\s+)?(?:def|class)\s+{first}\b|^\s*{first}\b\s*[:=]", found.read_text(), re.M
    ):
        return f"{path_text} defines no {first}"
    return None


def test_config_fields_and_source_files_named_in_the_prose_exist() -> None:
    problems = []
    for path in DOCS:
        if path.is_relative_to(GENERATED):
            continue
        for line, span in _code_spans(path):
            where = f"{path.relative_to(REPO)}:{line}"
            config = CONFIG_SPAN.match(span)
            if config and not span.split("=")[0].endswith((".sbatch", ".py", ".yaml", ".json", ".md")):
                problem = key_problem(re.sub(r"\[\d+\]", "[0]", config.group(1)))
                if problem:
                    problems.append(f"{where}: `{span}`: {problem}")
            if span.startswith("make "):
                problems += _check_make(Command(where, tuple(shlex.split(span)), {}, False))
            source = SOURCE_SPAN.match(span)
            if source and not re.search(r"[<*]|^(runs|logs|data|wandb)/", span):
                problem = _source_problem(source.group(1), source.group(2))
                if problem:
                    problems.append(f"{where}: `{span}`: {problem}")
    assert not problems, "\n".join(problems)


def test_a_renamed_flag_field_target_or_file_is_named() -> None:
    """What the checks above report, on examples that went stale (issue 51 found the first in the
    README: the CPU server arguments live in rollout/sglang/launch.py, not ipc.py)."""
    assert (
        _source_problem("rollout/sglang/ipc.py", "CPU_SERVER_ARGS")
        == "rollout/sglang/ipc.py defines no CPU_SERVER_ARGS"
    )
    assert _source_problem("rollout/sglang/launch.py", "CPU_SERVER_ARGS") is None
    assert (
        _source_problem("phases/no_such.py", None)
        == "no file phases/no_such.py in the repository or grpo_megatron/"
    )
    stale = Command(
        "doc.md:1", ("grpo-megatron", "check", "examples/demo.yaml", "train.max_stale=1"), {}, False
    )
    assert any("no field 'max_stale'" in p for p in _check_cli(stale, list(stale.tokens[1:])))
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        _check_cli(stale, ["plan", "examples/demo.yaml", "--gpus-per-nodes", "8"])
    make = Command("doc.md:2", ("make", "demos", "TSAK=tool"), {}, False)
    assert _check_make(make) == [
        "doc.md:2: make target 'demos' is not in the Makefile",
        "doc.md:2: make variable TSAK is not in the Makefile",
    ]
