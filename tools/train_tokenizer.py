"""Regenerate titan-train's shipped tokenizer: byte-level BPE on the embedded corpus.

    python tools/train_tokenizer.py            # rewrite the shipped file
    python tools/train_tokenizer.py --check    # exit 1 if the shipped file is out of date

The result is deterministic (same Python documentation in, same file out): 2,040 ranks,
to which ``load_tokenizer()`` appends 8 Llama 3 special tokens, 2,048 ids in all. The
shipped file was trained on Python 3.11's ``pydoc_data``; other Python versions ship
slightly different documentation, so regenerate (and check) with Python 3.11.

The trainer (``train_bpe``) lives here, not in titan-train: it makes this one file, and a
user who trains a tokenizer of their own has Hugging Face ``tokenizers``' trainers.
Train a byte-level BPE vocabulary, written in tiktoken's format.

Text is split by the pre-tokenization regex into pieces; BPE repeatedly merges the most
frequent adjacent pair of tokens inside pieces. Pair counts are kept over *unique* pieces
weighted by how often each occurs, and updated only for the pieces that contain the merged
pair, so training 2,000 merges on a megabyte of text takes seconds in pure Python.
Ties between equally frequent pairs go to the smaller (left bytes, right bytes), so the
result depends on nothing but the text.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import regex

from titan_train.data import embedded_documents
from titan_train.tokenizer import (
    DEFAULT_NUM_SPECIAL_TOKENS,
    LLAMA3_PATTERN,
    TokenizerError,
    default_tokenizer_path,
    write_tiktoken_bpe,
)


def train_bpe(
    texts: Iterable[str], num_ranks: int, *, pattern: str = LLAMA3_PATTERN
) -> dict[bytes, int]:
    """Token bytes -> rank: the 256 single bytes, then up to ``num_ranks - 256`` merges.

    Fewer ranks come back when the text runs out of pairs. Pass the result to
    ``write_tiktoken_bpe``; special tokens are not ranks (``TiktokenTokenizer`` adds them).
    """
    if num_ranks < 256:
        raise TokenizerError(f"num_ranks={num_ranks} is too small; the 256 bytes need 256.")
    splitter = regex.compile(pattern)
    pieces: Counter[str] = Counter()
    for text in texts:
        pieces.update(splitter.findall(text))

    vocab = [bytes([b]) for b in range(256)]  # id -> bytes; id == rank
    ranks = {token: i for i, token in enumerate(vocab)}
    words = [list(piece.encode("utf-8")) for piece in pieces]
    freqs = list(pieces.values())
    pair_count: defaultdict[tuple[int, int], int] = defaultdict(int)
    pair_words: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for w, (word, freq) in enumerate(zip(words, freqs, strict=True)):
        for pair in itertools.pairwise(word):
            pair_count[pair] += freq
            pair_words[pair].add(w)

    # Max-heap by count with stale entries: an entry is live while its count is current.
    heap = [(-c, vocab[a], vocab[b], a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    while len(vocab) < num_ranks and heap:
        neg, _, _, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -neg:
            continue
        merged = vocab[a] + vocab[b]
        new_id = ranks.get(merged)
        if new_id is None:  # the same bytes may already exist, merged from another split
            new_id = ranks[merged] = len(vocab)
            vocab.append(merged)
        changed: set[tuple[int, int]] = set()
        for w in sorted(pair_words.pop((a, b))):
            word, freq = words[w], freqs[w]
            for pair in itertools.pairwise(word):
                pair_count[pair] -= freq
                changed.add(pair)
            out = _merge_pair(word, a, b, new_id)
            words[w] = out
            for pair in itertools.pairwise(word):
                pair_words[pair].discard(w)
            for pair in itertools.pairwise(out):
                pair_count[pair] += freq
                pair_words[pair].add(w)
                changed.add(pair)
        for pair in changed:
            count = pair_count[pair]
            if count > 0:
                heapq.heappush(heap, (-count, vocab[pair[0]], vocab[pair[1]], *pair))
            else:
                del pair_count[pair]
                pair_words.pop(pair, None)
    return ranks


def _merge_pair(word: list[int], a: int, b: int, new_id: int) -> list[int]:
    """``word`` with every non-overlapping ``a, b`` (left to right) replaced by ``new_id``."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


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
