"""Make real SGLang import and run where its dependencies disagree with the machine: each adjustment
named, applied only where its cause is found (a capability of this process), never by device.

Opt-in: importing this module changes nothing. ``install()`` arms every fix of ``FIXES`` in this
process: a fix runs just before the module it is about is first imported, or just after it
(``Fix.after``; an import hook either way), and only if its ``needed()`` check finds the cause.
SGLang's engine runs its schedulers and detokenizer in spawned processes, which import SGLang
afresh: ``child_environment()`` puts ``boot/`` first on ``PYTHONPATH`` while an engine starts, so
that those processes arm the same fixes at interpreter start (``boot/sitecustomize.py`` calls
``install()``); the trainer's own environment is restored right after, so reward workers and other
children never see it.

| name | what breaks | where | how we adjust |
|---|---|---|---|
| torchvision_missing_ops | PyPI's torchvision is a CUDA build; beside a CPU torch its compiled ops (``_C``) do not load, yet ``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` unconditionally: ``RuntimeError: operator torchvision::nms does not exist`` on ``import torchvision``, which SGLang's model configs import | torchvision (0.28) imported by ``sglang.srt.configs`` | when torchvision's ops library cannot be loaded by this torch and the two ops are missing, define their schemas (no kernels: calling them still fails, as torchvision says it would) so the fake registrations succeed |
| transformers_config_reregistered | SGLang (0.5.17) registers its own configs for model types that transformers >= 5.13 already has: ``ValueError: 'qwen3_asr' is already used by a Transformers config`` | ``transformers.AutoConfig.register`` called by ``sglang.srt.configs`` | a model type transformers already maps is re-registered with ``exist_ok=True`` (SGLang's class wins, as it did with older transformers) |

One fix saves start-up time rather than mending a failure, in the terms of the table:

- **compile_disabled_plain_functions** (before ``sglang``). Nothing breaks; it costs: some 40 of
  SGLang's functions are decorated ``@torch.compile(...)`` as its modules load, and each call builds an
  inductor backend wrapper (importing ``torch._inductor``): about 2 s of each SGLang process's start
  (the rank's engine, its scheduler, its detokenizer), although with ``TORCH_COMPILE_DISABLE=1`` dynamo
  runs each one eagerly. How: where ``torch.compile`` is disabled (torch's own reading of
  ``TORCH_COMPILE_DISABLE``), ``torch.compile`` returns a plain function as it is (the decorator form
  too); modules and anything else still go to torch's.

The fixes of SGLang's intel_amx CPU path (``rollout/sglang/cpu_path.py``), in the same terms:

- **sglang_amx_choice** (before ``sglang``). What breaks: SGLang takes its intel_amx path wherever the
  CPU has AMX (``cpu_has_amx_support()``: ``torch.cpu._is_amx_tile_supported()``, read when
  ``sglang.srt.utils.common`` is imported), and that path serves no fp32 model (``"rmsnorm_kernel" not
  implemented for 'Float'``). How: ``GRPO_SGLANG_AMX=hide`` (``rollout.sglang.cpu_path=torch_native``,
  set by the adapter for the engine's processes) makes the AMX query answer False, so SGLang takes its
  torch-native path; ``pretend`` (tests only) makes it answer True on a CPU without AMX, so that the
  AMX weight layouts can be checked anywhere (no forward: the AMX kernels have no other ISA's path).
- **amx_packed_weights_reload** (after ``sglang.srt.layers.amx_utils`` and after
  ``sglang.srt.model_loader.loader``). What breaks: on the intel_amx path SGLang repacks weights after
  loading (``layers/amx_utils.py:_amx_process_weight_after_loading``: VNNI blocks, a router of fewer
  than 16 experts transposed to fp32, biases to fp32) and cannot undo it
  (``DefaultModelLoader.restore_weights_before_loading``: "AMX packing ... cannot restore"): a weight
  update writes the checkpoint's layout into packed parameters (``AssertionError:
  param.shape=torch.Size([128, 4]) param.dtype=torch.float32 loaded_weight.shape=torch.Size([4, 128])``)
  and ``end_weight_update`` packs packed weights again. How: each packed module keeps its parameters
  as loaded (``AmxKept``: the load target; an AMX engine holds its weights twice);
  ``restore_weights_before_loading`` (``begin_weight_update``) puts them back, unpacked; the update
  loads into them as a fresh start does; ``end_weight_update``'s post-processing packs them again (a
  module already packed from its kept parameters is left as it is). FP8 layers too (SGLang's FP8
  linear and MoE methods pack through the same function on CPU): their float8 weights as above, and
  the ``weight_scale_inv`` their post-processing re-wraps without its loader is put back with its
  loader (``AmxKept.others``). Needs SGLang's weight-update
  sessions (0.5.21 on): without them an AMX engine cannot take updates, and the adapter refuses it.
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
    """One adjustment: ``apply`` runs before ``module`` is first imported (``after``: just after it
    was executed, before its importer reads it), if ``needed()``."""

    name: str
    module: str
    needed: Callable[[], bool]
    apply: Callable[[], None]
    after: bool = False


# -- compile_disabled_plain_functions


def _compile_disabled_and_unwrapped() -> bool:
    """torch.compile is off here (as ``torch/_dynamo/config.py`` reads it) and not wrapped yet."""
    if os.environ.get("TORCH_COMPILE_DISABLE", "0") != "1":
        return False
    import torch

    return not getattr(torch.compile, "_grpo_plain_functions", False)


def _plain_functions_when_disabled() -> None:
    import inspect

    import torch

    compile_ = torch.compile

    def compile_plain(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # the decorator form: @torch.compile(...)
            return lambda fn: compile_plain(fn, **kwargs)
        return model if inspect.isfunction(model) else compile_(model, **kwargs)

    compile_plain._grpo_plain_functions = True  # type: ignore[attr-defined]
    torch.compile = compile_plain


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
    return (
        not getattr(register, "_grpo_megatron_compat", False) and "exist_ok" in register.__code__.co_varnames
    )


def _tolerate_reregistered_configs() -> None:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    original = AutoConfig.register

    def register(model_type: str, config: Any, exist_ok: bool = False) -> None:
        original(model_type, config, exist_ok=exist_ok or model_type in CONFIG_MAPPING)

    register._grpo_megatron_compat = True  # type: ignore[attr-defined]
    AutoConfig.register = staticmethod(register)  # type: ignore[method-assign]


# -- sglang_amx_choice

AMX_ENV = "GRPO_SGLANG_AMX"
"""``hide``: SGLang's processes see no AMX (its torch-native CPU path; ``rollout.sglang.cpu_path``);
``pretend`` (tests only): they see AMX where the CPU has none. Unset: what the CPU has."""
AMX_CHOICES = {"hide": False, "pretend": True}


def _amx_choice_set() -> bool:
    return os.environ.get(AMX_ENV, "") in AMX_CHOICES


def _answer_amx_query() -> None:
    """``torch.cpu._is_amx_tile_supported`` answers as ``GRPO_SGLANG_AMX`` says while it is set (read at
    each call: a test that set it for one engine leaves the process's answer as it was), else as before."""
    import torch

    cpu_answer = torch.cpu._is_amx_tile_supported

    def amx_tile_supported() -> bool:
        choice = os.environ.get(AMX_ENV, "")
        return AMX_CHOICES[choice] if choice in AMX_CHOICES else bool(cpu_answer())

    torch.cpu._is_amx_tile_supported = amx_tile_supported


# -- amx_packed_weights_reload

_KEPT = "_grpo_megatron_amx_kept"


@dataclasses.dataclass
class AmxKept:
    """A module's parameters as loaded, beside the ones SGLang's AMX post-processing made of them."""

    originals: dict[str, Any]
    """Weight name -> the parameter as loaded (the checkpoint's layout and dtype): what updates load into."""
    bias: Any
    """The bias as loaded (packing makes an fp32 copy), or None."""
    packed: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Weight name -> what packing made of it (the same parameter where it declined)."""
    amx: bool = False
    """Packing took the module (its ``use_intel_amx_backend``)."""
    others: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The module's other parameters as loaded (an FP8 layer's ``weight_scale_inv``): the
    post-processing that packs a layer may replace them by parameters without their loaders (SGLang's
    FP8 linear method on CPU re-wraps ``weight_scale_inv`` after packing, ``fp8.py``), which an update
    could not load into (a fused QKV's scales go through their loader's shard offsets)."""


def _sglang_on_amx() -> bool:
    from sglang.srt.utils.common import cpu_has_amx_support

    return bool(cpu_has_amx_support())


def _keeping_originals(pack: Callable[..., None]) -> Callable[..., None]:
    """SGLang's ``_amx_process_weight_after_loading`` that keeps what it packs (``AmxKept``) and leaves
    a module packed from its kept parameters as it is (``end_weight_update`` packs every module)."""

    def pack_keeping_originals(
        module: Any, weight_names: list[str], transpose_dims: Any = None, qweight_packed_method: Any = None
    ) -> None:
        if qweight_packed_method is not None:  # AWQ/GPTQ: packed from quantized tensors, not reloaded here
            pack(module, weight_names, transpose_dims, qweight_packed_method)
            return
        current = {n: getattr(module, n) for n in weight_names}
        kept: AmxKept | None = getattr(module, _KEPT, None)
        if kept is not None and all(current[n] is kept.packed.get(n) for n in weight_names):
            return
        if kept is None or any(current[n] is not kept.originals[n] for n in weight_names):
            kept = AmxKept(
                current, getattr(module, "bias", None), others=_other_parameters(module, weight_names)
            )
        pack(module, weight_names, transpose_dims)
        kept.packed = {n: getattr(module, n) for n in weight_names}
        kept.amx = bool(getattr(module, "use_intel_amx_backend", False))
        setattr(module, _KEPT, kept)

    pack_keeping_originals._grpo_megatron_compat = True  # type: ignore[attr-defined]
    pack_keeping_originals.__wrapped__ = pack  # type: ignore[attr-defined]
    return pack_keeping_originals


def _other_parameters(module: Any, weight_names: list[str]) -> dict[str, Any]:
    """The module's own parameters beside ``weight_names`` and its bias, by name (``AmxKept.others``)."""
    skip = {*weight_names, "bias"}
    return {n: p for n, p in module.named_parameters(recurse=False) if n not in skip}


def unpack_amx_weights(model: Any) -> int:
    """Put back every packed module's parameters as loaded (``AmxKept``), served unpacked until they
    are packed again; returns how many modules."""
    count = 0
    for module in model.modules():
        kept: AmxKept | None = getattr(module, _KEPT, None)
        if kept is None or not kept.amx:
            continue
        for name, param in [*kept.originals.items(), *kept.others.items()]:
            _restore(module, name, param)
        if kept.bias is not None:
            module.bias = kept.bias
        module.use_intel_amx_backend = False
        count += 1
    return count


def _restore(module: Any, name: str, value: Any) -> None:
    """``module.name = value`` as it was before packing: a plain tensor attribute stays one (DeepSeek's
    MLA ``w_kc`` / ``w_vc`` of an FP8 engine are float8 tensors, not parameters, until packing makes
    them parameters; torch refuses a tensor where a parameter is registered)."""
    import torch

    params = getattr(module, "_parameters", {})
    if name in params and not isinstance(value, torch.nn.Parameter):
        del params[name]
    setattr(module, name, value)


def _keep_packed_originals() -> None:
    from sglang.srt.layers import amx_utils

    original = amx_utils._amx_process_weight_after_loading
    if getattr(original, "_grpo_megatron_compat", False):
        return
    wrapped = _keeping_originals(original)
    name = "_amx_process_weight_after_loading"
    for module in list(sys.modules.values()):  # every module that imported it by name so far
        if getattr(module, name, None) is original:
            setattr(module, name, wrapped)


def _restore_unpacks_amx() -> None:
    from sglang.srt.model_loader.loader import DefaultModelLoader

    restore = DefaultModelLoader.restore_weights_before_loading
    if getattr(restore, "_grpo_megatron_compat", False):
        return

    def restore_weights_before_loading(model: Any, target_device: Any) -> None:
        restore(model, target_device)
        unpack_amx_weights(model)

    restore_weights_before_loading._grpo_megatron_compat = True  # type: ignore[attr-defined]
    DefaultModelLoader.restore_weights_before_loading = staticmethod(restore_weights_before_loading)


def _loader_restores_before_loading() -> bool:
    from sglang.srt.model_loader.loader import DefaultModelLoader

    return _sglang_on_amx() and hasattr(DefaultModelLoader, "restore_weights_before_loading")


FIXES: tuple[Fix, ...] = (
    Fix(
        "compile_disabled_plain_functions",
        "sglang",
        _compile_disabled_and_unwrapped,
        _plain_functions_when_disabled,
    ),
    Fix("torchvision_missing_ops", "torchvision", _torchvision_ops_unloadable, _define_torchvision_schemas),
    Fix(
        "transformers_config_reregistered",
        "sglang",
        _autoconfig_register_refuses_known_types,
        _tolerate_reregistered_configs,
    ),
    Fix("sglang_amx_choice", "sglang", _amx_choice_set, _answer_amx_query),
    Fix(
        "amx_packed_weights_reload",
        "sglang.srt.layers.amx_utils",
        _sglang_on_amx,
        _keep_packed_originals,
        after=True,
    ),
    Fix(
        "amx_packed_weights_reload",
        "sglang.srt.model_loader.loader",
        _loader_restores_before_loading,
        _restore_unpacks_amx,
        after=True,
    ),
)


class _ThenRun(importlib.abc.Loader):
    """A module's own loader, then ``done()`` once the module has executed."""

    def __init__(self, inner: Any, done: Callable[[], None]):
        self.inner = inner
        self.done = done

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        self.done()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self.inner, name)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Runs each fix just before its module is first imported, or just after (``Fix.after``: the
    module's own loader is wrapped), then steps aside."""

    def __init__(self, fixes: Sequence[Fix]):
        self.pending: dict[tuple[str, bool], list[Fix]] = {}
        for fix in fixes:
            self.pending.setdefault((fix.module, fix.after), []).append(fix)
        self.applied: list[str] = []

    def run(self, fixes: Sequence[Fix]) -> None:
        for fix in fixes:
            if fix.needed():
                fix.apply()
                if fix.name not in self.applied:
                    self.applied.append(fix.name)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        self.run(self.pending.pop((fullname, False), []))
        after = self.pending.pop((fullname, True), [])
        if not after:
            return None  # the normal finders import the module
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :]:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenRun(spec.loader, lambda: self.run(after))
                return spec
        return None

    def imported_already(self) -> None:
        """Apply now the fixes whose module is imported already."""
        for module, after in [k for k in self.pending if k[0] in sys.modules]:
            self.run(self.pending.pop((module, after)))


def install(fixes: Sequence[Fix] = FIXES) -> list[str]:
    """Arm ``fixes`` in this process (idempotent). A fix whose module is already imported is
    applied now if needed. Returns the names applied so far."""
    hook = next((f for f in sys.meta_path if isinstance(f, _ImportHook)), None)
    if hook is None:
        hook = _ImportHook(fixes)
        sys.meta_path.insert(0, hook)
    hook.imported_already()
    return list(hook.applied)


def applied() -> list[str]:
    """Names of the fixes applied in this process."""
    hook = next((f for f in sys.meta_path if isinstance(f, _ImportHook)), None)
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
