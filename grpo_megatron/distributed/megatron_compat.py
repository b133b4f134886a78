"""Make real megatron-core run where it assumes what is not there: each adjustment named, applied
where its cause is.

Opt-in: importing this module changes nothing. ``apply_megatron_compat(device)`` applies the fixes
in ``FIXES`` whose cause this process has (``Capabilities.detect(device)``), and only for the
megatron-core versions they were checked against (``CHECKED_MEGATRON_VERSIONS``; others are
refused with a RuntimeError whenever a fix would apply). Each fix has one cause (``CAUSES``,
listed with the tables below).

Call it once per process with the job's device, before building models, optimizers or the RNG
tracker (before or after ``initialize_model_parallel``); on CPU, seed with
``cpu_model_parallel_seed(seed)`` where a GPU job calls megatron's ``model_parallel_cuda_manual_seed``.

Every fix replaces one attribute (function, method, class or class attribute) of one megatron
module, except the two torch-level ones (``cuda_current_device``, ``cuda_synchronize``; their
comments in ``FIXES`` say why). Several CPU fixes run a megatron function unchanged under
``_CudaToCpuMode``, a torch function mode active only during that call: ``device="cuda"``
factories give CPU tensors, ``Tensor.cuda()`` returns the tensor, and ``Tensor.type()`` names a
CPU tensor by its CUDA twin (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``) so megatron's
dtype checks see what they see on a GPU. Each replacement keeps the object it replaced (for the
tests, which check that megatron still needs every fix).

The fixes by cause. Each is described once, in its record in ``FIXES``; these tables are
``fix_tables()`` (a test checks they match: after editing a record, paste the output of
``python -m grpo_megatron.distributed.megatron_compat`` here).

Cause ``no_te``: TransformerEngine is not installed, on any device (a GPU without TE included).

| name                           | what breaks in megatron-core                                   | where (megatron.core.*, or torch.*)                        | how we adjust                                        |
|--------------------------------|----------------------------------------------------------------|------------------------------------------------------------|------------------------------------------------------|
| moe_router_gemm_name           | moe_utils binds te_general_gemm only when TransformerEngine    | transformer.moe.moe_utils:te_general_gemm                  | bind it to None, which selects the router's torch    |
|                                | imports; the router's RouterGatingLinearFunction.forward then  |                                                            | matmul path                                          |
|                                | raises NameError                                               |                                                            |                                                      |
| mla_te_flag                    | megatron.core.extensions.transformer_engine imports without    | transformer.multi_latent_attention:HAVE_TE                 | set HAVE_TE=False when transformer_engine is not     |
|                                | TransformerEngine (its names become stand-ins), so             |                                                            | installed (what the flag means)                      |
|                                | multi_latent_attention sets HAVE_TE=True and                   |                                                            |                                                      |
|                                | MLASelfAttention's isinstance(linear_proj, TELinear) raises    |                                                            |                                                      |
|                                | TypeError: MLA (DeepSeek-V3) cannot be built                   |                                                            |                                                      |
| torch_norm_sequence_parallel   | WrappedTorchNorm asserts 'sequence parallel not supported by   | transformer.torch_norm:WrappedTorchNorm.__new__            | build the norm with sequence_parallel off and mark   |
|                                | torch LayerNorm'; MoE with TP>1 requires sequence parallelism  |                                                            | its parameters sequence_parallel=True so             |
|                                |                                                                |                                                            | finalize_model_grads sums their gradients over TP    |

Cause ``torch_adam``: megatron's optimizer is torch's Adam (neither TE's nor apex's fused Adam was
importable), on any device: its per-parameter ``step`` tensor is what the distributed optimizer's
checkpoint code does not expect.

| name                           | what breaks in megatron-core                                   | where (megatron.core.*, or torch.*)                        | how we adjust                                        |
|--------------------------------|----------------------------------------------------------------|------------------------------------------------------------|------------------------------------------------------|
| distopt_fresh_state_dict       | DistributedOptimizer.state_dict reads Adam's step from the     | optimizer.distrib_optimizer:DistributedOptimizer.          | with no Adam state yet, return the param groups with |
|                                | per-parameter state and asserts exactly one value; a fresh     |   state_dict                                               | step 0                                               |
|                                | optimizer (which resuming builds the load state dict from) has |                                                            |                                                      |
|                                | none                                                           |                                                            |                                                      |
| distopt_keep_restored_step     | DistributedOptimizer._set_main_param_and_optimizer_states      | optimizer.distrib_optimizer:DistributedOptimizer.          | the step restored from the param groups is kept      |
|                                | copies every key of torch Adam's state: KeyError 'step'        |   _set_main_param_and_optimizer_states                     | (copied onto itself)                                 |
|                                | loading fully_reshardable (the checkpoint keeps step in the    |                                                            |                                                      |
|                                | param groups), and with dp_reshardable the fresh optimizer's   |                                                            |                                                      |
|                                | step 0 overwrites the restored one                             |                                                            |                                                      |
| distopt_dp_reshardable_no_grad | DistributedOptimizer.load_parameter_state_from_dp_reshardable  | optimizer.distrib_optimizer:DistributedOptimizer.          | run it under torch.no_grad() (as its                 |
|                                | copies in place into fp32 main params that are views of leaf   |   load_parameter_state_from_dp_reshardable                 | fully_reshardable twin is)                           |
|                                | parameters, with autograd on: 'a view of a leaf Variable that  |                                                            |                                                      |
|                                | requires grad is being used in an in-place operation'          |                                                            |                                                      |
| distopt_unshared_step          | SILENT: DistributedOptimizer.load_state_dict gives every       | optimizer.distrib_optimizer:DistributedOptimizer.          | after loading, give each parameter's state its own   |
|                                | parameter's Adam state one shared step tensor; torch's Adam    |   load_state_dict                                          | copy of the step                                     |
|                                | increments it in place once per parameter, so after a resume   |                                                            |                                                      |
|                                | the step (and bias correction) is wrong and the weights drift  |                                                            |                                                      |
|                                | from an uninterrupted run                                      |                                                            |                                                      |

Cause ``cpu``: the job runs on CPU (``parallel.backend=gloo``, or no CUDA): every place where
megatron assumes CUDA.

| name                           | what breaks in megatron-core                                   | where (megatron.core.*, or torch.*)                        | how we adjust                                        |
|--------------------------------|----------------------------------------------------------------|------------------------------------------------------------|------------------------------------------------------|
| cuda_current_device            | torch.cuda.current_device() asserts 'Torch not compiled with   | torch.cuda:current_device                                  | returns torch.device('cpu')                          |
|                                | CUDA enabled'; megatron uses it as the device of tensors it    |                                                            |                                                      |
|                                | creates (layers, MoE router and experts, DDP buffers)          |                                                            |                                                      |
| cuda_synchronize               | torch.cuda.synchronize() asserts; pipeline p2p calls it after  | torch.cuda:synchronize                                     | a no-op                                              |
|                                | each batched send/recv                                         |                                                            |                                                      |
| rng_tracker_cpu_states         | CudaRNGStatesTracker.add/fork read and write CUDA generator    | tensor_parallel.random:CudaRNGStatesTracker                | megatron's tracker class is replaced by a subclass   |
|                                | states (asserts on CPU), so model_parallel_cuda_manual_seed,   |                                                            | keeping CPU generator states, so                     |
|                                | dropout and get_cuda_rng_tracker().fork() fail                 |                                                            | initialize_rng_tracker / get_cuda_rng_tracker build  |
|                                |                                                                |                                                            | ours; seed with cpu_model_parallel_seed              |
| recompute_cpu_rng              | activation recomputation's CheckpointFunction saves and        | tensor_parallel.random:_get_cuda_rng_state                 | the CUDA state is an empty tensor and restoring it a |
|                                | restores the CUDA generator state (_get_all_rng_states):       | tensor_parallel.random:_set_cuda_rng_state                 | no-op; megatron still saves and restores the CPU     |
|                                | AssertionError 'Torch not compiled with CUDA enabled' with     |                                                            | generator and the (CPU) tracker states, which are    |
|                                | recompute                                                      |                                                            | the ones in use                                      |
| moe_alltoall_dtoh              | MoEAlltoAllTokenDispatcher.__init__ creates a                  | transformer.moe.token_dispatcher:                          | a stand-in for the cached stream; the method only    |
|                                | torch.cuda.Stream; _maybe_dtoh_and_synchronize uses            |   MoEAlltoAllTokenDispatcher.cuda_dtoh_stream              | converts the split sizes to numpy                    |
|                                | streams/events and converts split sizes to numpy only for CUDA | transformer.moe.token_dispatcher:                          |                                                      |
|                                | tensors, so all_to_all_single gets tensors as split sizes      |   MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize   |                                                      |
|                                | (TypeError)                                                    |                                                            |                                                      |
| gloo_uneven_all_gather         | with expert tensor parallelism > 1 the alltoall dispatcher     | tensor_parallel.mappings:_gather_along_first_dim           | for split sizes given, all-gather rows padded to the |
|                                | all-gathers tokens with unequal split sizes into a list of     |                                                            | largest split and keep each rank's real rows; other  |
|                                | tensors, which gloo rejects ('invalid tensor size'); the       |                                                            | calls go to megatron's function                      |
|                                | matching uneven reduce-scatter works on gloo and is left alone |                                                            |                                                      |
| causal_mask_on_cuda            | get_default_causal_mask / get_sliding_window_causal_mask       | transformer.utils:get_default_causal_mask                  | run them under _CudaToCpuMode                        |
|                                | create the mask with device='cuda' (the unfused softmax path,  | transformer.utils:get_sliding_window_causal_mask           |                                                      |
|                                | whenever no mask is passed)                                    | fusions.fused_softmax:get_default_causal_mask              |                                                      |
|                                |                                                                | fusions.fused_softmax:get_sliding_window_causal_mask       |                                                      |
| tied_embeddings_on_cuda        | with tied embeddings and PP > 1,                               | models.common.language_module.language_module:             | run it under _CudaToCpuMode (.cuda() returns the     |
|                                | LanguageModule.setup_embeddings_and_output_layer moves the     |   LanguageModule.setup_embeddings_and_output_layer         | tensor itself)                                       |
|                                | shared weight with .cuda() before all-reducing it over the     |                                                            |                                                      |
|                                | embedding group                                                |                                                            |                                                      |
| schedules_on_cuda              | the forward-backward schedules create total_num_tokens with    | pipeline_parallel.schedules:forward_backward_no_pipelining | run them under _CudaToCpuMode                        |
|                                | device='cuda'                                                  | pipeline_parallel.schedules:                               | (get_forward_backward_func returns the replaced      |
|                                |                                                                |   forward_backward_pipelining_without_interleaving         | functions)                                           |
|                                |                                                                | pipeline_parallel.schedules:                               |                                                      |
|                                |                                                                |   forward_backward_pipelining_with_interleaving            |                                                      |
| optimizer_on_cuda              | FP32Optimizer/MixedPrecisionOptimizer create scale and         | optimizer.optimizer:FP32Optimizer.__init__                 | run them under _CudaToCpuMode                        |
|                                | overflow tensors with device='cuda'; DistributedOptimizer      | optimizer.optimizer:MixedPrecisionOptimizer.__init__       |                                                      |
|                                | accepts only 'torch.cuda.*Tensor' parameters (TypeError); the  | optimizer.distrib_optimizer:DistributedOptimizer.          |                                                      |
|                                | grad-norm and clipping functions reduce in device='cuda'       |   _build_model_and_main_param_groups                       |                                                      |
|                                | tensors and assert CUDA type names                             | optimizer.clip_grads:get_grad_norm_fp32                    |                                                      |
|                                |                                                                | optimizer.clip_grads:clip_grad_by_total_norm_fp32          |                                                      |
|                                |                                                                | optimizer.clip_grads:count_zeros_fp32                      |                                                      |
|                                |                                                                | optimizer.optimizer:get_grad_norm_fp32                     |                                                      |
|                                |                                                                | optimizer.optimizer:clip_grad_by_total_norm_fp32           |                                                      |
|                                |                                                                | optimizer.optimizer:count_zeros_fp32                       |                                                      |
|                                |                                                                | optimizer.layer_wise_optimizer:get_grad_norm_fp32          |                                                      |
|                                |                                                                | optimizer.layer_wise_optimizer:count_zeros_fp32            |                                                      |
| distopt_dp_zero_on_cuda        | DistributedOptimizer.get_parameter_state_dp_zero (the          | optimizer.distrib_optimizer:DistributedOptimizer.          | run it under _CudaToCpuMode                          |
|                                | fully_reshardable save gathers each DP group's optimizer state |   get_parameter_state_dp_zero                              |                                                      |
|                                | with it) moves every shard with .cuda()                        |                                                            |                                                      |

Seen working with these on gloo (tests/test_megatron_compat.py): TP2 + sequence parallel, EP2 with the
alltoall and allgather dispatchers, PP2 (tied embeddings), TP2xEP2, TP2 ETP1 EP2, TP2 ETP2, DP2
with the distributed optimizer; forward/backward through megatron's schedules and outside them.
Not covered (not needed here on CPU): several
distributed-optimizer instances (DDP CUDA streams), shared-expert overlap streams, CUDA graphs,
fine-grained activation offloading, megatron's inference engines, fp16/bf16 optimizers.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.metadata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode

CHECKED_MEGATRON_VERSIONS = ("0.16.1",)

Cause = Literal["no_te", "torch_adam", "cpu"]

# Attribute set on every replacement we install, holding the object it replaced: it tells our
# objects from megatron's own (the applied state lives in the patched modules themselves, not in
# a registry here) and lets tests reach megatron's original to check it still needs the fix.
_ORIGINAL = "_grpo_megatron_compat_original"


@dataclass(frozen=True)
class Fix:
    """One incompatibility of megatron-core, its cause, and how it is adjusted."""

    name: str  # short identifier, returned by apply_megatron_compat()
    cause: Cause  # what this process must lack for the fix to apply (see ``Capabilities``)
    what_breaks: str  # megatron-core's assumption and the error it gives without the fix
    where: str  # the megatron module attribute(s) we replace ("module:Qualified.attr")
    fix: str  # what the replacement does
    apply: Callable[[], None]  # installs the fix; idempotent
    is_applied: Callable[[], bool]  # True when every replacement of this fix is in place


CAUSES: dict[Cause, str] = {
    "no_te": "TransformerEngine is not installed, on any device (a GPU without TE included)",
    "torch_adam": "megatron's optimizer is torch's Adam (neither TE's nor apex's fused Adam was importable), on "
    "any device: its per-parameter ``step`` tensor is what the distributed optimizer's checkpoint code does "
    "not expect",
    "cpu": "the job runs on CPU (``parallel.backend=gloo``, or no CUDA): every place where megatron assumes CUDA",
}
"""What each cause means: what this process lacks for the fixes of that cause to apply."""

_COLUMNS = (
    ("name", 30),
    ("what breaks in megatron-core", 62),
    ("where (megatron.core.*, or torch.*)", 58),
    ("how we adjust", 52),
)


def _wrap_target(target: str, width: int) -> list[str]:
    """A ``module:Class.attr`` target in lines of at most ``width``, broken after a dot or colon."""
    import re

    lines = [""]
    for part in re.split(r"(?<=[.:])", target):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("  ")
        lines[-1] += part
    return lines


def fix_tables(fixes: tuple[Fix, ...] | None = None) -> str:
    """The module docstring's tables, one per cause, rendered from the fix records (``FIXES``), where
    each fix is described once; a test checks the docstring holds exactly this text."""
    import textwrap

    def wrap(text: str, width: int) -> list[str]:
        return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, (_, w) in zip(cells, _COLUMNS, strict=True)) + " |"

    out = []
    for cause, meaning in CAUSES.items():
        out += [*textwrap.wrap(f"Cause ``{cause}``: {meaning}.", 100), ""]
        out += [line([h for h, _ in _COLUMNS]), "|" + "|".join("-" * (w + 2) for _, w in _COLUMNS) + "|"]
        for fix in fixes if fixes is not None else FIXES:
            if fix.cause != cause:
                continue
            (_, w_name), (_, w_what), (_, w_where), (_, w_fix) = _COLUMNS
            where = [
                p
                for t in fix.where.split(", ")
                for p in _wrap_target(t.removeprefix("megatron.core."), w_where)
            ]
            cells = [wrap(fix.name, w_name), wrap(fix.what_breaks, w_what), where, wrap(fix.fix, w_fix)]
            for i in range(max(len(c) for c in cells)):
                out.append(line([c[i] if i < len(c) else "" for c in cells]))
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


# ----------------------------------------------------------------------------------------------
# Replacing attributes


def _resolve(target: str) -> tuple[Any, str]:
    """``"pkg.module:Class.attr"`` -> (owner object, attribute name)."""
    module_name, _, attr_path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, attr = attr_path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attr


def _get_raw(target: str) -> Any:
    """The attribute as stored: for a class, the raw descriptor (staticmethod/classmethod kept)."""
    owner, attr = _resolve(target)
    if isinstance(owner, type):
        return owner.__dict__[attr]
    return getattr(owner, attr)


def _unwrap(obj: Any) -> Any:
    return obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj


def _is_ours(obj: Any) -> bool:
    return hasattr(_unwrap(obj), _ORIGINAL)


def _original(target: str) -> Any:
    """megatron's (or torch's) own object at ``target``, whether or not our fix replaced it."""
    current = _get_raw(target)
    return getattr(_unwrap(current), _ORIGINAL) if _is_ours(current) else current


def _replace(target: str, make: Callable[[Any], Any]) -> None:
    """Replace ``target`` with ``make(original)`` unless our replacement is already there."""
    original = _get_raw(target)
    if _is_ours(original):
        return
    new = make(original)
    setattr(_unwrap(new), _ORIGINAL, original)
    owner, attr = _resolve(target)
    setattr(owner, attr, new)


def _keep_descriptor(make_fn: Callable[[Callable], Callable]) -> Callable[[Any], Any]:
    """Lift a function transformer to class descriptors: staticmethod/classmethod stay what they are."""

    def make(original: Any) -> Any:
        if isinstance(original, (staticmethod, classmethod)):
            return type(original)(make_fn(original.__func__))
        return make_fn(original)

    return make


def _replacing_fix(
    name: str, cause: Cause, what_breaks: str, fix: str, replacements: dict[str, Callable[[Any], Any]]
) -> Fix:
    """A fix that replaces each target attribute with ``make(original)``."""

    def apply() -> None:
        for target, make in replacements.items():
            _replace(target, make)

    return Fix(
        name=name,
        cause=cause,
        what_breaks=what_breaks,
        where=", ".join(replacements),
        fix=fix,
        apply=apply,
        is_applied=lambda: all(_is_ours(_get_raw(target)) for target in replacements),
    )


def _same(targets: tuple[str, ...], make: Callable[[Any], Any]) -> dict[str, Callable[[Any], Any]]:
    return dict.fromkeys(targets, make)


# ----------------------------------------------------------------------------------------------
# Running a megatron function as if the CPU were the GPU


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int):  # an int device means a CUDA ordinal to torch factories
        return True
    try:
        return torch.device(device).type == "cuda"
    except (TypeError, RuntimeError):
        return False


class _CudaToCpuMode(TorchFunctionMode):
    """While active: ``device="cuda"`` factories give CPU tensors, ``Tensor.cuda()`` returns the
    tensor itself, and ``Tensor.type()`` names a CPU tensor by its CUDA twin."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            type_name = func(*args)
            return type_name if ".cuda." in type_name else type_name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _run_under_cuda_to_cpu(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _CudaToCpuMode():
            return fn(*args, **kwargs)

    return wrapper


# ----------------------------------------------------------------------------------------------
# The RNG tracker on CPU generator states


def _cpu_rng_tracker_class(base: type) -> type:
    """A subclass of megatron's ``CudaRNGStatesTracker`` whose named states are CPU generator
    states. On CPU the default generator is what dropout draws from, so ``fork(name)`` swaps the
    named state into it and back, as the CUDA tracker does with the CUDA generator."""

    class CpuRNGStatesTracker(base):
        _current_state_name: str | None  # set by megatron's tracker; the state fork() swapped in

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"RNG seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"RNG state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"RNG state {name} is not added")
            outer_state = torch.get_rng_state()
            outer_name = self._current_state_name
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    CpuRNGStatesTracker.__qualname__ = "CpuRNGStatesTracker"
    return CpuRNGStatesTracker


