"""HuggingFaceTokenizer on a tokenizer.json built here with the ``tokenizers`` library:
exact ids from known merges, BOS/EOS from tokenizer_config.json or known names."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from titan_train.tokenizer import HuggingFaceTokenizer, TokenizerError, load_tokenizer

VOCAB = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4, "ab": 5, "abc": 6, "<bos>": 7, "<eos>": 8}


def _write(folder, config=None):
    tok = Tokenizer(models.BPE(vocab=VOCAB, merges=[("a", "b"), ("ab", "c")]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<bos>", "<eos>"])
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def test_expected_ids_and_known_bos_eos_names(tmp_path):
    tok = load_tokenizer(_write(tmp_path))
    assert isinstance(tok, HuggingFaceTokenizer)
    assert tok.vocab_size == 9
    assert (tok.bos_id, tok.eos_id) == (0, 1)  # "<s>" and "</s>"
    assert tok.encode("abc ab cab") == [6, 5, 4, 5]
    assert tok.encode("abc", bos=True, eos=True) == [0, 6, 1]
    assert tok.decode([6, 5]) == "abc ab"


def test_bos_eos_from_tokenizer_config(tmp_path):
    _write(tmp_path, {"bos_token": "<bos>", "eos_token": {"content": "<eos>"}})
    tok = load_tokenizer(tmp_path)  # a folder holding tokenizer.json
    assert (tok.bos_id, tok.eos_id) == (7, 8)
    assert tok.encode("ab", bos=True, eos=True) == [7, 5, 8]


def test_missing_bos_is_named(tmp_path):
    path = _write(tmp_path)
    with pytest.raises(TokenizerError, match=r"has no token '<|begin_of_text|>'"):
        HuggingFaceTokenizer(path, bos_token="<|begin_of_text|>")


def test_unreadable_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(TokenizerError, match=r"cannot read .* as a tokenizer.json"):
        load_tokenizer(path)
