"""Prompt and SFT datasets from JSONL / Parquet files or a procedural generator.

Every rank builds the same lists from the same config and seed (no communication): the sampler then
picks the same indices everywhere. Steps, per split:

1. rows: from files (``prompt``, ``answer``, optional ``response``; every other field becomes
   metadata, and a ``metadata`` object is merged into it) or from a generator's problems;
   a malformed row raises DataError with its ``file:line`` (``file row i`` for Parquet, counted
   from 0), or is skipped and counted with ``data.skip_malformed``;
2. template: ``data.template`` (str.format with {prompt}), then optionally the tokenizer's chat
   template with ``add_generation_prompt=True``;
3. tokens: one batched call of the fast tokenizer; prompts over ``data.max_prompt_tokens`` are
   dropped and counted; a prompt (or SFT response) with the tokenizer's unk token is malformed
   (its characters are outside the vocabulary).

``load_prompt_datasets`` / ``load_sft_datasets`` also return the counts (``DataStats``);
``build_prompt_datasets`` / ``build_sft_dataset`` return the lists and log the counts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_megatron.data.config import DataConfig
from grpo_megatron.data.generators import DEFAULT_NUM_EVAL, DEFAULT_NUM_TRAIN, Problem, generate_splits
from grpo_megatron.data.readers import RowProblem, data_files, iter_rows
from grpo_megatron.data.records import DataError, DataStats, PromptRecord, SFTRecord

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "PromptDatasets",
    "SFTDatasets",
    "load_prompt_datasets",
    "build_prompt_datasets",
    "load_sft_datasets",
    "build_sft_dataset",
    "render_prompt",
]

logger = logging.getLogger(__name__)

_MAX_EXAMPLES = 3  # skipped rows quoted in DataStats.examples


@dataclass
class PromptDatasets:
    train: list[PromptRecord]
    eval: list[PromptRecord]
    train_stats: DataStats
    eval_stats: DataStats | None
    """None when there is no eval set."""


@dataclass
class SFTDatasets:
    train: list[SFTRecord]
    dev: list[PromptRecord]
    """Held-out prompts with answers, to measure accuracy during the cold start."""
    train_stats: DataStats
    dev_stats: DataStats | None


@dataclass(frozen=True)
class _Item:
    """One row before templating and tokenization."""

    where: str
    prompt: str
    answer: str
    metadata: dict[str, Any]
    response: str | None = None


# ----------------------------------------------------------------------------------------------------
# Public entry points


def _train_items(cfg: DataConfig, problems: list, *, sft: bool) -> tuple[Iterator[_Item], DataStats]:
    """Training rows from data.train_path, else the generator's training problems (gold solutions
    included for SFT), with their counts."""
    if cfg.train_path is not None:
        stats = DataStats(source=str(cfg.train_path))
        return _file_items(
            cfg, cfg.train_path, "data.train_path", cfg.num_train_prompts, stats, sft=sft
        ), stats
    stats = DataStats(source=f"generator {cfg.generator} ({'train, gold solutions' if sft else 'train'})")
    return _problem_items(problems, cfg.generator, "train", stats), stats


def load_prompt_datasets(cfg: DataConfig, tokenizer: PreTrainedTokenizerFast, seed: int) -> PromptDatasets:
    """(train, eval) prompt records with the counts of skipped and dropped rows."""
    train_problems, eval_problems = _generated(cfg, seed)
    items, train_stats = _train_items(cfg, train_problems, sft=False)
    train = _prompt_records(items, cfg, tokenizer, train_stats)
    _require_some(train, train_stats, _source_field(cfg), cfg.max_prompt_tokens)
    eval_records, eval_stats = _eval_records(cfg, tokenizer, eval_problems)
    return PromptDatasets(train, eval_records, train_stats, eval_stats)


def build_prompt_datasets(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerFast, seed: int
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train, eval) prompt records; eval may be []. Skipped and dropped rows are logged."""
    ds = load_prompt_datasets(cfg, tokenizer, seed)
    _log_stats(ds.train_stats, ds.eval_stats)
    return ds.train, ds.eval


