"""Tokenizers from local files only, and a character-level tokenizer built offline.

The character tokenizer (a `tokenizers` WordLevel model over single characters, plus optional
multi-character words such as "<answer>") is what the demo's tiny model uses: no download, a
vocabulary of a few dozen tokens, and one token per character so the model sees every digit.
Special ids match the HF configs in examples/: pad 0, bos 1, eos 2 (then unk 3). Encoding with
special tokens prepends bos; decoding joins tokens with nothing in between.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "load_tokenizer",
    "tokenizer_files_problem",
    "vocabulary_mismatch",
    "build_char_tokenizer",
    "SPECIAL_TOKENS",
    "DEMO_CHARS",
    "DEMO_WORDS",
]

# (pad, bos, eos, unk): ids 0, 1, 2, 3 in this order.
SPECIAL_TOKENS: tuple[str, str, str, str] = ("<pad>", "<s>", "</s>", "<unk>")
# The demo vocabulary: arithmetic (digits, + =) and countdown (digits, + - * / ( ), "," ":" and the
# answer tags its reward reads), plus space.
DEMO_CHARS = "0123456789+-*/()= ,:"
DEMO_WORDS: tuple[str, ...] = ("<answer>", "</answer>")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_files_problem(directory: Path) -> str | None:
    """Why ``directory`` holds no tokenizer ``load_tokenizer`` could read, with the fix; None when
    it has tokenizer files (the CLI's start-up check and ``load_tokenizer`` share it)."""
    directory = directory.expanduser()
    hint = (
        "set data.tokenizer_path (or model.hf_path) to a directory with tokenizer.json and "
        "tokenizer_config.json, or build one offline with tools/build_char_tokenizer.py"
    )
    if not directory.is_dir():
        return f"tokenizer directory {directory} does not exist: {hint}"
    if not any((directory / name).is_file() for name in (*_TOKENIZER_FILES, "tokenizer.model", "vocab.json")):
        return f"{directory} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}): {hint}"
    return None


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer saved in directory `path` (local files only: nothing is downloaded).

    Raises FileNotFoundError naming the path and the fix when the directory or its tokenizer files
    are missing, and ValueError when only a slow (Python) tokenizer can be built from them.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory = Path(path).expanduser()
    problem = tokenizer_files_problem(directory)
    if problem:
        raise FileNotFoundError(problem)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load the tokenizer in {directory}: {err}") from err
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(
            f"the tokenizer in {directory} is a slow {type(tokenizer).__name__}: save a fast one "
            "(tokenizer.json), e.g. with AutoTokenizer.from_pretrained(...).save_pretrained(...)"
        )
    return tokenizer


def build_char_tokenizer(
    chars: str, out_dir: str | Path, words: Sequence[str] = ()
) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer saved in `out_dir` (save_pretrained) and returned.

    Ids: pad 0, bos 1, eos 2, unk 3, then each distinct character of `chars` in order, then each of
    `words` (multi-character tokens matched before splitting into characters, e.g. "<answer>").
    Characters outside the vocabulary encode as unk.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    distinct = list(dict.fromkeys(chars))
    if not distinct:
        raise ValueError("chars is empty: give the characters of the vocabulary, e.g. '0123456789+='")
    clashes = [w for w in (*distinct, *words) if w in SPECIAL_TOKENS]
    if clashes:
        raise ValueError(f"{clashes} are special tokens already ({', '.join(SPECIAL_TOKENS)}): remove them")
    bad_words = [w for w in words if len(w) < 2 or w in distinct]
    if bad_words or len(set(words)) != len(words):
        raise ValueError(
            f"words {list(words)} must be distinct multi-character strings: {bad_words or 'duplicates'}"
        )

    pad, bos, eos, unk = SPECIAL_TOKENS
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in distinct:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    # Every character (newlines included) becomes its own piece; the vocabulary maps it.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(w, normalized=False) for w in words])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk
    )
    _save_atomically(tokenizer, Path(out_dir).expanduser())
    return tokenizer


def _save_atomically(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """save_pretrained into a temporary sibling directory, then move each file into `out` with
    os.replace, so a reader never sees a half-written tokenizer file."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as tmp:
        tokenizer.save_pretrained(tmp)
        for item in sorted(Path(tmp).iterdir()):
            os.replace(item, out / item.name)


def vocabulary_mismatch(
    student: PreTrainedTokenizerFast, student_dir: str, teacher: PreTrainedTokenizerFast, teacher_dir: str
) -> str | None:
    """Why the teacher's tokenizer is not the student's (a token's id differs, or one has tokens the
    other lacks), naming both directories; None when they agree token for token. The teacher's
    logprob of a sampled token id is only the student's token's when both map ids alike."""
    s_vocab: dict[str, int] = student.get_vocab()
    t_vocab: dict[str, int] = teacher.get_vocab()
    if s_vocab == t_vocab:
        return None
    differ = sorted(tok for tok in s_vocab.keys() | t_vocab.keys() if s_vocab.get(tok) != t_vocab.get(tok))
    shown = ", ".join(
        f"{tok!r}: student {s_vocab.get(tok)}, teacher {t_vocab.get(tok)}" for tok in differ[:3]
    )
    return (
        f"the teacher's vocabulary ({len(t_vocab)} tokens, distill.teacher_path={teacher_dir}) is not the "
        f"student's ({len(s_vocab)} tokens, {student_dir}): {len(differ)} tokens differ ({shown}); "
        "on-policy distillation needs one tokenizer: choose a teacher of the student's family"
    )
