"""rollout/sglang/compat.py: each fix applies where its cause is, and does what it says (each check in
a fresh interpreter, as the fixes change imported modules)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else {**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


@pytest.mark.launches
def test_torchvision_imports_beside_the_cpu_torch_and_transformers_models_load() -> None:
    """PyPI's torchvision (a CUDA build) cannot load its ops here; the .pth make setup writes arms the
    fix in every process, so torchvision and transformers' models import."""
    out = _run(
        """
        import torch, torchvision
        from transformers import Qwen3MoeForCausalLM
        from grpo_megatron.rollout.sglang import compat
        print(compat.applied(), torch.cuda.is_available())
        """
    )
    assert out == "['torchvision_missing_ops'] False"


@pytest.mark.launches
def test_a_config_type_transformers_has_may_be_registered_again() -> None:
    """SGLang 0.5.17 registers configs for types transformers >= 5.13 has (e.g. qwen3_asr): the
    fix lets the second registration through, and only for known types."""
    out = _run(
        """
        from transformers import AutoConfig, PretrainedConfig
        from transformers.models.qwen3_moe import Qwen3MoeConfig
        try:
            AutoConfig.register("qwen3_moe", Qwen3MoeConfig)
            before = "allowed"
        except ValueError:
            before = "refused"
        from grpo_megatron.rollout.sglang import compat
        fix = next(f for f in compat.FIXES if f.name == "transformers_config_reregistered")
        assert fix.needed()
        fix.apply()
        assert not fix.needed()  # applied once
        AutoConfig.register("qwen3_moe", Qwen3MoeConfig)
        class Fresh(PretrainedConfig):
            model_type = "grpo_megatron_fresh_type"
        AutoConfig.register("grpo_megatron_fresh_type", Fresh)
        print(before)
        """
    )
    assert out == "refused"


@pytest.mark.launches
def test_amx_packed_weights_take_an_update_as_a_fresh_load_packs_it() -> None:
    """SGLang's intel_amx path repacks weights after loading and cannot undo it: an update then meets
    the packed layout (a router of 4 experts transposed to fp32: the AssertionError seen on an AMX
    Xeon). With ``amx_packed_weights_reload`` the session's restore puts the loaded parameters back,
    the update loads into them, and packing again gives exactly what a fresh load of the new weights
    packs; a module packed already is not packed twice. Real SGLang layers and kernel packing, in a
    process that sees AMX (``GRPO_SGLANG_AMX=pretend``: packing runs on any CPU; no forward)."""
    out = _run(
        """
        import os, torch
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        os.environ["GRPO_SGLANG_AMX"] = "pretend"
        from grpo_megatron.rollout.sglang import compat
        compat.install()
        from sglang.srt.layers import amx_utils
        from sglang.srt.layers.linear import ReplicatedLinear
        from sglang.srt.model_loader.loader import DefaultModelLoader
        from sglang.srt.utils.common import cpu_has_amx_support

        def fresh(out_features, weight, bias):
            layer = ReplicatedLinear(128, out_features, bias=True, params_dtype=torch.bfloat16)
            layer.weight.weight_loader(layer.weight, weight)
            layer.bias.weight_loader(layer.bias, bias)
            layer.quant_method.process_weights_after_loading(layer)
            return layer

        torch.manual_seed(0)
        checks = []
        for out_features in (4, 32):  # fewer than 16 rows: transposed to fp32; else VNNI blocks
            w0, b0 = torch.randn(out_features, 128).bfloat16(), torch.randn(out_features).bfloat16()
            w1, b1 = torch.randn(out_features, 128).bfloat16(), torch.randn(out_features).bfloat16()
            layer = fresh(out_features, w0, b0)
            packed = layer.weight
            try:  # what SGLang does without the fix: the update meets the packed layout
                layer.weight.weight_loader(layer.weight, w1)
                unfixed = "loaded"
            except AssertionError:
                unfixed = "refused"
            if out_features == 32:  # same shape: it loaded, into the packed layout, silently wrong
                unfixed = "wrong" if not torch.equal(layer.weight, fresh(32, w1, b0).weight) else unfixed
                layer = fresh(out_features, w0, b0)
                packed = layer.weight
            layer.quant_method.process_weights_after_loading(layer)  # end_weight_update packs again
            twice = layer.weight is packed
            model = torch.nn.Sequential(layer)
            DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))  # begin
            restored = (tuple(layer.weight.shape), layer.weight.dtype, layer.use_intel_amx_backend)
            for name, value in (("weight", w1), ("bias", b1)):
                param = dict(model.named_parameters())[f"0.{name}"]
                param.weight_loader(param, value)
            DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))  # end
            again = fresh(out_features, w1, b1)
            checks.append((
                out_features, unfixed, twice, restored[0] == (out_features, 128) and restored[2] is False,
                torch.equal(layer.weight, again.weight) and layer.weight.dtype == again.weight.dtype,
                torch.equal(layer.bias, again.bias), layer.use_intel_amx_backend,
            ))
        print(cpu_has_amx_support(), "amx_packed_weights_reload" in compat.applied(), checks)
        """
    )
    assert out == (
        "True True [(4, 'refused', True, True, True, True, True), (32, 'wrong', True, True, True, True, True)]"
    )


@pytest.mark.launches
def test_where_compile_is_disabled_sglangs_compiled_functions_stay_plain() -> None:
    """compile_disabled_plain_functions: with TORCH_COMPILE_DISABLE=1, torch.compile gives a function
    back as it is (SGLang decorates some 40 as it loads; each wrapper built imports torch._inductor:
    about 2 s of every SGLang process's start), in both forms; a module still gets torch's wrapper;
    with compile on the fix does not apply."""
    code = """
        import sys
        import torch
        from grpo_megatron.rollout.sglang import compat
        fix = next(f for f in compat.FIXES if f.name == "compile_disabled_plain_functions")
        print(fix.needed())
        if fix.needed():
            fix.apply()
            def f(x):
                return x + 1
            module = torch.nn.Linear(2, 2)
            wrapped = torch.compile(module)
            print(torch.compile(f) is f, torch.compile(dynamic=True)(f) is f, wrapped is not module,
                  torch.equal(wrapped(torch.ones(2)), module(torch.ones(2))), fix.needed())
        """
    assert _run(code, {"TORCH_COMPILE_DISABLE": "1"}).split() == [
        "True",
        "True",
        "True",
        "True",
        "True",
        "False",
    ]
    assert _run(code, {"TORCH_COMPILE_DISABLE": "0"}) == "False"
