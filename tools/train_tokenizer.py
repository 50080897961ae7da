"""Regenerate titan-train's shipped tokenizer: byte-level BPE on the embedded corpus.

    python tools/train_tokenizer.py            # rewrite the shipped file
    python tools/train_tokenizer.py --check    # exit 1 if the shipped file is out of date

The result is deterministic (same Python documentation in, same file out): 2,040 ranks,
to which ``load_tokenizer()`` appends 8 Llama 3 special tokens, 2,048 ids in all. The
shipped file was trained on Python 3.11's ``pydoc_data``; other Python versions ship
slightly different documentation, so regenerate (and check) with Python 3.11.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from titan_train.data import embedded_documents
from titan_train.tokenizer import (
    DEFAULT_NUM_SPECIAL_TOKENS,
    default_tokenizer_path,
    train_bpe,
    write_tiktoken_bpe,
)


def main(argv: list[str] | None = None) -> int:
    """Train, then write (or with ``--check`` compare) the tokenizer file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=2048, help="ids incl. special tokens")
    parser.add_argument("--output", type=Path, default=default_tokenizer_path())
    parser.add_argument("--check", action="store_true", help="compare with --output, write nothing")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    ranks = train_bpe(embedded_documents(), args.vocab_size - DEFAULT_NUM_SPECIAL_TOKENS)
    seconds = time.perf_counter() - started
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = Path(tmp) / "tokenizer.model"
            write_tiktoken_bpe(ranks, fresh)
            same = args.output.is_file() and fresh.read_bytes() == args.output.read_bytes()
        print(f"{args.output}: {'up to date' if same else 'OUT OF DATE'} ({seconds:.1f} s)")
        return 0 if same else 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_tiktoken_bpe(ranks, args.output)
    print(f"wrote {args.output}: {len(ranks)} ranks in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
