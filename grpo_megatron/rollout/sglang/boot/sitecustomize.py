"""Run at the start of every process an SGLang engine spawns (``compat.child_environment`` puts this
folder first on PYTHONPATH while the engine starts): arms ``rollout/sglang/compat.py``'s fixes there
too (and, in tests only, ``GRPO_ENGINE_FAULT``'s hang: ``rollout/faults.py:arm_hang``). Both files are
loaded by their paths, so nothing else of grpo_megatron is imported into SGLang's processes. (A
sitecustomize of the user's own further down PYTHONPATH is not run in those processes.)"""

import importlib.util
import os
import sys

_sglang = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _name, _path in (
    ("grpo_megatron_sglang_compat", os.path.join(_sglang, "compat.py")),
    ("grpo_megatron_engine_faults", os.path.join(os.path.dirname(_sglang), "faults.py")),
):
    _spec = importlib.util.spec_from_file_location(_name, _path)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[_spec.name] = _module
        _spec.loader.exec_module(_module)
        if _name == "grpo_megatron_sglang_compat":
            _module.install()
        else:
            _module.arm_hang()  # tests only: GRPO_ENGINE_FAULT's hang:N
