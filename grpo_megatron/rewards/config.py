"""Typed config of the rewards (the `reward:` section of a job YAML).

A reward is a weighted sum of named components, each a built-in (by name) or a user
function (by `module:function` path). Every component is imported and run only in the worker
pool's sandboxed processes (pool.py, sandbox.py). This module imports nothing heavy: the CLI
loads configs without torch.
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
class RewardSandboxConfig:
    """What reward workers may do (sandbox.py applies it; start-up logs what is active)."""

    isolate: bool = True
    """Network and mount namespaces (no network, read-only file system except a scratch
    directory) and, when started as root, a uid of its own per worker. False keeps only the
    session, the scrubbed environment and the limits (e.g. a reward that calls a judge server)."""
    allow_network: bool = False
    """Keep the network (skip the network namespace) while isolating the rest."""
    max_processes: int | None = 1
    """RLIMIT_NPROC of a worker with a uid of its own, threads included: 1 = no subprocess and
    no thread. None = no limit."""
    max_file_mb: int | None = 64
    """Largest file a worker may write (RLIMIT_FSIZE), in MiB; a bigger write raises. None = no limit."""
    max_open_files: int | None = 256
    """RLIMIT_NOFILE of a worker. None = inherit the trainer's."""
    keep_env: list[str] = field(default_factory=list)
    """Environment variables passed to the workers beyond PATH, PYTHONPATH, LANG, LC_ALL and TZ
    (everything else, API keys included, is removed)."""
    scratch_dir: str | None = None
    """Where the per-worker writable scratch directories are made (removed at exit); None = the
    system's temporary directory."""

    def validate(self, p: str) -> None:
        for name in ("max_processes", "max_file_mb", "max_open_files"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{p}.{name}={value!r} must be an integer >= 1 or null (no limit)")
        if self.max_open_files is not None and self.max_open_files < 32:
            raise ValueError(
                f"{p}.max_open_files={self.max_open_files} must be >= 32: Python itself needs a few"
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
    """Hard limit for one whole scoring call of N samples: samples not scored by then get
    `fallback`. None = derived: timeout_s * (2 + ceil(N / num_workers) / 8), i.e. every worker
    may spend an eighth of timeout_s per sample on average, plus two full timeouts of slack
    (real rewards take milliseconds; without a bound, N hanging samples cost
    ceil(N / num_workers) * timeout_s)."""
    startup_timeout_s: float = 60.0
    """A worker must have set up its sandbox and imported every component within this many
    seconds; an import that hangs fails the start with the component's config field named."""
    max_error_frac: float = 0.5
    """The run stops with an error when more than this fraction of a scoring call's samples
    fall back (reward code raised, returned a non-number, timed out or killed its worker): a
    broken reward must not train silently on the fallback. 1.0 = never stop."""
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
    worker_memory_mb: int | None = 4096
    """Address-space limit (RLIMIT_AS) of each worker in MiB: a reward that allocates past it
    gets a MemoryError (-> fallback) instead of pushing the node into the OOM killer. None =
    no limit (needed if a reward imports CUDA libraries, which reserve huge address space).
    Workers always volunteer as the OOM killer's first victim (oom_score_adj)."""
    sandbox: RewardSandboxConfig = field(default_factory=RewardSandboxConfig)
    """Containment of reward code (namespaces, uid, limits, environment)."""
    mp_context: Literal["forkserver", "spawn"] = "forkserver"
    """How workers are started. Both are safe after torch and threads exist (fork is not)."""

    def validate(self) -> None:
        p = "reward"
        if not self.components:
            raise ValueError(
                f"{p}.components is empty: name at least one reward (e.g. function: math_accuracy)"
            )
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
            raise ValueError(
                f"{p}.batch_timeout_s={self.batch_timeout_s} must be > 0 seconds or null (no limit)"
            )
        if self.fallback != self.fallback or self.fallback in (float("inf"), float("-inf")):
            raise ValueError(f"{p}.fallback={self.fallback} must be a finite number (e.g. 0.0)")
        if self.worker_memory_mb is not None and self.worker_memory_mb < 256:
            raise ValueError(
                f"{p}.worker_memory_mb={self.worker_memory_mb} must be >= 256 or null: a Python worker with "
                "math-verify needs a few hundred MiB of address space"
            )
        if self.max_response_chars < 1:
            raise ValueError(f"{p}.max_response_chars={self.max_response_chars} must be >= 1")
        if not 0 < self.startup_timeout_s < float("inf"):  # also refuses NaN
            raise ValueError(
                f"{p}.startup_timeout_s={self.startup_timeout_s} must be a finite number of seconds > 0"
            )
        if not 0.0 <= self.max_error_frac <= 1.0:
            raise ValueError(
                f"{p}.max_error_frac={self.max_error_frac} must be in [0, 1] (1.0 = never stop on reward failures)"
            )
        self.sandbox.validate(f"{p}.sandbox")
