"""megatron-core's fusers when ``torch.compile`` is off: plain functions, not dynamo wrappers.

``megatron/core/jit.py`` binds ``jit_fuser = torch.compile`` at import, and some 38 functions of
megatron-core (bias-GeLU, SwiGLU, the router's fusions...) are decorated with it as their modules
load. Each ``torch.compile`` call builds its backend wrapper, which imports ``torch._inductor``: about
3 s of every process's start-up (9.1 -> 5.9 s for ``import megatron.core`` on a 2-core EPYC),
although with ``TORCH_COMPILE_DISABLE=1`` (what ``launch/`` and the examples set) dynamo then runs
each one eagerly anyway. megatron-core has the switch for this, ``disable_jit_fuser()`` (its jit_fuser
becomes the identity); it only counts for decorations after it, so it must run as
``megatron.core.jit`` loads, before the modules that decorate with it.

``skip_fuser_when_compile_disabled()`` arranges that: where ``torch.compile`` is disabled in this
process (torch's own reading of ``TORCH_COMPILE_DISABLE``, ``torch/_dynamo/config.py``), the first
import of ``megatron.core.jit`` is followed by its ``disable_jit_fuser()``. The fused functions then
run eagerly, as they did through the disabled compile: the same operations, the same results. Where
compile is on, or megatron-core lacks the switch, nothing changes. Call it before anything imports
megatron-core (``cli.main`` does); it imports neither torch nor megatron-core itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

JIT_MODULE = "megatron.core.jit"


def compile_disabled() -> bool:
    """Whether ``torch.compile`` is off in this process, as ``torch/_dynamo/config.py`` reads it."""
    return os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"


class _ThenDisable(importlib.abc.Loader):
    """``megatron.core.jit``'s own loader, then its ``disable_jit_fuser()`` where it has one."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def __getattr__(self, name: str) -> object:  # get_source, is_package...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        disable = getattr(module, "disable_jit_fuser", None)
        if callable(disable):
            disable()


class _JitFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` once, through the other finders, and wraps its loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != JIT_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenDisable(spec.loader)
        return spec


def skip_fuser_when_compile_disabled() -> bool:
    """Arrange the module docstring's switch; whether it is armed (False: compile is on, or
    megatron-core was imported already, too late to matter). Idempotent."""
    if not compile_disabled() or JIT_MODULE in sys.modules:
        return False
    if not any(isinstance(finder, _JitFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _JitFinder())
    return True
