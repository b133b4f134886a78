"""Every random number generator a rank draws from, as plain tensors and numbers.

Captured per rank at save time and restored on resume at the same layout, so a resumed run draws
the same numbers an uninterrupted one would (sampling, dropout, data order). The state holds only
tensors, ints, floats, strings, tuples, lists and dicts, so it loads with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU (+ CUDA) and megatron's model-parallel tracker states of this rank."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch_cpu": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch; nothing to capture then
        pass
    else:
        legacy = np.random.get_state(legacy=True)  # MT19937: (name, keys, pos, has_gauss, cached_gaussian)
        assert isinstance(legacy, tuple)
        name, keys, pos, has_gauss, cached_gaussian = legacy
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state`` (a state from the same rank of the same layout)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch_cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "numpy" in state:
        import numpy as np

        np_state = state["numpy"]
        np.random.set_state(
            (
                np_state["name"],
                np_state["keys"].numpy().astype(np.uint32),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached_gaussian"],
            )
        )
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])
