"""Loading a job config: YAML + ``section.key=value`` overrides -> a type-checked ``JobConfig``.

Types are checked (int, float, bool, str, Literal, Optional, list, dict, nested dataclasses) and
every problem is reported at once, each with the dotted field, the file and line (or the
override), the value and the fix, in one ``ConfigError``. Standard library + PyYAML only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from grpo_megatron.config.job import FILE_RELATIVE_PATHS, ConfigError, JobConfig
from grpo_megatron.models.config import (
    display_path,
)

# ----------------------------------------------------------------------------------------------------
# Loading

# A key path inside the config: section/field names, and list indices.
KeyPath = tuple[str | int, ...]

_INVALID = object()  # returned by the converters after they recorded an error

MOVED_KEYS: dict[str, str] = {
    "train.partial_rollout": "rollout.partial.enabled",
    **{
        f"rollout.partial_{k}": f"rollout.partial.{k}"
        for k in ("segment_tokens", "groups_in_flight", "overlap", "one_request", "keep_kv")
    },
    **{
        f"rollout.sglang_{k}": f"rollout.sglang.{k}"
        for k in (
            "mode",
            "tp",
            "ep",
            "server_urls",
            "sync_master_addr",
            "sync_master_port",
            "request_timeout_s",
            "routed_experts",
            "cpu_path",
            "server_args",
        )
    },
    "rollout.max_engine_restarts": "rollout.recovery.max_restarts",
    "rollout.engine_health_timeout_s": "rollout.recovery.health_timeout_s",
}
"""Keys that moved into nested sections (issue 52): a config that still names one fails with its new
name instead of a guess."""


@dataclass
class _Origins:
    """Where each value came from ("file.yaml:12" or "override 'a.b=c'"), for error messages."""

    source: str
    by_path: dict[KeyPath, str] = field(default_factory=dict)

    def of(self, path: KeyPath) -> str:
        # The nearest enclosing value with a known origin (a missing key: its section's line).
        for end in range(len(path), 0, -1):
            if path[:end] in self.by_path:
                return self.by_path[path[:end]]
        return self.source


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Load a YAML job config, apply `section.key=value` overrides, and check every value's type.

    Raises ConfigError listing every unknown key, wrong type and bad choice. Does not run the
    validation rules that need the world size or the model: call `validate(cfg, world_size)`.
    """
    path = Path(path)
    source = display_path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError([f"cannot read config file {source}: {e.strerror or e}; check the path"]) from e
    try:
        raw = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError([f"{source}: not valid YAML: {e}"]) from e
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            [f"{source}: the top level must be a mapping of sections ({', '.join(_field_names(JobConfig))})"]
        )

    origins = _Origins(source)
    errors: list[str] = []
    if node is not None:
        _record_lines(node, (), source, origins.by_path, errors)
    _resolve_file_paths(raw, path.parent)
    for override in overrides:
        _apply_override(raw, override, origins, errors)

    cfg = _convert(raw, JobConfig, (), origins, errors)
    if errors:
        raise ConfigError(errors)
    return cfg


def parse_override(override: str) -> tuple[KeyPath, str]:
    """Split "model.hf_overrides.num_experts=8" into (("model", "hf_overrides", "num_experts"), "8").

    List items are addressed by index: "reward.components[0].weight=2" or "reward.components.0.weight=2".
    """
    key, sep, value = override.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][\w-]*(\[\d+\]|\.[\w-]+)+", key):
        raise ValueError(
            f"override {override!r} must look like section.key=value, e.g. train.lr=1e-5 "
            "or model.hf_overrides.num_experts=8"
        )
    parts: list[str | int] = []
    for token in re.findall(r"\[(\d+)\]|\.?([\w-]+)", key):
        index, name = token
        parts.append(int(index) if index else int(name) if name.isdigit() else name)
    return tuple(parts), value


