"""Build a character-level tokenizer offline: ``python tools/build_char_tokenizer.py [--out DIR]``.

Defaults to the demo vocabulary (digits, ``+-*/()=``, space, ``,`` ``:`` and the ``<answer>`` /
``</answer>`` tags of the countdown task) and writes ``examples/demo/`` (tokenizer.json,
tokenizer_config.json). Special ids: pad 0, bos 1, eos 2, unk 3, as in the example HF configs.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_megatron.data.tokenizer import DEMO_CHARS, DEMO_WORDS, build_char_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "examples" / "demo"), help="output directory")
    parser.add_argument("--chars", default=DEMO_CHARS, help="characters of the vocabulary, in id order")
    parser.add_argument(
        "--words", nargs="*", default=list(DEMO_WORDS), help="multi-character tokens after the characters"
    )
    args = parser.parse_args(argv)
    tokenizer = build_char_tokenizer(args.chars, args.out, words=args.words)
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    print(f"wrote {args.out}: {len(tokenizer)} tokens: {vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
