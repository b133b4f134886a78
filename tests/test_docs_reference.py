"""The docs' generated reference pages (tools/docs_reference.py): the committed ones are what the code
generates now, and the generator follows the code (a field or an argument added shows up) without
naming any field itself."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import docs_reference  # noqa: E402

from grpo_megatron.cli import COMMANDS, Command, build_parser  # noqa: E402
from grpo_megatron.config import JobConfig  # noqa: E402
from grpo_megatron.training.config import TrainConfig  # noqa: E402


def test_the_committed_reference_pages_are_what_the_code_generates() -> None:
    stale = [
        f"{page.relative_to(REPO)} differs from what the code generates: run `{docs_reference.REGENERATE}`"
        for page, text in docs_reference.pages().items()
        if not page.is_file() or page.read_text() != text
    ]
    assert not stale, "\n".join(stale)


@dataclass
class TrainWithKnob(TrainConfig):
    new_knob: Literal["a", "b"] | None = None
    """A knob added to the train section without regenerating the page."""

    def validate(self) -> None:
        super().validate()
        if self.new_knob == "b":
            raise ValueError(f"train.new_knob={self.new_knob} is not ready: set train.new_knob=a")


@dataclass
class JobWithKnob(JobConfig):
    train: TrainWithKnob = field(default_factory=TrainWithKnob)


def test_a_field_added_without_regenerating_fails_the_check() -> None:
    page = docs_reference.config_page(JobWithKnob)
    assert page != docs_reference.CONFIG_PAGE.read_text()
    knob = page.split("### train.new_knob\n", 1)[1].split("\n### ", 1)[0]
    assert 'Type `"a" | "b" | None`, default `null`.' in knob
    assert "A knob added to the train section without regenerating the page." in knob
    # Its check, found in this module's source, with the method that emits it.
    assert "`train.new_knob=<new_knob> is not ready: set train.new_knob=a`: `TrainWithKnob.validate`" in knob
    # The inherited fields keep the docstrings of the class that declares them.
    assert "Peak learning rate." in page.split("### train.lr\n", 1)[1].split("\n### ", 1)[0]


def test_every_field_and_section_of_the_job_config_is_on_the_page() -> None:
    page = docs_reference.CONFIG_PAGE.read_text()
    sections = list(docs_reference.walk_sections(JobConfig, ""))
    assert {s.path for s in sections} >= {
        "model",
        "rollout.multiturn",
        "algorithm.kl",
        "reward.components[i]",
    }
    for section in sections[1:]:
        assert f"\n## {section.path}\n" in page
        for f in section.fields:
            assert f"\n### {f.path}\n" in page, f.path


def test_messages_are_read_with_their_prefixes_and_loop_values() -> None:
    """A section method's ``str`` prefix is the section's path; string constants a loop runs over are
    each a message of their own; an f-string's other values show as ``<name>``."""
    import ast

    source = """
def validate(self, p: str) -> None:
    for name in ("a_knob", "b_knob"):
        errors.append(f"{p}.{name}={getattr(self, name)} must be >= 1")
    where = "x" if self.y else f"{p}.c_knob={self.c_knob}"
    raise ValueError(f"{where} and {p}.d_knob disagree")
"""
    func = ast.parse(source).body[0]
    assert isinstance(func, ast.FunctionDef)
    bound = docs_reference._bindings(func, "train.sub")
    messages = set(docs_reference._messages(func, bound))
    assert messages == {
        "train.sub.a_knob=<...> must be >= 1",
        "train.sub.b_knob=<...> must be >= 1",
        "x and train.sub.d_knob disagree",
        "train.sub.c_knob=<c_knob> and train.sub.d_knob disagree",
    }
    assert docs_reference.mentions("train.sub.a_knob=<...> must be >= 1", "train.sub.a_knob")
    assert not docs_reference.mentions("train.sub.a_knob_2=1", "train.sub.a_knob")


def test_an_argument_added_without_regenerating_fails_the_check() -> None:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--new-flag", type=int, default=7, help="a flag added without regenerating")

    extra = Command("newcmd", "a command added without regenerating", lambda *a: 0, add)
    page = docs_reference.cli_page(build_parser((*COMMANDS, extra)))
    assert page != docs_reference.CLI_PAGE.read_text()
    assert "### grpo-megatron newcmd" in page
    assert "| `--new-flag` |  | `7` | a flag added without regenerating |" in page
    assert (
        "usage: grpo-megatron newcmd [--debug] CONFIG [section.key=value ...] [--new-flag NEW_FLAG]" in page
    )


def test_prose_is_escaped_outside_code_spans() -> None:
    text = "a <b> and `c_*<d>` with __init__ and x*y, snake_case, [z]"
    assert (
        docs_reference.escape(text) == r"a &lt;b> and `c_*<d>` with \_\_init\_\_ and x\*y, snake_case, \[z]"
    )
