"""tools/train_tokenizer.py, which makes the shipped tokenizer: its train_bpe against a
brute-force BPE (recount every pair each merge) on fixed text, and the shipped file against a
fresh run."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections import Counter
from pathlib import Path

import pytest
import regex

from titan_train.tokenizer import LLAMA3_PATTERN, TiktokenTokenizer, write_tiktoken_bpe


def _load_tool():
    path = Path(__file__).parents[4] / "tools" / "train_tokenizer.py"
    spec = importlib.util.spec_from_file_location("train_tokenizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()
train_bpe = tool.train_bpe

TEXT = [
    "the cat sat on the mat; the cat ate the rat.",
    "aaaa aaa aa banana bandana 1234567 the theme thereof",
]


def _brute_force(texts, num_ranks):
    pieces = Counter(p for t in texts for p in regex.findall(LLAMA3_PATTERN, t))
    words = {tuple(bytes([b]) for b in p.encode()): c for p, c in pieces.items()}
    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < num_ranks:
        pairs = Counter()
        for w, c in words.items():
            for pair in itertools.pairwise(w):
                pairs[pair] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        ranks.setdefault(best[0] + best[1], len(ranks))
        merged = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + c
        words = merged
    return ranks


def test_matches_brute_force_bpe():
    assert train_bpe(TEXT, 300) == _brute_force(TEXT, 300)


def test_first_merges_are_the_most_frequent_pairs():
    ranks = train_bpe(TEXT, 259)
    # "th" and "he" both occur 7 times: the tie goes to the smaller bytes, "he"; then
    # "t"+"he" (7), then " "+"the" (6: four " the", " theme", " thereof").
    assert sorted(ranks, key=ranks.get)[256:] == [b"he", b"the", b" the"]


def test_stops_when_pairs_run_out(tmp_path):
    ranks = train_bpe(["ab ab"], 1000)
    assert sorted(ranks, key=ranks.get)[256:] == [b"ab", b" ab"]
    write_tiktoken_bpe(ranks, tmp_path / "t.model")
    tok = TiktokenTokenizer(tmp_path / "t.model")
    assert tok.encode("ab ab") == [256, 257]


@pytest.mark.skipif(
    sys.version_info[:2] != (3, 11),
    reason="the shipped file was trained on Python 3.11's pydoc_data; other versions differ",
)
def test_shipped_file_is_reproducible():
    assert tool.main(["--check"]) == 0
