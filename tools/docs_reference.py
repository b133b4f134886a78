"""The docs' reference pages, generated from the code: ``docs/reference/config.md`` from the job
config's dataclasses (every section and field: type, default, docstring, and the validation messages
that name it), ``docs/reference/cli.md`` from the command line's argparse parsers.

    python tools/docs_reference.py           # rewrite both pages (what `make reference` runs)
    python tools/docs_reference.py --check   # exit 1 naming each page that differs from the code

Nothing here names a field: the config page walks ``JobConfig``'s dataclasses (nested sections and
lists of sections included), reads each field's docstring from its class's source, and collects the
messages of every function in the modules that define the sections and in ``RULE_MODULES``
(``validate`` methods, ``*_errors`` rules) that mention a field's dotted path. A field added, moved
or renamed changes the page; ``tests/test_docs_reference.py`` fails until it is regenerated.
Standard library + PyYAML (through the config modules) only: no torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import itertools
import json
import re
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: the package from this checkout

CONFIG_PAGE = REPO / "docs" / "reference" / "config.md"
CLI_PAGE = REPO / "docs" / "reference" / "cli.md"
REGENERATE = "make reference"
"""The one command that rewrites both pages (``python tools/docs_reference.py`` without make)."""
RULE_MODULES = (
    "grpo_megatron.config.validation",
    "grpo_megatron.config.loop_rules",
    "grpo_megatron.rollout.sglang.cpu_path",
)
"""Modules of cross-section rules, scanned beside the modules that define the sections."""
LIST_ITEM = "[i]"
"""How a list of sections' item is written in a dotted path: ``reward.components[i].weight``."""


# ----------------------------------------------------------------------------------------------------
# The sections and their fields


@dataclass
class FieldDoc:
    path: str
    """Dotted path, e.g. ``algorithm.kl.beta``."""
    type: str
    default: str
    doc: str


@dataclass
class SectionDoc:
    path: str
    cls: type
    doc: str
    fields: list[FieldDoc] = field(default_factory=list)
    subsections: list[str] = field(default_factory=list)


def attribute_docstrings(cls: type) -> dict[str, str]:
    """``{field: docstring}`` from the string literal written under each annotated field (of ``cls``
    and the dataclasses it derives from: a subclass's own docstring wins)."""
    docs: dict[str, str] = {}
    for klass in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        tree = ast.parse(inspect.getsource(klass).strip())
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
        for stmt, after in zip(body, body[1:], strict=False):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                if isinstance(after.value.value, str):
                    docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def section_class(tp: Any) -> tuple[type | None, bool]:
    """The dataclass a field's type holds (itself, optional, or as list items), and whether as a list."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if (
        typing.get_origin(tp) is list
        and typing.get_args(tp)
        and dataclasses.is_dataclass(typing.get_args(tp)[0])
    ):
        return typing.get_args(tp)[0], True
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp, False
    return None, False


def show_type(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(show_type(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(show_type(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def yaml_value(value: Any) -> str:
    """A default as it is written in a job YAML."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif isinstance(value, list | tuple):
        value = [
            dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
            for v in value
        ]
    return json.dumps(value) if not isinstance(value, float) else repr(value)


def show_default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return yaml_value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return yaml_value(f.default_factory())
    return REQUIRED


REQUIRED = "required"


def walk_sections(cls: type, path: str) -> Iterator[SectionDoc]:
    """Every section from ``cls`` down, parents first, in field order."""
    hints = typing.get_type_hints(cls)
    section = SectionDoc(path, cls, inspect.cleandoc(cls.__doc__ or ""))
    docs = attribute_docstrings(cls)
    nested: list[tuple[type, str]] = []
    for f in dataclasses.fields(cls):
        dotted = f"{path}.{f.name}" if path else f.name
        sub, is_list = section_class(hints[f.name])
        if sub is not None:
            sub_path = dotted + (LIST_ITEM if is_list else "")
            nested.append((sub, sub_path))
            section.subsections.append(sub_path)
            if not is_list:
                continue
        section.fields.append(
            FieldDoc(dotted, show_type(hints[f.name]), show_default(f), docs.get(f.name, ""))
        )
    yield section
    for sub, sub_path in nested:
        yield from walk_sections(sub, sub_path)


