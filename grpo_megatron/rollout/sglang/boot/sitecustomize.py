"""Run at the start of every process an SGLang engine spawns (``compat.child_environment`` puts this
folder first on PYTHONPATH while the engine starts): arms ``rollout/sglang/compat.py``'s fixes there
too (and, in tests only, ``GRPO_ENGINE_FAULT``'s hang: ``arm_hang_fault``). compat.py is loaded by its
path, so nothing else of grpo_megatron is imported into SGLang's processes. (A sitecustomize of the
user's own further down PYTHONPATH is not run in those processes.)"""

import importlib.util
import os
import sys

_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat.py")
_spec = importlib.util.spec_from_file_location("grpo_megatron_sglang_compat", _path)
if _spec is not None and _spec.loader is not None:
    _compat = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _compat
    _spec.loader.exec_module(_compat)
    _compat.install()
    _compat.arm_hang_fault()  # tests only: GRPO_ENGINE_FAULT's hang:N (compat.py)
