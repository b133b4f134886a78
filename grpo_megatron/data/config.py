"""Data section of the job config: where prompts, reference answers and SFT responses come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataConfig:
    """Prompt source: JSONL / Parquet files, or a procedural generator (exactly one of them for training)."""

    train_path: str | None = None
    """Training prompts: a .jsonl or .parquet file, or a directory of them (read in name order); a
    relative path in a YAML file resolves against that file's directory."""
    eval_path: str | None = None
    """Held-out prompts scored during training (same formats). When set it is the eval set even with
    a generator; None = the generator's held-out split, or no evaluation with train_path."""
    tokenizer_path: str | None = None
    """Directory with the tokenizer files (tokenizer.json, tokenizer_config.json); None = model.hf_path.
    Read from local files only: build one offline with tools/build_char_tokenizer.py."""
    prompt_key: str = "prompt"
    """Field (JSONL key or Parquet column) holding the prompt text."""
    answer_key: str | None = "answer"
    """Field holding the reference answer the reward compares against (a string or a number);
    None = the data has no answers (label-free rewards such as majority vote)."""
    response_key: str = "response"
    """Field holding the gold response of a row, read by SFT (`grpo-megatron sft`) only."""
    template: str | None = None
    """Python format string wrapping each prompt, with a {prompt} placeholder, e.g. "Q: {prompt}\\nA:"
    (write literal braces as {{ and }}); None = the prompt as is. With chat_template it formats the
    user message."""
    chat_template: bool = False
    """Wrap each prompt as a user message in the tokenizer's chat template
    (`apply_chat_template(..., add_generation_prompt=True)`); the tokenizer must have one."""
    system_prompt: str | None = None
    """System message put before the user message; only with chat_template."""
    generator: str | None = None
    """Name of a procedural task generator used instead of train_path: "arithmetic" (fixed-width
    addition, answer reversed) or "countdown" (reach a target with + - * /)."""
    generator_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the generator: arithmetic {digits: 3, reverse_answer: true,
    reverse_operands: false};
    countdown {num_numbers: 3, max_number: 20, max_target: 100}."""
    num_train_prompts: int | None = None
    """Generator: number of training problems generated (None = 50000). Files: use only the first
    this-many rows (None = all)."""
    num_eval_prompts: int | None = None
    """Generator: number of held-out problems, disjoint from the training ones (None = 200, 0 = none).
    Files: use only the first this-many rows of eval_path (None = all)."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this many tokens (after the template, special tokens included) are dropped
    and counted."""
    skip_malformed: bool = False
    """Skip rows that are not valid (bad JSON, a missing field, a wrong type) and count them, instead of
    stopping at the first one with its file and line."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by train.seed)."""

    def validate(self) -> None:
        errors = []
        if self.train_path is not None and self.generator is not None:
            errors.append(
                f"data.train_path={self.train_path!r} and data.generator={self.generator!r} are both set: "
                "keep one prompt source and set the other to null"
            )
        if self.template is not None:
            if "{prompt}" not in self.template:
                errors.append(
                    f"data.template={self.template!r} has no {{prompt}} placeholder: "
                    "add one, or set it to null"
                )
            else:
                try:
                    self.template.format(prompt="")
                except (KeyError, IndexError, ValueError) as err:
                    errors.append(
                        f"data.template={self.template!r} is not a valid format string with only {{prompt}} "
                        f"({type(err).__name__}: {err}): write literal braces as {{{{ and }}}}"
                    )
        if self.system_prompt is not None and not self.chat_template:
            errors.append(
                "data.system_prompt is set but data.chat_template is false: a system message needs the "
                "chat template; set data.chat_template=true or data.system_prompt=null"
            )
        for name in ("prompt_key", "answer_key", "response_key"):
            value = getattr(self, name)
            if value is not None and not value:
                errors.append(f"data.{name} is empty: name the field of each row that holds it")
        keys = [k for k in (self.prompt_key, self.answer_key, self.response_key) if k]
        if len(set(keys)) != len(keys):
            errors.append(
                f"data.prompt_key={self.prompt_key!r}, data.answer_key={self.answer_key!r} and "
                f"data.response_key={self.response_key!r} must name different fields"
            )
        if self.generator is not None:
            # Pure Python: validating a config still imports no torch or transformers.
            from grpo_megatron.data.generators import generator_kwargs_errors

            errors.extend(generator_kwargs_errors(self.generator, self.generator_kwargs))
        if self.num_train_prompts is not None and self.num_train_prompts < 1:
            errors.append(
                f"data.num_train_prompts={self.num_train_prompts} must be >= 1 or null (all / default)"
            )
        if self.num_eval_prompts is not None and self.num_eval_prompts < 0:
            errors.append(
                f"data.num_eval_prompts={self.num_eval_prompts} must be >= 0 or null (all / default)"
            )
        if self.max_prompt_tokens < 1:
            errors.append(f"data.max_prompt_tokens={self.max_prompt_tokens} must be >= 1")
        if errors:
            raise ValueError("\n".join(errors))
