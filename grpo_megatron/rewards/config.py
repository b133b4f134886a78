"""Typed config of the rewards (the `reward:` section of a job YAML).

A reward is a weighted sum of named components, each a built-in (by name) or a user
function (by `module:function` path). Every component runs in the sandboxed worker pool
(see pool.py). This module imports nothing heavy: the CLI loads configs without torch.
"""

from dataclasses import dataclass, field
from typing import Any, Literal

# Names of the built-in reward functions (loader.py maps them to code). Kept here, and not
# in loader.py, so that validating a config does not import math-verify.
BUILTIN_REWARDS: tuple[str, ...] = (
    "math_accuracy",  # math-verify equivalence of \boxed{} / <answer> with the gold answer
    "format",  # <think>...</think><answer>...</answer>
    "length",  # capped reasoning-length bonus
    "countdown",  # numbers used exactly once, + - * / and parentheses, safe AST evaluation
    "gsm8k",  # last number (or "#### n") compared numerically with the gold answer
    "majority",  # self-consistency: agrees with the majority answer of its group
    "exact_match",  # the response up to its first end marker equals the label (procedural tasks)
)


@dataclass
class RewardComponentConfig:
    """One named term of the composite reward."""

    name: str = "accuracy"
    """Metric name: logged as `reward/<name>`."""
    function: str = "math_accuracy"
    """A built-in name (see BUILTIN_REWARDS) or `package.module:function` of a user function
    taking a RewardSample and returning a float (or a dict of named floats)."""
    weight: float = 1.0
    """Weight of this component in the total reward."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the function after the sample (e.g. {max_chars: 2000})."""

    def validate(self, prefix: str) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(
                f"{prefix}.name={self.name!r} must be a non-empty identifier (letters, digits, _ or -): "
                "it becomes the metric key reward/<name>"
            )
        if self.function not in BUILTIN_REWARDS:
            module, sep, attr = self.function.partition(":")
            if not sep or not module or not attr:
                raise ValueError(
                    f"{prefix}.function={self.function!r} is neither a built-in reward "
                    f"({', '.join(BUILTIN_REWARDS)}) nor a 'package.module:function' path"
                )


@dataclass
class RewardConfig:
    """Reward components and the sandbox they run in."""

    components: list[RewardComponentConfig] = field(default_factory=lambda: [RewardComponentConfig()])
    """Terms of the total reward = sum(weight * component). Default: math-verify accuracy."""
    num_workers: int = 2
    """Worker processes that run reward code. 0 runs rewards in the calling process with no
    timeout and no isolation (debugging only)."""
    timeout_s: float = 5.0
    """Per-sample time limit; a sample that exceeds it gets `fallback` and its worker is
    killed and replaced."""
    batch_timeout_s: float | None = None
    """Hard limit for one whole scoring call: samples not scored by then get `fallback`.
    None = no limit beyond the per-sample one (worst case ceil(N / num_workers) * timeout_s)."""
    replace_worker_on_error: bool = True
    """Also replace a worker after its reward code RAISED (its module state may be broken).
    Timed-out and dead workers are always replaced. False keeps it: cheaper when a reward
    raises often and its module is slow to import."""
    fallback: float = 0.0
    """Reward given to a sample whose reward code raised, timed out or returned a
    non-finite or non-number value (counted in metrics)."""
    max_response_chars: int = 200_000
    """Responses are cut to their LAST this-many characters (answers come at the end) before
    they are sent to a worker: a runaway output never crosses the pipe whole. The built-in
    rewards bound their own work further (they search for answers in a bounded tail and cap
    the length of an extracted answer before math-verify parses it)."""
    worker_memory_mb: int | None = None
    """Address-space limit (RLIMIT_AS) of each worker in MiB: a reward that allocates past it
    gets a MemoryError (-> fallback) instead of pushing the node into the OOM killer. None =
    no limit (keep it None if a reward imports CUDA libraries, which reserve huge address
    space). Workers always volunteer as the OOM killer's first victim (oom_score_adj)."""
    mp_context: Literal["forkserver", "spawn"] = "forkserver"
    """How workers are started. Both are safe after torch and threads exist (fork is not)."""

    def validate(self) -> None:
        p = "reward"
        if not self.components:
            raise ValueError(f"{p}.components is empty: name at least one reward (e.g. function: math_accuracy)")
        names = [c.name for c in self.components]
        reserved = {"mean", "std"} & set(names)
        if reserved:
            raise ValueError(
                f"{p}.components has reserved name(s) {sorted(reserved)}: they would collide with reward/mean "
                "and reward/std; rename the component"
            )
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{p}.components has duplicate names {dup}: each name must be unique")
        for i, comp in enumerate(self.components):
            comp.validate(f"{p}.components[{i}]")
        if self.num_workers < 0:
            raise ValueError(f"{p}.num_workers={self.num_workers} must be >= 0 (0 = in-process, no sandbox)")
        if self.timeout_s <= 0:
            raise ValueError(f"{p}.timeout_s={self.timeout_s} must be > 0 seconds")
        if self.batch_timeout_s is not None and self.batch_timeout_s <= 0:
            raise ValueError(f"{p}.batch_timeout_s={self.batch_timeout_s} must be > 0 seconds or null (no limit)")
        if self.fallback != self.fallback or self.fallback in (float("inf"), float("-inf")):
            raise ValueError(f"{p}.fallback={self.fallback} must be a finite number (e.g. 0.0)")
        if self.worker_memory_mb is not None and self.worker_memory_mb < 256:
            raise ValueError(
                f"{p}.worker_memory_mb={self.worker_memory_mb} must be >= 256 or null: a Python worker with "
                "math-verify needs a few hundred MiB of address space"
            )
        if self.max_response_chars < 1:
            raise ValueError(f"{p}.max_response_chars={self.max_response_chars} must be >= 1")
