"""torchtitan's July 2025 debug TOML, unedited, in a torchtitan-shaped checkout built here
(``tt_checkout``): its tokenizer folder reads as torchtitan reads it (the special tokens of
``tokenizer_config.json`` appended to a vocabulary that lacks them), ``c4_test`` is the
checkout's ``tests/assets/c4_test``, and ``titan-train`` trains it with only
``--training.steps`` given."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_train.data import DataConfig, open_documents
from titan_train.tokenizer import HuggingFaceTokenizer, TokenizerError, load_tokenizer

_spec = importlib.util.spec_from_file_location(
    "tt_checkout", Path(__file__).with_name("tt_checkout.py")
)
assert _spec is not None
assert _spec.loader is not None
tt_checkout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt_checkout)


def test_tokenizer_config_tokens_are_appended(tmp_path):
    folder = tt_checkout.write_tokenizer(tmp_path / "tokenizer")
    tok = load_tokenizer(folder)
    # torchtitan's order: bos_token, eos_token (then added_tokens_decoder, already added).
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (2000, 1998, 1999)
    ids = tok.encode("hello world", bos=True, eos=True)
    assert ids[0] == 1998
    assert ids[-1] == 1999
    assert max(ids[1:-1]) < 1998
    # The appended names are special tokens: text naming one encodes to its id.
    assert tok.encode(f"a{tt_checkout.EOS}b").count(1999) == 1
    assert tok.decode(ids[1:-1]) == "hello world"


def test_tokens_named_in_the_config_keep_their_ids(tmp_path):
    folder = tt_checkout.write_tokenizer(tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["bos_token"] = "a"  # in the vocabulary: keeps its id, nothing is appended for it
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    assert tok.bos_id < 1998
    assert tok.eos_id == 1998
    assert tok.vocab_size == 2000


def test_missing_bos_says_how_to_name_it(tmp_path):
    folder = tt_checkout.write_tokenizer(tmp_path)
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError) as info:
        HuggingFaceTokenizer(folder / "tokenizer.json")
    message = str(info.value)
    assert "tokenizer_config.json" in message
    assert '"bos_token"' in message
    assert "pass bos_token" not in message  # no option of that name exists


def _texts(config: DataConfig, n: int = 3) -> list[str]:
    source = open_documents(config)
    return [text for _, text in zip(range(n), source.iter_from(0), strict=False)]


def test_c4_test_is_the_checkout_folder(tmp_path, monkeypatch):
    tt_checkout.write_c4_test(tmp_path / "tests" / "assets" / "c4_test", documents=3)
    rows = (tmp_path / "tests/assets/c4_test/data.json").read_text().splitlines()
    monkeypatch.chdir(tmp_path)
    got = _texts(DataConfig(dataset="c4_test"))
    assert got == [json.loads(row)["text"] for row in rows]


@pytest.mark.parametrize("name", ["c4_test", "c4", "json"])
def test_dataset_path_folder_of_json_files(tmp_path, name):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "one", "url": "u"}\n{"text": "two", "url": "u"}\n')
    (folder / "b.json").write_text('{"text": "three", "url": "u"}\n')
    config = DataConfig(dataset=name, dataset_path=os.fspath(folder))
    assert _texts(config, 5) == ["one", "two", "three"]


@pytest.mark.slow  # the debug model at its TOML's 8 x 2048 tokens: ~10-50 s a step on 2 cores
def test_debug_toml_trains_unedited(tmp_path):
    toml = tt_checkout.write_checkout(tmp_path)
    before = toml.read_bytes()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_train.cli",
            "--job.config_file",
            os.fspath(toml.relative_to(tmp_path)),
            "--training.steps",
            "1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert toml.read_bytes() == before
    records = [json.loads(line) for line in (tmp_path / "outputs/metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert not (tmp_path / "outputs" / "checkpoint").exists()  # enable_checkpoint = false
    assert all(0 < r["mfu_pct"] <= 100 for r in records)
    assert "torchtitan's c4_test" in done.stderr