def load_sft_datasets(cfg: DataConfig, tokenizer: PreTrainedTokenizerFast, seed: int) -> SFTDatasets:
    """(train pairs, dev prompts) with the counts of skipped and dropped rows."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            "the tokenizer has no eos token, but SFT responses must end with one: set eos_token in its "
            "tokenizer_config.json (data.tokenizer_path)"
        )
    train_problems, eval_problems = _generated(cfg, seed)
    items, train_stats = _train_items(cfg, train_problems, sft=True)
    train = _sft_records(items, cfg, tokenizer, int(eos), train_stats)
    _require_some(train, train_stats, _source_field(cfg), cfg.max_prompt_tokens)
    dev, dev_stats = _eval_records(cfg, tokenizer, eval_problems)
    return SFTDatasets(train, dev, train_stats, dev_stats)


def build_sft_dataset(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerFast, seed: int
) -> tuple[list[SFTRecord], list[PromptRecord]]:
    """(train pairs, dev prompts) for supervised cold start: rows with data.response_key, or the
    generator's gold solutions. Each response ends with the tokenizer's eos id."""
    ds = load_sft_datasets(cfg, tokenizer, seed)
    _log_stats(ds.train_stats, ds.dev_stats)
    return ds.train, ds.dev


def render_prompt(prompt: str, cfg: DataConfig, tokenizer: PreTrainedTokenizerFast) -> str:
    """The text the model sees: data.template applied, then the chat template if configured."""
    text = prompt
    if cfg.template is not None:
        try:
            text = cfg.template.format(prompt=prompt)
        except (KeyError, IndexError, ValueError) as err:
            raise DataError(
                f"data.template={cfg.template!r} cannot be formatted ({type(err).__name__}: {err}): "
                "use only {prompt} and write literal braces as {{ and }}"
            ) from err
    if cfg.chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "data.chat_template=true but the tokenizer has no chat template (chat_template in "
                "tokenizer_config.json or chat_template.jinja): set data.chat_template=false and use "
                "data.template, or use a tokenizer that has one"
            )
        messages = [{"role": "user", "content": text}]
        if cfg.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert isinstance(rendered, str)  # tokenize=False: the rendered text
        text = rendered
    return text


# ----------------------------------------------------------------------------------------------------
# Sources


def _generated(cfg: DataConfig, seed: int) -> tuple[list[Problem], list[Problem]]:
    if cfg.train_path is None and cfg.generator is None:
        raise DataError(
            "data.train_path and data.generator are both null: set data.train_path to a .jsonl/.parquet "
            "file, or data.generator to a procedural task (arithmetic, countdown)"
        )
    if cfg.generator is None:
        return [], []
    num_train = DEFAULT_NUM_TRAIN if cfg.num_train_prompts is None else cfg.num_train_prompts
    num_eval = DEFAULT_NUM_EVAL if cfg.num_eval_prompts is None else cfg.num_eval_prompts
    if cfg.eval_path is not None:
        num_eval = 0  # the eval file replaces the generator's held-out split
    return generate_splits(cfg.generator, cfg.generator_kwargs, seed, num_train, num_eval)


def _eval_records(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerFast, eval_problems: list[Problem]
) -> tuple[list[PromptRecord], DataStats | None]:
    if cfg.eval_path is not None:
        stats = DataStats(source=str(cfg.eval_path))
        items = _file_items(cfg, cfg.eval_path, "data.eval_path", cfg.num_eval_prompts, stats, sft=False)
        records = _prompt_records(items, cfg, tokenizer, stats)
        _require_some(records, stats, "data.eval_path", cfg.max_prompt_tokens)
        return records, stats
    if cfg.generator is not None and eval_problems:
        stats = DataStats(source=f"generator {cfg.generator} (held out)")
        return _prompt_records(
            _problem_items(eval_problems, cfg.generator, "eval", stats), cfg, tokenizer, stats
        ), stats
    return [], None


def _problem_items(
    problems: Sequence[Problem], name: str | None, split: str, stats: DataStats
) -> Iterator[_Item]:
    for i, p in enumerate(problems):
        stats.rows += 1
        yield _Item(f"generator {name} {split} problem {i}", p.prompt, p.answer, dict(p.metadata), p.solution)


def _file_items(
    cfg: DataConfig, path: str, field_name: str, limit: int | None, stats: DataStats, *, sft: bool
) -> Iterator[_Item]:
    """Items of every row of the file(s) at `path`, at most `limit` rows. For SFT rows the response is
    required and the answer optional; for prompt rows the answer is required (if answer_key is set)."""
    for file in data_files(path, field_name):
        for where, row in iter_rows(file):
            if limit is not None and stats.rows >= limit:
                return
            stats.rows += 1
            try:
                if isinstance(row, RowProblem):
                    raise _Malformed(row.reason)
                yield _row_item(where, row, cfg, sft=sft)
            except _Malformed as err:
                _malformed(where, str(err), cfg, stats)


class _Malformed(Exception):
    """A row problem, turned into a DataError or a skip by `_malformed`."""


def _malformed(where: str, reason: str, cfg: DataConfig, stats: DataStats) -> None:
    if not cfg.skip_malformed:
        raise DataError(f"{where}: {reason}: fix the row, or set data.skip_malformed=true to skip such rows")
    stats.malformed_skipped += 1
    if len(stats.examples) < _MAX_EXAMPLES:
        stats.examples.append(f"{where}: {reason}")


def _row_item(where: str, row: dict[str, Any], cfg: DataConfig, *, sft: bool) -> _Item:
    fields = ", ".join(map(repr, row)) or "none"
    prompt = _text_field(row, cfg.prompt_key, "data.prompt_key", fields, allow_numbers=False)
    if not prompt.strip():
        raise _Malformed(f"field {cfg.prompt_key!r} is empty")
    answer = ""
    if cfg.answer_key is not None and (not sft or cfg.answer_key in row):
        answer = _text_field(row, cfg.answer_key, "data.answer_key", fields, allow_numbers=True)
    response = (
        _text_field(row, cfg.response_key, "data.response_key", fields, allow_numbers=True) if sft else None
    )
    used = {cfg.prompt_key, cfg.answer_key, cfg.response_key}
    metadata = {k: v for k, v in row.items() if k not in used and k != "metadata"}
    nested = row.get("metadata")
    if isinstance(nested, dict):
        metadata.update(nested)
    elif nested is not None:
        metadata["metadata"] = nested
    return _Item(where, prompt, answer, metadata, response)


def _text_field(row: dict[str, Any], key: str, field_name: str, fields: str, *, allow_numbers: bool) -> str:
    if key not in row:
        raise _Malformed(f"no field {key!r} (fields: {fields}; {field_name} names it)")
    value = row[key]
    if isinstance(value, str):
        return value
    if allow_numbers and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    kind = "a string or a number" if allow_numbers else "a string"
    raise _Malformed(f"field {key!r} is {type(value).__name__} {value!r:.60}, but it must be {kind}")


# ----------------------------------------------------------------------------------------------------
# Templates and tokens


def _encode(
    texts: list[str], tokenizer: PreTrainedTokenizerFast, add_special_tokens: bool
) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]


def _tokenized_prompts(
    items: Iterator[_Item], cfg: DataConfig, tokenizer: PreTrainedTokenizerFast, stats: DataStats
) -> list[tuple[_Item, str, list[int]]]:
    """(item, rendered prompt, ids) of each item whose prompt is in the vocabulary and short enough."""
    materialized = list(items)
    texts = [render_prompt(it.prompt, cfg, tokenizer) for it in materialized]
    # A chat template writes its own special tokens (bos included); a plain prompt gets the
    # tokenizer's usual ones, as at inference.
    ids = _encode(texts, tokenizer, add_special_tokens=not cfg.chat_template)
    unk = tokenizer.unk_token_id
    kept = []
    for it, text, prompt_ids in zip(materialized, texts, ids, strict=True):
        if unk is not None and unk in prompt_ids:
            _malformed(
                it.where, f"prompt {text!r:.80} has characters outside the tokenizer's vocabulary", cfg, stats
            )
        elif len(prompt_ids) > cfg.max_prompt_tokens:
            stats.too_long_dropped += 1
        else:
            kept.append((it, text, prompt_ids))
    return kept


def _prompt_records(
    items: Iterator[_Item], cfg: DataConfig, tokenizer: PreTrainedTokenizerFast, stats: DataStats
) -> list[PromptRecord]:
    return [
        PromptRecord(prompt=text, answer=it.answer, metadata=it.metadata, prompt_ids=tuple(ids))
        for it, text, ids in _tokenized_prompts(items, cfg, tokenizer, stats)
    ]


def _sft_records(
    items: Iterator[_Item], cfg: DataConfig, tokenizer: PreTrainedTokenizerFast, eos: int, stats: DataStats
) -> list[SFTRecord]:
    kept = _tokenized_prompts(items, cfg, tokenizer, stats)
    responses = _encode([it.response or "" for it, _, _ in kept], tokenizer, add_special_tokens=False)
    unk = tokenizer.unk_token_id
    out = []
    for (it, _, prompt_ids), response_ids in zip(kept, responses, strict=True):
        if not response_ids:
            _malformed(it.where, f"field {cfg.response_key!r} is empty", cfg, stats)
            continue
        if unk is not None and unk in response_ids:
            reason = f"response {it.response!r:.80} has characters outside the tokenizer's vocabulary"
            _malformed(it.where, reason, cfg, stats)
            continue
        if response_ids[-1] != eos:  # a response written with its eos text keeps a single eos
            response_ids = [*response_ids, eos]
        out.append(SFTRecord(prompt_ids=tuple(prompt_ids), response_ids=tuple(response_ids)))
    return out


def _source_field(cfg: DataConfig) -> str:
    return "data.train_path" if cfg.train_path is not None else "data.generator"


def _require_some(records: Sequence[object], stats: DataStats, field_name: str, max_tokens: int) -> None:
    if not records:
        raise DataError(
            f"{field_name}: no usable rows in {stats.source} ({stats.rows} read, {stats.malformed_skipped} "
            f"malformed skipped, {stats.too_long_dropped} over data.max_prompt_tokens={max_tokens} dropped)"
        )


def _log_stats(*all_stats: DataStats | None) -> None:
    for stats in all_stats:
        if stats is None:
            continue
        level = logging.WARNING if stats.malformed_skipped or stats.too_long_dropped else logging.INFO
        logger.log(level, "data: %s", stats.summary())