# ----------------------------------------------------------------------------------------------
# The fixes


def _current_device_cpu() -> torch.device:
    return torch.device("cpu")


def _no_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    return None


def _synchronize_noop(device: Any = None) -> None:
    return None


def _make_norm_new(original_new: Callable) -> Callable:
    def __new__(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        # A shallow copy with the flag off: the norm itself is the same function of its input
        # rows; what sequence parallelism changes is that each TP rank sees other rows, so the
        # weight gradients must be summed over TP, which finalize_model_grads does for every
        # parameter marked `sequence_parallel` (as TE's norms are).
        config_without_sp = copy.copy(config)
        config_without_sp.sequence_parallel = False
        norm = original_new(cls, config_without_sp, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return __new__


def _make_dtoh_method(_original: Callable) -> Callable:
    def _maybe_dtoh_and_synchronize(
        self: Any, point: str, tokens_per_expert: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        # On CPU there is nothing to copy or wait for; what remains of the original is that the
        # split sizes become host numbers, which all_to_all_single needs (numpy arrays, as
        # megatron makes from CUDA tensors).
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for attr in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, attr, None)
                if torch.is_tensor(value):
                    setattr(self, attr, value.numpy())
        return tokens_per_expert

    return _maybe_dtoh_and_synchronize


def _make_uneven_all_gather(original: Callable) -> Callable:
    def _gather_along_first_dim(
        input_: torch.Tensor,
        group: Any,
        output_split_sizes: list[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        # gloo's list all_gather needs equal sizes: gather rows padded to the largest split,
        # then keep each rank's real rows.
        width = max(output_split_sizes)
        padded = input_.new_zeros((width, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((width * group.size(), *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(gathered, padded, group=group)
        chunks = gathered.split(width)
        return torch.cat([chunk[:n] for chunk, n in zip(chunks, output_split_sizes, strict=True)])

    return _gather_along_first_dim


class _NoStream:
    """Stands in for the CUDA stream megatron caches on the alltoall dispatcher class, so that
    its ``__init__`` (which creates one when the cached value is None) does not try."""


def _set_te_general_gemm() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None


def _te_general_gemm_bound() -> bool:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    return "te_general_gemm" in vars(moe_utils)


def _clear_mla_te_flag() -> None:
    import megatron.core.transformer.multi_latent_attention as mla

    if not _transformer_engine_installed():
        mla.HAVE_TE = False


def _mla_te_flag_cleared() -> bool:
    import megatron.core.transformer.multi_latent_attention as mla

    return _transformer_engine_installed() or mla.HAVE_TE is False


# ----------------------------------------------------------------------------------------------
# Distributed-optimizer checkpoints (torch Adam: a per-parameter `step` tensor)


def _make_fresh_state_dict(original: Callable) -> Callable:
    def state_dict(self: Any) -> dict[str, Any]:
        if len(self.optimizer.state) > 0:
            return original(self)
        # No step taken yet, so no Adam state to read the step from (megatron asserts exactly
        # one). Resuming asks a fresh optimizer for this; its step is 0.
        inner = self.optimizer.state_dict()
        state = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
        for group in state["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = 0
        if self.grad_scaler:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    return state_dict


def _make_keep_restored_step(original: Callable) -> Callable:
    def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        # megatron restores Adam's step from the param groups (load_state_dict); the per-parameter
        # tensors of its checkpoint formats either lack it (fully_reshardable: KeyError) or hold
        # the fresh optimizer's 0 (dp_reshardable). The restored step is copied onto itself.
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def _make_unshared_step(original: Callable) -> Callable:
    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        original(self, state_dict)
        # megatron hands every parameter's state the same `step` tensor; torch's Adam increments
        # each parameter's step in place, so a shared one would advance once per parameter.
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    return load_state_dict


def _make_no_grad(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return original(*args, **kwargs)

    return wrapper


_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher"
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_OPTIM = "megatron.core.optimizer"
_DISTOPT = f"{_OPTIM}.distrib_optimizer:DistributedOptimizer"

FIXES: tuple[Fix, ...] = (
    # torch-level, unavoidably: megatron calls torch.cuda.current_device() at dozens of sites in
    # many modules (each holding `torch`, not the function), at build and at run time; there is
    # no narrower place. The answer is only ever used as a device for new tensors.
    _replacing_fix(
        "cuda_current_device",
        "cpu",
        "torch.cuda.current_device() asserts 'Torch not compiled with CUDA enabled'; megatron uses "
        "it as the device of tensors it creates (layers, MoE router and experts, DDP buffers)",
        "returns torch.device('cpu')",
        {"torch.cuda:current_device": lambda _original: _current_device_cpu},
    ),
    # torch-level as well: called directly in p2p_communication (after every batched send/recv
    # of pipeline parallelism) and DDP; CPU kernels are synchronous, so a no-op is exact.
    _replacing_fix(
        "cuda_synchronize",
        "cpu",
        "torch.cuda.synchronize() asserts; pipeline p2p calls it after each batched send/recv",
        "a no-op",
        {"torch.cuda:synchronize": lambda _original: _synchronize_noop},
    ),
    _replacing_fix(
        "rng_tracker_cpu_states",
        "cpu",
        "CudaRNGStatesTracker.add/fork read and write CUDA generator states (asserts on CPU), so "
        "model_parallel_cuda_manual_seed, dropout and get_cuda_rng_tracker().fork() fail",
        "megatron's tracker class is replaced by a subclass keeping CPU generator states, so "
        "initialize_rng_tracker / get_cuda_rng_tracker build ours; seed with cpu_model_parallel_seed",
        {"megatron.core.tensor_parallel.random:CudaRNGStatesTracker": _cpu_rng_tracker_class},
    ),
    _replacing_fix(
        "recompute_cpu_rng",
        "cpu",
        "activation recomputation's CheckpointFunction saves and restores the CUDA generator state "
        "(_get_all_rng_states): AssertionError 'Torch not compiled with CUDA enabled' with recompute",
        "the CUDA state is an empty tensor and restoring it a no-op; megatron still saves and "
        "restores the CPU generator and the (CPU) tracker states, which are the ones in use",
        {
            "megatron.core.tensor_parallel.random:_get_cuda_rng_state": lambda _original: _no_cuda_rng_state,
            "megatron.core.tensor_parallel.random:_set_cuda_rng_state": lambda _original: (
                _set_no_cuda_rng_state
            ),
        },
    ),
    Fix(
        name="moe_router_gemm_name",
        cause="no_te",
        what_breaks="moe_utils binds te_general_gemm only when TransformerEngine imports; the router's "
        "RouterGatingLinearFunction.forward then raises NameError",
        where="megatron.core.transformer.moe.moe_utils:te_general_gemm",
        fix="bind it to None, which selects the router's torch matmul path",
        apply=_set_te_general_gemm,
        is_applied=_te_general_gemm_bound,
    ),
    Fix(
        name="mla_te_flag",
        cause="no_te",
        what_breaks="megatron.core.extensions.transformer_engine imports without TransformerEngine (its "
        "names become stand-ins), so multi_latent_attention sets HAVE_TE=True and MLASelfAttention's "
        "isinstance(linear_proj, TELinear) raises TypeError: MLA (DeepSeek-V3) cannot be built",
        where="megatron.core.transformer.multi_latent_attention:HAVE_TE",
        fix="set HAVE_TE=False when transformer_engine is not installed (what the flag means)",
        apply=_clear_mla_te_flag,
        is_applied=_mla_te_flag_cleared,
    ),
    _replacing_fix(
        "moe_alltoall_dtoh",
        "cpu",
        "MoEAlltoAllTokenDispatcher.__init__ creates a torch.cuda.Stream; "
        "_maybe_dtoh_and_synchronize uses streams/events and converts split sizes to numpy only for "
        "CUDA tensors, so all_to_all_single gets tensors as split sizes (TypeError)",
        "a stand-in for the cached stream; the method only converts the split sizes to numpy",
        {
            f"{_DISPATCHER}.cuda_dtoh_stream": lambda _original: _NoStream(),
            f"{_DISPATCHER}._maybe_dtoh_and_synchronize": _make_dtoh_method,
        },
    ),
    _replacing_fix(
        "gloo_uneven_all_gather",
        "cpu",
        "with expert tensor parallelism > 1 the alltoall dispatcher all-gathers tokens with unequal "
        "split sizes into a list of tensors, which gloo rejects ('invalid tensor size'); the "
        "matching uneven reduce-scatter works on gloo and is left alone",
        "for split sizes given, all-gather rows padded to the largest split and keep each rank's "
        "real rows; other calls go to megatron's function",
        {"megatron.core.tensor_parallel.mappings:_gather_along_first_dim": _make_uneven_all_gather},
    ),
    _replacing_fix(
        "torch_norm_sequence_parallel",
        "no_te",
        "WrappedTorchNorm asserts 'sequence parallel not supported by torch LayerNorm'; MoE with "
        "TP>1 requires sequence parallelism",
        "build the norm with sequence_parallel off and mark its parameters sequence_parallel=True "
        "so finalize_model_grads sums their gradients over TP",
        {"megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__": _keep_descriptor(_make_norm_new)},
    ),
    _replacing_fix(
        "causal_mask_on_cuda",
        "cpu",
        "get_default_causal_mask / get_sliding_window_causal_mask create the mask with device='cuda' "
        "(the unfused softmax path, whenever no mask is passed)",
        "run them under _CudaToCpuMode",
        _same(
            tuple(
                f"megatron.core.{module}:{fn}"
                for module in ("transformer.utils", "fusions.fused_softmax")
                for fn in ("get_default_causal_mask", "get_sliding_window_causal_mask")
            ),
            _run_under_cuda_to_cpu,
        ),
    ),
    _replacing_fix(
        "tied_embeddings_on_cuda",
        "cpu",
        "with tied embeddings and PP > 1, LanguageModule.setup_embeddings_and_output_layer moves the "
        "shared weight with .cuda() before all-reducing it over the embedding group",
        "run it under _CudaToCpuMode (.cuda() returns the tensor itself)",
        {
            "megatron.core.models.common.language_module.language_module:"
            "LanguageModule.setup_embeddings_and_output_layer": _run_under_cuda_to_cpu
        },
    ),
    _replacing_fix(
        "schedules_on_cuda",
        "cpu",
        "the forward-backward schedules create total_num_tokens with device='cuda'",
        "run them under _CudaToCpuMode (get_forward_backward_func returns the replaced functions)",
        _same(
            tuple(
                f"{_SCHEDULES}:{fn}"
                for fn in (
                    "forward_backward_no_pipelining",
                    "forward_backward_pipelining_without_interleaving",
                    "forward_backward_pipelining_with_interleaving",
                )
            ),
            _run_under_cuda_to_cpu,
        ),
    ),
    _replacing_fix(
        "optimizer_on_cuda",
        "cpu",
        "FP32Optimizer/MixedPrecisionOptimizer create scale and overflow tensors with device='cuda'; "
        "DistributedOptimizer accepts only 'torch.cuda.*Tensor' parameters (TypeError); the grad-norm "
        "and clipping functions reduce in device='cuda' tensors and assert CUDA type names",
        "run them under _CudaToCpuMode",
        _same(
            (
                f"{_OPTIM}.optimizer:FP32Optimizer.__init__",
                f"{_OPTIM}.optimizer:MixedPrecisionOptimizer.__init__",
                f"{_OPTIM}.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
                *(
                    f"{_OPTIM}.{module}:{fn}"
                    for module in ("clip_grads", "optimizer")
                    for fn in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32")
                ),
                *(f"{_OPTIM}.layer_wise_optimizer:{fn}" for fn in ("get_grad_norm_fp32", "count_zeros_fp32")),
            ),
            _keep_descriptor(_run_under_cuda_to_cpu),
        ),
    ),
    # Distributed-optimizer checkpoints (cause torch_adam, except the CPU-only .cuda() gather).
    _replacing_fix(
        "distopt_fresh_state_dict",
        "torch_adam",
        "DistributedOptimizer.state_dict reads Adam's step from the per-parameter state and asserts "
        "exactly one value; a fresh optimizer (which resuming builds the load state dict from) has none",
        "with no Adam state yet, return the param groups with step 0",
        {f"{_DISTOPT}.state_dict": _make_fresh_state_dict},
    ),
    _replacing_fix(
        "distopt_dp_zero_on_cuda",
        "cpu",
        "DistributedOptimizer.get_parameter_state_dp_zero (the fully_reshardable save gathers each "
        "DP group's optimizer state with it) moves every shard with .cuda()",
        "run it under _CudaToCpuMode",
        {f"{_DISTOPT}.get_parameter_state_dp_zero": _run_under_cuda_to_cpu},
    ),
    _replacing_fix(
        "distopt_keep_restored_step",
        "torch_adam",
        "DistributedOptimizer._set_main_param_and_optimizer_states copies every key of torch Adam's "
        "state: KeyError 'step' loading fully_reshardable (the checkpoint keeps step in the param "
        "groups), and with dp_reshardable the fresh optimizer's step 0 overwrites the restored one",
        "the step restored from the param groups is kept (copied onto itself)",
        {f"{_DISTOPT}._set_main_param_and_optimizer_states": _make_keep_restored_step},
    ),
    _replacing_fix(
        "distopt_dp_reshardable_no_grad",
        "torch_adam",
        "DistributedOptimizer.load_parameter_state_from_dp_reshardable copies in place into fp32 "
        "main params that are views of leaf parameters, with autograd on: 'a view of a leaf Variable "
        "that requires grad is being used in an in-place operation'",
        "run it under torch.no_grad() (as its fully_reshardable twin is)",
        {f"{_DISTOPT}.load_parameter_state_from_dp_reshardable": _make_no_grad},
    ),
    _replacing_fix(
        "distopt_unshared_step",
        "torch_adam",
        "SILENT: DistributedOptimizer.load_state_dict gives every parameter's Adam state one shared "
        "step tensor; torch's Adam increments it in place once per parameter, so after a resume the "
        "step (and bias correction) is wrong and the weights drift from an uninterrupted run",
        "after loading, give each parameter's state its own copy of the step",
        {f"{_DISTOPT}.load_state_dict": _make_unshared_step},
    ),
)


# ----------------------------------------------------------------------------------------------
# Public API


def _installed_megatron_version() -> str:
    return importlib.metadata.version("megatron-core")


def _transformer_engine_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _megatron_uses_torch_adam() -> bool:
    """megatron.core.optimizer binds ``Adam`` to TE's fused Adam, else apex's, else torch's AdamW."""
    from megatron.core import optimizer as megatron_optimizer

    return megatron_optimizer.Adam.__module__.startswith("torch.")


@dataclass(frozen=True)
class Capabilities:
    """What this process has that megatron-core may assume; each fix applies where its cause is."""

    cpu: bool  # the job's device is CPU (megatron assumes CUDA)
    transformer_engine: bool  # TransformerEngine is installed
    fused_adam: bool  # megatron's Adam is TE's or apex's fused Adam, not torch's

    @classmethod
    def detect(cls, device: str | torch.device) -> Capabilities:
        """The capabilities of this process for a job on ``device`` (the job's, not the machine's:
        a CPU job on a GPU machine gets the CPU fixes)."""
        return cls(
            cpu=torch.device(device).type == "cpu",
            transformer_engine=_transformer_engine_installed(),
            fused_adam=not _megatron_uses_torch_adam(),
        )

    def causes(self) -> frozenset[Cause]:
        present: set[Cause] = set()
        if self.cpu:
            present.add("cpu")
        if not self.transformer_engine:
            present.add("no_te")
        if not self.fused_adam:
            present.add("torch_adam")
        return frozenset(present)


def fixes_for(capabilities: Capabilities) -> tuple[Fix, ...]:
    """The fixes whose cause ``capabilities`` has, in ``FIXES`` order."""
    causes = capabilities.causes()
    return tuple(fix for fix in FIXES if fix.cause in causes)


def applied_fixes() -> tuple[str, ...]:
    """Names of the fixes currently in place in this process."""
    return tuple(fix.name for fix in FIXES if fix.is_applied())


def apply_megatron_compat(
    device: str | torch.device, *, capabilities: Capabilities | None = None
) -> list[str]:
    """Apply the fixes whose cause this process has for a job on ``device``; return their names.
    Idempotent. ``capabilities`` defaults to ``Capabilities.detect(device)``.

    Raises ``RuntimeError`` when a fix would apply and the installed megatron-core was not checked.
    """
    capabilities = capabilities if capabilities is not None else Capabilities.detect(device)
    fixes = fixes_for(capabilities)
    if not fixes:
        return []
    version = _installed_megatron_version()
    if version not in CHECKED_MEGATRON_VERSIONS:
        causes = ", ".join(sorted({fix.cause for fix in fixes}))
        raise RuntimeError(
            f"grpo_megatron's megatron-core compatibility fixes were checked against megatron-core "
            f"{', '.join(CHECKED_MEGATRON_VERSIONS)}, but {version} is installed and this job needs the "
            f"fixes for: {causes}. Install megatron-core=={CHECKED_MEGATRON_VERSIONS[-1]}, or re-check every "
            f"fix in grpo_megatron/distributed/megatron_compat.py against {version} "
            f"(tests/test_megatron_compat.py) and add it to CHECKED_MEGATRON_VERSIONS."
        )
    for fix in fixes:
        fix.apply()
    return [fix.name for fix in fixes]


def cpu_model_parallel_seed(
    seed: int,
    *,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    pp_rank: int | None = None,
) -> None:
    """CPU counterpart of megatron's ``model_parallel_cuda_manual_seed``; call after
    ``initialize_model_parallel`` (ranks default to megatron's parallel_state) and after
    ``apply_megatron_compat("cpu")``.

    As Megatron-LM's training setup does, pipeline stages get ``seed + 100 * pp_rank``; from that
    ``s``, seeded the way megatron seeds its three streams: the default generator (here the CPU
    one) and the data-parallel state with ``s``; the tensor-model-parallel state with
    ``s + 2718 + tp_rank``; the expert-parallel state with ``s + 1024 + 100 * ep_rank + etp_rank``.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    if not _is_ours(megatron_random.CudaRNGStatesTracker):
        raise RuntimeError(
            "cpu_model_parallel_seed needs the CPU RNG tracker: call apply_megatron_compat('cpu') first "
            "(on a GPU use megatron's model_parallel_cuda_manual_seed instead)"
        )
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    ep_rank = parallel_state.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    etp_rank = parallel_state.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    stage_seed = seed + 100 * pp_rank

    torch.manual_seed(stage_seed)
    megatron_random.initialize_rng_tracker(force_reset=True)
    tracker = megatron_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(megatron_random.get_data_parallel_rng_tracker_name(), stage_seed)
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, stage_seed + 2718 + tp_rank)
    tracker.add(
        megatron_random.get_expert_parallel_rng_tracker_name(), stage_seed + 1024 + 100 * ep_rank + etp_rank
    )


def group_timeouts(group: Any) -> set[timedelta]:
    """The collective timeout(s) of process group ``group``, read back from torch: a ProcessGroup
    keeps one backend per device type (gloo for CPU tensors, NCCL or gloo for CUDA ones), each with
    its own ``options._timeout`` (what ``new_group(timeout=)`` set; torch 2.13's
    ``distributed_c10d._set_pg_timeout`` writes the same place)."""
    out = set()
    for device in group._device_types:
        with contextlib.suppress(RuntimeError):  # a device type without a backend of its own
            out.add(group._get_backend(device).options._timeout)
    return out


@contextlib.contextmanager
def groups_take_timeout(timeout: timedelta) -> Iterator[list[str]]:
    """Every process group created inside the block ends up with ``timeout``. Yields a list that,
    on exit, names (by ``group_desc``) the block's groups that were created with another timeout.

    Wraps ``initialize_model_parallel``: megatron-core 0.16.1 passes ``distributed_timeout_minutes``
    to every group it creates but one, ``EXPERT_DATA_PARALLEL_GROUP_GLOO`` (parallel_state.py: its
    ``create_group`` call has no ``timeout=``), which then takes torch's gloo default of 30 minutes
    whatever the job's timeout (the distributed optimizer's expert-state checkpoint gathers over it).
    Applied where the cause is: only a group whose timeout differs is changed, through torch's own
    ``_set_pg_timeout`` (tests/test_rollout.py reads every group back, and checks that megatron
    still leaves that one out)."""
    from torch.distributed import distributed_c10d as c10d

    before = set(c10d._world.pg_map)
    missed: list[str] = []
    yield missed
    for group in list(c10d._world.pg_map):
        if group not in before and group_timeouts(group) != {timeout}:
            missed.append(group.group_desc)
            c10d._set_pg_timeout(timeout, group)


if __name__ == "__main__":
    print(fix_tables(), end="")
