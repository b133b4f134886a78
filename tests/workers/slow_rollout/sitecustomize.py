"""Put first on ``PYTHONPATH`` by tests/test_preemption.py for a job launched through
launch/slurm/node.sh, where no test code can be passed to the ranks otherwise. Active only in a
trainer rank (``python -m ...`` with torchrun's ``RANK``) and with ``GRPO_TEST_SLOW_ROLLOUT=<seconds>``:
every decoding step of the embedded engine takes that much longer (a rollout then lasts long enough
for a signal to land inside it), and each ``generate`` call leaves ``generate-<rank>-<n>`` in
``$GRPO_TEST_MARKS`` as it starts. The engine's own code runs unchanged."""

from __future__ import annotations

import os
import sys

if os.environ.get("GRPO_TEST_SLOW_ROLLOUT") and os.environ.get("RANK") is not None and sys.argv[:1] == ["-m"]:
    import time
    from pathlib import Path
    from typing import Any

    from grpo_megatron.rollout import embedded

    _delay = float(os.environ["GRPO_TEST_SLOW_ROLLOUT"])
    _marks = Path(os.environ["GRPO_TEST_MARKS"])
    _sample, _generate = embedded.sample_next, embedded.EmbeddedEngine.generate
    _calls = [0]

    def _slow_sample(*args: Any, **kwargs: Any) -> Any:
        time.sleep(_delay)
        return _sample(*args, **kwargs)

    def _marked_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        _calls[0] += 1
        (_marks / f"generate-{os.environ['RANK']}-{_calls[0]}").touch()
        return _generate(self, *args, **kwargs)

    embedded.sample_next = _slow_sample  # type: ignore[assignment]
    embedded.EmbeddedEngine.generate = _marked_generate  # type: ignore[method-assign]