# ----------------------------------------------------------------------------------------------------
# Validation messages, read from the source


@dataclass(frozen=True)
class Rule:
    text: str
    """The message, its formatted values shown as ``<name>``."""
    where: str
    """``Class.method`` or ``function``, and the module's file."""


def _placeholder(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"<{node.attr}>"
    if isinstance(node, ast.Name):
        return f"<{node.id}>"
    return "<...>"


def render(node: ast.expr, bound: dict[str, list[str]]) -> list[str] | None:
    """The texts a string expression can take (one per combination of the loop values it uses), or
    None when ``node`` is not a string expression."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        body, orelse = render(node.body, bound), render(node.orelse, bound)
        return None if body is None or orelse is None else body + orelse
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = render(node.left, bound), render(node.right, bound)
        if left is None or right is None:
            return None
        return [a + b for a, b in itertools.product(left, right)]
    if not isinstance(node, ast.JoinedStr):
        return None
    parts: list[list[str]] = []
    for value in node.values:
        if isinstance(value, ast.FormattedValue):
            name = value.value.id if isinstance(value.value, ast.Name) else None
            parts.append(bound[name] if name in bound else [_placeholder(value.value)])
        else:
            parts.append(render(value, bound) or [""])
    return ["".join(combo) for combo in itertools.product(*parts)]


def _loop_bindings(loop: ast.For) -> list[dict[str, str]]:
    """Each pass's names of ``for a in ("x", "y")`` / ``for a, b in (("x", "y"), ...)`` over string
    constants (none for any other loop)."""
    if not isinstance(loop.iter, ast.Tuple | ast.List):
        return []
    names = [loop.target] if isinstance(loop.target, ast.Name) else getattr(loop.target, "elts", [])
    if not names or not all(isinstance(n, ast.Name) for n in names):
        return []
    passes = []
    for item in loop.iter.elts:
        values = [item] if len(names) == 1 else getattr(item, "elts", [])
        if len(values) != len(names) or not all(
            isinstance(v, ast.Constant) and isinstance(v.value, str) for v in values
        ):
            return []
        passes.append({n.id: v.value for n, v in zip(names, values, strict=True)})
    return passes


def _bindings(func: ast.FunctionDef, own_path: str | None) -> dict[str, list[str]]:
    """Names a message may interpolate whose text is known: a section method's ``str`` parameters (its
    prefix: the section's path), string parameters' defaults and local string assignments. (Loop
    values are bound per loop by ``_messages``.)"""
    bound: dict[str, list[str]] = {}
    args = func.args.args
    with_default = [a.arg for a in args[len(args) - len(func.args.defaults) :]]
    defaults = dict(zip(with_default, func.args.defaults, strict=True))
    for a in args:
        default = defaults.get(a.arg)
        if own_path is not None and isinstance(a.annotation, ast.Name) and a.annotation.id == "str":
            bound[a.arg] = [own_path]
        elif isinstance(default, ast.Constant) and isinstance(default.value, str):
            bound[a.arg] = [default.value]
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            texts = render(node.value, bound)
            if texts is not None:
                bound.setdefault(node.targets[0].id, texts)
    return bound


def _messages(node: ast.AST, bound: dict[str, list[str]]) -> Iterator[str]:
    """The string expressions under ``node`` that are raised, appended or returned (call arguments and
    the items of lists built or returned), not docstrings and not strings only assigned; inside a loop
    over string constants, once per value of the loop's names."""
    for child in ast.iter_child_nodes(node):
        inner = bound
        if isinstance(child, ast.For):
            values: dict[str, list[str]] = {}
            for one_pass in _loop_bindings(child):
                for name, value in one_pass.items():
                    values.setdefault(name, []).append(value)
            inner = {**bound, **values}
        candidates: list[ast.expr] = []
        if isinstance(child, ast.Call):
            candidates = list(child.args)
        elif isinstance(child, ast.Return) and child.value is not None:
            candidates = [child.value]
        for c in candidates:
            for item in c.elts if isinstance(c, ast.List | ast.Tuple) else [c]:
                for text in render(item, inner) or []:
                    yield re.sub(r"\[<[^>\]]*>\]", LIST_ITEM, " ".join(text.split()))
        yield from _messages(child, inner)


def collect_rules(sections: list[SectionDoc]) -> list[Rule]:
    """Every message of the section modules' and the rule modules' functions."""
    path_of = {s.cls: s.path for s in sections}
    modules = sorted({s.cls.__module__ for s in sections} | set(RULE_MODULES))
    rules: list[Rule] = []
    for name in modules:
        module = importlib.import_module(name)
        source = Path(inspect.getsourcefile(module) or "")
        tree = ast.parse(source.read_text())
        rel = source.resolve().relative_to(REPO).as_posix()
        for owner, func in _functions(tree):
            own = getattr(module, owner, None) if owner else None
            bound = _bindings(func, path_of.get(own) if isinstance(own, type) else None)
            where = f"{owner}.{func.name}" if owner else func.name
            for text in dict.fromkeys(_messages(func, bound)):
                rules.append(Rule(text, f"`{where}` ({rel})"))
    return rules


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield "", node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield node.name, item


def mentions(text: str, path: str) -> bool:
    return re.search(rf"(?<![\w.\[]){re.escape(path)}(?![\w\[])", text) is not None


# ----------------------------------------------------------------------------------------------------
# Markdown


_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_MARKUP = re.compile(r"[\\*\[#]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
"""What Markdown would read as markup in prose (an underscore between two letters or digits never is)."""


def _escape_prose(text: str) -> str:
    return _MARKUP.sub(lambda m: "\\" + m.group(0), text).replace("<", "&lt;")


def escape(text: str) -> str:
    """Docstring prose as Markdown: code spans kept, characters Markdown would read as markup escaped."""
    out, last = [], 0
    for m in _CODE_SPAN.finditer(text):
        out += [_escape_prose(text[last : m.start()]), m.group(0)]
        last = m.end()
    out.append(_escape_prose(text[last:]))
    return "".join(out)


def code(text: str) -> str:
    """``text`` as one inline code span, whatever backticks it holds."""
    ticks = "``" if "`" in text else "`"
    pad = " " if ticks == "``" else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def anchor(path: str) -> str:
    """The heading id Python-Markdown (MkDocs) and GitHub give a heading ``path``."""
    return re.sub(r"[^\w\- ]", "", path.lower()).replace(" ", "-")


CONFIG_HEADER = """\
# Configuration reference

<!-- Generated by tools/docs_reference.py from the config dataclasses: do not edit by hand, run
`{regenerate}` after changing a field. -->

A job is one YAML file with the sections below; any field can be overridden on the command line as
`section.key=value` (the value is YAML: `train.lr=1e-5`, `parallel.dp=null`,
`reward.components[0].weight=2`). [Configuration](../configuration.md) explains loading, overrides
and the checks; this page lists every field: its type (Python notation: `None` is YAML's `null`),
its default (as YAML), its docstring, and the validation messages that name it, with the function
that emits each (`<name>` stands for a value filled in at run time). Every field is also
type-checked when the file is loaded (`grpo_megatron/config/loader.py`), and unknown keys are
refused with the closest valid name.

Sections: {sections}.
"""


def config_page(root: type | None = None) -> str:
    """The configuration reference of ``root`` (default: the job config, ``JobConfig``)."""
    if root is None:
        from grpo_megatron.config import JobConfig

        root = JobConfig
    sections = list(walk_sections(root, ""))
    rules = collect_rules(sections)
    listed = [s for s in sections if s.path]
    header = CONFIG_HEADER.format(
        regenerate=REGENERATE, sections=", ".join(f"[`{s.path}`](#{anchor(s.path)})" for s in listed)
    )
    out = [header]
    for section in listed:
        out.extend(section_markdown(section, rules))
    return "\n".join(out).rstrip() + "\n"


def section_markdown(section: SectionDoc, rules: list[Rule]) -> list[str]:
    out = [f"## {section.path}", "", f"`{section.cls.__name__}` ({section.cls.__module__}).", ""]
    if section.doc:
        out += [escape(section.doc), ""]
    if section.subsections:
        links = ", ".join(f"[`{p}`](#{anchor(p)})" for p in section.subsections)
        out += [f"Subsections: {links}.", ""]
    for f in section.fields:
        default = "required" if f.default == REQUIRED else f"default {code(f.default)}"
        out += [f"### {f.path}", "", f"Type {code(f.type)}, {default}.", ""]
        if f.doc:
            out += [escape(f.doc), ""]
        named = list(dict.fromkeys(r for r in rules if mentions(r.text, f.path)))
        if named:
            out += ["Checks:", ""]
            out += [f"- {code(r.text)}: {r.where}" for r in named]
            out.append("")
    return out


# ----------------------------------------------------------------------------------------------------
# The command line


CLI_HEADER = """\
# Command-line reference

<!-- Generated by tools/docs_reference.py from grpo_megatron/cli.py's parsers: do not edit by hand,
run `{regenerate}` after changing an argument. -->

`grpo-megatron COMMAND ...` (or `python -m grpo_megatron COMMAND ...`; under `torchrun` every rank
runs the same command). Commands that take a `CONFIG` also take `section.key=value` overrides of
any field of the [configuration](config.md). Exit codes: [troubleshooting](../troubleshooting.md).
"""


def _usage(prog: str, parser: argparse.ArgumentParser) -> str:
    parts = [prog]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        parts.append(_action_usage(action))
    return " ".join(parts)


def _metavar(action: argparse.Action) -> str:
    if (
        action.choices is not None
        and action.metavar is None
        and not isinstance(action, argparse._SubParsersAction)
    ):
        return "{" + ",".join(map(str, action.choices)) + "}"
    return str(action.metavar or action.dest.upper())


def _action_usage(action: argparse.Action) -> str:
    if not action.option_strings:
        mv = _metavar(action)
        if action.nargs == "*":
            return f"[{mv} ...]"
        return f"{mv} ..." if isinstance(action, argparse._SubParsersAction) else mv
    flag = (
        action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
    )
    text = flag if action.nargs == 0 else f"{flag} {_metavar(action)}"
    return text if action.required else f"[{text}]"


def _arguments_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = ", ".join(action.option_strings) or _metavar(action)
        required = action.required and action.nargs not in ("*", "?")
        default = parser.get_default(action.dest)
        shown = "" if default in (None, False, argparse.SUPPRESS) or required else code(repr(default))
        help_text = (action.help or "").replace("\n", " ").replace("|", "\\|")
        rows.append(f"| {code(name)} | {'yes' if required else ''} | {shown} | {escape(help_text)} |")
    if not rows:
        return []
    return ["| argument | required | default | what |", "|---|---|---|---|", *rows, ""]


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def parser_markdown(prog: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    out = [f"{'#' * level} {prog}", ""]
    if parser.description:
        out += [escape(parser.description), ""]
    out += ["```text", f"usage: {_usage(prog, parser)}", "```", ""]
    out += _arguments_table(parser)
    for name, sub in _subparsers(parser):
        out += parser_markdown(f"{prog} {name}", sub, min(level + 1, 4))
    return out


def cli_page(parser: argparse.ArgumentParser | None = None) -> str:
    """The command-line reference of ``parser`` (default: ``grpo-megatron``'s, ``cli.build_parser``)."""
    if parser is None:
        from grpo_megatron.cli import build_parser

        parser = build_parser()
    out = [CLI_HEADER.format(regenerate=REGENERATE), *parser_markdown("grpo-megatron", parser, 2)]
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------------------------------


def pages() -> dict[Path, str]:
    return {CONFIG_PAGE: config_page(), CLI_PAGE: cli_page()}


def stale_pages() -> list[Path]:
    """The committed pages that differ from what the code generates now."""
    return [p for p, text in pages().items() if not p.is_file() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 naming each stale page")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for p in stale:
            print(f"{p.relative_to(REPO)} differs from the code: run `{REGENERATE}`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in pages().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