def _record_lines(
    node: yaml.Node, path: KeyPath, source: str, out: dict[KeyPath, str], errors: list[str]
) -> None:
    """Record "file:line" of every key and list item; report keys given twice (YAML keeps the last)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key in seen:
                errors.append(
                    f"{source}:{line}: {_dotted((*path, key))} is given twice (first at line {seen[key]}); "
                    "delete one of them"
                )
            seen[key] = line
            out[(*path, key)] = f"{source}:{line}"
            _record_lines(value_node, (*path, key), source, out, errors)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[(*path, i)] = f"{source}:{item.start_mark.line + 1}"
            _record_lines(item, (*path, i), source, out, errors)


def _resolve_file_paths(raw: dict[str, Any], base_dir: Path) -> None:
    for section, key in FILE_RELATIVE_PATHS:
        values = raw.get(section)
        if isinstance(values, dict) and isinstance(values.get(key), str) and values[key]:
            values[key] = str((base_dir / Path(values[key]).expanduser()).resolve())


def _apply_override(raw: dict[str, Any], override: str, origins: _Origins, errors: list[str]) -> None:
    """Set one `section.key=value` in the raw (not yet type-checked) config; errors are recorded."""
    where = f"override {override!r}"
    try:
        path, text = parse_override(override)
    except ValueError as e:
        errors.append(str(e))
        return

    # Walk the types first: unknown names fail here with a suggestion, before anything is changed.
    tp: Any = JobConfig
    defaults: list[Any] = []  # default value of each dataclass field along the path (else None)
    for depth, key in enumerate(path):
        tp = _strip_optional(tp)
        defaults.append(None)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and isinstance(key, str):
            hints = _type_hints(tp)
            if key not in hints:
                errors.append(f"{where}: {_unknown_key_message(path[: depth + 1], list(hints))}")
                return
            defaults[-1] = _field_default(tp, key)
            tp = hints[key]
        elif _origin(tp) is dict:
            tp = typing.get_args(tp)[1] if typing.get_args(tp) else Any
        elif _origin(tp) is list and isinstance(key, int):
            tp = typing.get_args(tp)[0] if typing.get_args(tp) else Any
        elif tp is Any:
            pass
        else:
            errors.append(
                f"{where}: {_dotted(path[:depth])} is {_describe(tp)}, so it has no entry {key!r}; "
                f"set {_dotted(path[:depth])}=<value> instead"
            )
            return

    value = _parse_override_value(text, tp)
    if path in FILE_RELATIVE_PATHS and isinstance(value, str) and value:
        value = str(Path(value).expanduser().resolve())  # typed on the command line: relative to the cwd

    container: Any = raw
    for depth, key in enumerate(path):
        if isinstance(container, list) and not (isinstance(key, int) and key < len(container)):
            errors.append(
                f"{where}: {_dotted(path[:depth])} has {len(container)} item(s), so index {key} does not exist"
            )
            return
        if depth == len(path) - 1:
            break
        child = container[key] if _has(container, key) else None
        if child is None and isinstance(key, str):
            # Not in the file: start from the field's default, so "reward.components[0].weight=2"
            # edits the default list instead of replacing it.
            default = defaults[depth]
            child = container[key] = _to_raw(default) if isinstance(default, list) else {}
        if not isinstance(child, dict | list) or (
            isinstance(path[depth + 1], int) and not isinstance(child, list)
        ):
            errors.append(
                f"{where}: {_dotted(path[: depth + 1])} is {child!r}, which has no entry {path[depth + 1]!r}"
            )
            return
        container = child
    container[path[-1]] = value
    origins.by_path[path] = where


def _field_default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _to_raw(value: Any) -> Any:
    """A dataclass default as the plain YAML-like data the loader converts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, list):
        return [_to_raw(v) for v in value]
    return value


def _has(container: dict[str, Any] | list[Any], key: str | int) -> bool:
    if isinstance(container, list):
        return isinstance(key, int) and key < len(container)
    return key in container


