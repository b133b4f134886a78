"""The job config: one typed dataclass per section, loaded from YAML plus `section.key=value` overrides.

    cfg = load_config("examples/tiny_moe.yaml", ["train.lr=1e-5", "model.hf_overrides.num_experts=8"])
    validate(cfg, world_size=4)          # every rule, before any process group exists
    cfg = cfg.resolve(world_size=4)      # parallel.dp / etp / sequence_parallel filled in

Each section's dataclass lives next to its component (grpo_megatron/<component>/config.py) and checks
its own fields in `validate()`; the rules that need two sections or the model's config.json live here
(`config/validation.py`); `JobConfig` is in `config/job.py`, the loader in `config/loader.py`.
Loading checks types (int, float, bool, str, Literal, Optional, list, dict, nested dataclasses) and
reports every problem at once, each with the dotted field, the file and line (or the override), the
value and the fix, in one `ConfigError`.

Standard library + PyYAML only: the CLI loads and checks configs without importing torch.
"""

from grpo_megatron.config.job import FILE_RELATIVE_PATHS, ConfigError, JobConfig
from grpo_megatron.config.loader import KeyPath, load_config, parse_override
from grpo_megatron.config.validation import (
    batch_layout_errors,
    model_layout_errors,
    output_dirs,
    overlong_errors,
    preflight_errors,
    validate,
)

__all__ = [
    "FILE_RELATIVE_PATHS",
    "ConfigError",
    "JobConfig",
    "KeyPath",
    "batch_layout_errors",
    "load_config",
    "model_layout_errors",
    "output_dirs",
    "overlong_errors",
    "parse_override",
    "preflight_errors",
    "validate",
]
