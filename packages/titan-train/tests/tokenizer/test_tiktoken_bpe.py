"""TiktokenTokenizer and the shipped tokenizer: exact ids on fixed strings, round trips and
errors, checked against hand-written BPE files whose merges we know."""

from __future__ import annotations

import base64

import pytest

from titan_train.data import embedded_documents
from titan_train.tokenizer import (
    TiktokenTokenizer,
    Tokenizer,
    TokenizerError,
    llama3_special_tokens,
    load_tokenizer,
    read_tiktoken_bpe,
    write_tiktoken_bpe,
)


def _tiny_bpe(path):
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 256
    ranks[b"abc"] = 257
    ranks[b" a"] = 258
    write_tiktoken_bpe(ranks, path)
    return ranks


def test_file_format_is_base64_token_and_rank(tmp_path):
    path = tmp_path / "tokenizer.model"
    ranks = _tiny_bpe(path)
    lines = path.read_text().splitlines()
    assert lines[0] == "AA== 0"
    assert lines[256] == f"{base64.b64encode(b'ab').decode()} 256" == "YWI= 256"
    assert len(lines) == 259
    assert read_tiktoken_bpe(path) == ranks


def test_tiny_file_gives_expected_ids(tmp_path):
    path = tmp_path / "tokenizer.model"
    _tiny_bpe(path)
    tok = TiktokenTokenizer(path)  # Llama 3's 256 special tokens after the 259 ranks
    assert tok.vocab_size == 259 + 256
    assert (tok.bos_id, tok.eos_id) == (259, 260)
    assert tok.special_tokens["<|eot_id|>"] == 259 + 9
    assert tok.special_tokens["<|reserved_special_token_250|>"] == 259 + 255
    # tiktoken merges the lowest-ranked pair first: in " ab", "ab" (256) beats " a" (258),
    # and " " + "ab" is no token.
    assert tok.encode("abc ab") == [257, 32, 256]
    assert tok.encode(" ac") == [258, 99]
    assert tok.encode("abc", bos=True, eos=True) == [259, 257, 260]
    assert tok.decode([259, 257, 258, 98, 260]) == "<|begin_of_text|>abc ab<|end_of_text|>"


def test_llama3_special_token_layout():
    names = llama3_special_tokens()
    assert len(names) == 256
    assert names[:2] == ["<|begin_of_text|>", "<|end_of_text|>"]
    assert names[6:10] == [
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    assert names[10] == "<|reserved_special_token_5|>"
    assert names[-1] == "<|reserved_special_token_250|>"
    assert llama3_special_tokens(8)[-1] == "<|end_header_id|>"


def test_shipped_tokenizer_ids_on_a_fixed_string():
    tok = load_tokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 2048
    assert (tok.bos_id, tok.eos_id) == (2040, 2041)
    text = "Hello, world! The for statement iterates over a list."
    assert tok.encode(text, bos=True, eos=True) == [
        2040, 72, 101, 108, 322, 44, 1275, 1495, 33, 384, 341, 467, 735, 942, 837, 260, 534,
        46, 2041,
    ]  # fmt: skip
    assert load_tokenizer("embedded").encode(text) == tok.encode(text)


def test_shipped_tokenizer_round_trips_the_corpus_and_compresses_it():
    tok = load_tokenizer()
    docs = embedded_documents()
    ids = [tok.encode(d) for d in docs]
    assert [tok.decode(i) for i in ids] == docs
    n_bytes = sum(len(d.encode()) for d in docs)
    n_tokens = sum(map(len, ids))
    assert n_bytes / n_tokens > 3.5  # 2,040 ranks on its own training text: ~3.65 bytes/token
    assert max(max(i) for i in ids) < 2040  # ordinary text never yields a special id


def test_special_token_names_in_text_stay_text():
    tok = load_tokenizer()
    ids = tok.encode("<|end_of_text|>")
    assert tok.eos_id not in ids
    assert tok.decode(ids) == "<|end_of_text|>"


def test_round_trip_of_non_ascii_text():
    tok = load_tokenizer()
    text = "naïve café — 東京 🚀\n\tx = 1"
    assert tok.decode(tok.encode(text)) == text


def test_malformed_file_names_the_line(tmp_path):
    path = tmp_path / "bad.model"
    path.write_text("AA== 0\nnot-a-token-line\n")
    with pytest.raises(TokenizerError, match=r"bad.model:2 is not '<base64 token> <rank>'"):
        TiktokenTokenizer(path)


def test_rank_gap_is_rejected(tmp_path):
    path = tmp_path / "gap.model"
    path.write_text("AA== 0\nAQ== 2\n")
    with pytest.raises(TokenizerError, match=r"ranks must be 0..1"):
        read_tiktoken_bpe(path)


def test_missing_file_says_what_to_give(tmp_path):
    with pytest.raises(TokenizerError, match=r"does not exist; give a tiktoken BPE file"):
        load_tokenizer(tmp_path / "nope.model")
    with pytest.raises(TokenizerError, match=r"holds no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_folder_with_llama3_layout_loads_original_tokenizer_model(tmp_path):
    (tmp_path / "original").mkdir()
    _tiny_bpe(tmp_path / "original" / "tokenizer.model")
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.encode("abc") == [257]