def _parse_override_value(text: str, tp: Any) -> Any:
    """YAML-parse an override value ("8" -> 8, "null" -> None, "[1, 2]" -> list); a field that takes
    strings keeps the text as typed, so `logging.wandb_project=2024` or a template with ": " work."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if _accepts_str(tp) and not isinstance(value, str) and not (value is None and _accepts_none(tp)):
        return text
    return value


# ----------------------------------------------------------------------------------------------------
# Type checking and conversion of raw YAML values


def _convert(
    value: Any, tp: Any, path: KeyPath, origins: _Origins, errors: list[str], expected: str = ""
) -> Any:
    """`value` converted to `tp`, or _INVALID after appending the reason to `errors`."""
    expected = expected or _describe(tp)
    origin = _origin(tp)
    if tp is Any:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _convert_dataclass(value, tp, path, origins, errors)
    if origin is Union:
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(arms) < len(typing.get_args(tp)):
            return None
        if len(arms) == 1:
            return _convert(value, arms[0], path, origins, errors, expected)
        for arm in arms:
            trial: list[str] = []
            converted = _convert(value, arm, path, origins, trial)
            if not trial:
                return converted
        return _type_error(value, expected, path, origins, errors)
    if origin is Literal:
        choices = typing.get_args(tp)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        # PyYAML (YAML 1.1) reads a bare `off` as False and `on` as True: accept what users wrote.
        if isinstance(value, bool) and ("on" if value else "off") in choices:
            return "on" if value else "off"
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        errors.append(
            f"{origins.of(path)}: {_dotted(path)}={_show(value)} is not one of "
            f"{', '.join(repr(c) for c in choices)}{hint}"
        )
        return _INVALID
    if origin is list or origin is tuple:
        if not isinstance(value, list):
            return _type_error(value, expected, path, origins, errors)
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, (*path, i), origins, errors) for i, v in enumerate(value)]
        if any(v is _INVALID for v in items):
            return _INVALID
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            return _type_error(value, expected, path, origins, errors)
        args = typing.get_args(tp)
        value_tp = args[1] if args else Any
        out = {k: _convert(v, value_tp, (*path, k), origins, errors) for k, v in value.items()}
        return _INVALID if any(v is _INVALID for v in out.values()) else out
    if tp is bool:
        if isinstance(value, bool):
            return value
        return _type_error(value, expected, path, origins, errors)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return _type_error(value, expected, path, origins, errors)
    if tp is float:
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # PyYAML (YAML 1.1) reads 1e-6 as a string: it wants 1.0e-6. Accept what users mean.
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            return _type_error(value, expected, path, origins, errors)
        if not math.isfinite(number):
            # inf/nan pass every `< 0` / `> 1` range rule and then poison training (NaN weights,
            # disabled clipping, a pool that spins): no field of the job config means either.
            errors.append(
                f"{origins.of(path)}: {_dotted(path)}={_show(value)} is not a finite number; "
                f"set {_dotted(path)} to a finite value"
            )
            return _INVALID
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        return _type_error(value, expected, path, origins, errors)
    raise TypeError(f"config field {_dotted(path)} has a type the loader does not handle: {tp!r}")


def _convert_dataclass(value: Any, cls: type, path: KeyPath, origins: _Origins, errors: list[str]) -> Any:
    if value is None:
        value = {}  # a section written with all its keys commented out: the defaults
    if not isinstance(value, dict):
        return _type_error(value, f"a mapping of {cls.__name__} fields", path, origins, errors)
    hints = _type_hints(cls)
    kwargs: dict[str, Any] = {}
    ok = True
    for key in value:
        if key not in hints:
            errors.append(f"{origins.of((*path, key))}: {_unknown_key_message((*path, key), list(hints))}")
            ok = False
    for f in dataclasses.fields(cls):
        if f.name in value:
            converted = _convert(value[f.name], hints[f.name], (*path, f.name), origins, errors)
            ok = ok and converted is not _INVALID
            kwargs[f.name] = converted
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            section = f"under '{_dotted(path)}:' " if path else "at the top level"
            errors.append(
                f"{origins.of(path)}: {_dotted((*path, f.name))} is required: add '{f.name}: ...' {section}"
                f" ({_describe(hints[f.name])})"
            )
            ok = False
    return cls(**kwargs) if ok else _INVALID


def _type_error(value: Any, expected: str, path: KeyPath, origins: _Origins, errors: list[str]) -> Any:
    errors.append(
        f"{origins.of(path)}: {_dotted(path)}={_show(value)} is {_yaml_kind(value)}, but it must be {expected}; "
        f"fix the value of {_dotted(path)}"
    )
    return _INVALID


def _unknown_key_message(path: KeyPath, valid: list[str]) -> str:
    moved = MOVED_KEYS.get(_dotted(path))
    if moved is not None:
        *sections, key = moved.split(".")
        nested = "".join(f"{name}: " for name in sections)
        return (
            f"'{_dotted(path)}' has moved to '{moved}' ({nested}{key}: in YAML); rename it, the value stays"
        )
    name = str(path[-1])
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    where = f"in '{_dotted(path[:-1])}'" if len(path) > 1 else "at the top level"
    hint = (
        f"did you mean '{_dotted((*path[:-1], close[0]))}'?" if close else f"valid keys: {', '.join(valid)}"
    )
    return f"unknown key '{_dotted(path)}' {where}: {hint}"


def _describe(tp: Any) -> str:
    origin = _origin(tp)
    if tp is Any:
        return "any value"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin is Union:
        arms = typing.get_args(tp)
        described = [_describe(a) for a in arms if a is not type(None)]
        if len(described) < len(arms):
            described.append("null")
        return " or ".join(described)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin is list or origin is tuple:
        return "a list"
    if origin is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, repr(tp))


def _show(value: Any) -> str:
    """A value as YAML would spell it (true, null), strings quoted."""
    if value is None or isinstance(value, bool):
        return yaml.safe_dump(value).splitlines()[0]
    return repr(value)


def _yaml_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}.get(
        type(value), type(value).__name__
    )


def _origin(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    return Union if origin is types.UnionType else origin


def _strip_optional(tp: Any) -> Any:
    if _origin(tp) is Union:
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1:
            return arms[0]
    return tp


def _accepts_str(tp: Any) -> bool:
    if _origin(tp) is Union:
        return any(_accepts_str(a) for a in typing.get_args(tp))
    return tp is str


def _accepts_none(tp: Any) -> bool:
    return tp is Any or (_origin(tp) is Union and type(None) in typing.get_args(tp))


def _type_hints(cls: type) -> dict[str, Any]:
    return {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _dotted(path: KeyPath) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out
