"""Make real SGLang import and run where its dependencies disagree with the machine: each adjustment
named, applied only where its cause is found (a capability of this process), never by device.

Opt-in: importing this module changes nothing. ``install()`` arms every fix of ``FIXES`` in this
process: a fix runs just before the module it is about is first imported (an import hook), and only
if its ``needed()`` check finds the cause. SGLang's engine runs its schedulers and detokenizer in
spawned processes, which import SGLang afresh: ``child_environment()`` puts ``boot/`` first on
``PYTHONPATH`` while an engine starts, so that those processes arm the same fixes at interpreter
start (``boot/sitecustomize.py`` calls ``install()``); the trainer's own environment is restored
right after, so reward workers and other children never see it.

| name | what breaks | where | how we adjust |
|---|---|---|---|
| torchvision_missing_ops | PyPI's torchvision is a CUDA build; beside a CPU torch its compiled ops (``_C``) do not load, yet ``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` unconditionally: ``RuntimeError: operator torchvision::nms does not exist`` on ``import torchvision``, which SGLang's model configs import | torchvision (0.28) imported by ``sglang.srt.configs`` | when torchvision's ops library cannot be loaded by this torch and the two ops are missing, define their schemas (no kernels: calling them still fails, as torchvision says it would) so the fake registrations succeed |
| transformers_config_reregistered | SGLang (0.5.17) registers its own configs for model types that transformers >= 5.13 already has: ``ValueError: 'qwen3_asr' is already used by a Transformers config`` | ``transformers.AutoConfig.register`` called by ``sglang.srt.configs`` | a model type transformers already maps is re-registered with ``exist_ok=True`` (SGLang's class wins, as it did with older transformers) |
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

BOOT_DIR = Path(__file__).with_name("boot")
"""Holds the ``sitecustomize.py`` that spawned SGLang processes run at start (``child_environment``)."""


@dataclasses.dataclass(frozen=True)
class Fix:
    """One adjustment: ``apply`` runs before ``before_import`` is first imported, if ``needed()``."""

    name: str
    before_import: str
    needed: Callable[[], bool]
    apply: Callable[[], None]


# -- torchvision_missing_ops

_TORCHVISION_FAKE_REGISTERED_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_KEPT_LIBRARIES: list[Any] = []
"""torch.library.Library objects must stay alive for their definitions to stay registered."""


def _torchvision_op_missing(op: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{op}", "")
    except RuntimeError:
        return True
    return False


def _torchvision_ops_unloadable() -> bool:
    """torchvision is installed, its compiled ops library does not load beside this torch, and the
    ops its meta registrations need are therefore missing."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    import torch

    libraries = glob.glob(os.path.join(next(iter(spec.submodule_search_locations)), "_C*.so"))
    try:
        if libraries:
            torch.ops.load_library(libraries[0])
    except (OSError, RuntimeError):
        pass
    return any(_torchvision_op_missing(s.split("(")[0]) for s in _TORCHVISION_FAKE_REGISTERED_OPS)


def _define_torchvision_schemas() -> None:
    import torch

    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TORCHVISION_FAKE_REGISTERED_OPS:
        if _torchvision_op_missing(schema.split("(")[0]):
            library.define(schema)
    _KEPT_LIBRARIES.append(library)


# -- transformers_config_reregistered


def _autoconfig_register_refuses_known_types() -> bool:
    """transformers' ``AutoConfig.register`` has ``exist_ok`` (so a known type raises without it),
    and is not wrapped yet."""
    from transformers import AutoConfig

    register = AutoConfig.register
    return not getattr(register, "_grpo_megatron_compat", False) and "exist_ok" in register.__code__.co_varnames


def _tolerate_reregistered_configs() -> None:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    original = AutoConfig.register

    def register(model_type: str, config: Any, exist_ok: bool = False) -> None:
        original(model_type, config, exist_ok=exist_ok or model_type in CONFIG_MAPPING)

    register._grpo_megatron_compat = True  # type: ignore[attr-defined]
    AutoConfig.register = staticmethod(register)  # type: ignore[method-assign]


FIXES: tuple[Fix, ...] = (
    Fix("torchvision_missing_ops", "torchvision", _torchvision_ops_unloadable, _define_torchvision_schemas),
    Fix(
        "transformers_config_reregistered",
        "sglang",
        _autoconfig_register_refuses_known_types,
        _tolerate_reregistered_configs,
    ),
)


class _BeforeImport(importlib.abc.MetaPathFinder):
    """Runs the fixes about a top-level module just before it is first imported, then steps aside."""

    def __init__(self, fixes: Sequence[Fix]):
        self.pending = {f.before_import: [g for g in fixes if g.before_import == f.before_import] for f in fixes}
        self.applied: list[str] = []

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        fixes = self.pending.pop(fullname, None)
        if fixes:
            for fix in fixes:
                if fix.needed():
                    fix.apply()
                    self.applied.append(fix.name)
        return None  # the normal finders import the module


def install(fixes: Sequence[Fix] = FIXES) -> list[str]:
    """Arm ``fixes`` in this process (idempotent). A fix whose module is already imported is
    applied now if needed. Returns the names applied so far."""
    hook = next((f for f in sys.meta_path if isinstance(f, _BeforeImport)), None)
    if hook is None:
        hook = _BeforeImport(fixes)
        sys.meta_path.insert(0, hook)
    for name in [n for n in list(hook.pending) if n in sys.modules]:
        hook.find_spec(name)
    return list(hook.applied)


def applied() -> list[str]:
    """Names of the fixes applied in this process."""
    hook = next((f for f in sys.meta_path if isinstance(f, _BeforeImport)), None)
    return list(hook.applied) if hook is not None else []


@contextlib.contextmanager
def child_environment(extra: Mapping[str, str | None] | None = None) -> Iterator[None]:
    """While an ``sglang.Engine`` starts: its spawned processes arm the same fixes (``boot/`` first on
    PYTHONPATH) and get ``extra`` environment variables (None: removed); the previous environment
    comes back after."""
    extra = dict(extra or {})
    saved = {k: os.environ.get(k) for k in ["PYTHONPATH", *extra]}
    paths = [str(BOOT_DIR), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    try:
        _set_environment({**extra, "PYTHONPATH": os.pathsep.join(paths)})
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: Mapping[str, str | None]) -> None:
    """Set each variable of ``values``; None removes it."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


PTH_NAME = "grpo_megatron_sglang_compat.pth"
PTH_LINE = "import grpo_megatron.rollout.sglang.compat as _c; _c.install()\n"
"""A ``.pth`` line arms the fixes in every Python process of an environment: transformers imports
torchvision too (when it is installed, for its image processors), so a CPU environment with SGLang's
torchvision needs ``torchvision_missing_ops`` in every process, not only in SGLang's. ``make setup``
writes it (``python -m grpo_megatron.rollout.sglang.compat``); it imports only the standard library
until a module a fix is about is imported."""


def write_pth(site_packages: str | None = None) -> Path:
    """Write ``PTH_NAME`` into ``site_packages`` (default: this interpreter's purelib)."""
    import sysconfig

    path = Path(site_packages or sysconfig.get_paths()["purelib"]) / PTH_NAME
    path.write_text(PTH_LINE)
    return path


if __name__ == "__main__":
    print(f"wrote {write_pth()}")
