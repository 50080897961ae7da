"""``training.text_column`` and ``validation.text_column`` are real keys (an error used to
tell users to set ``training.text_column``, which the loader then rejected), and data errors
name the section the value came from."""

from __future__ import annotations

import json

import pytest

from titan_train.config import parse_job_config
from titan_train.data import DataError, build_dataloader
from titan_train.tokenizer import load_tokenizer
from titan_train.trainer.validation import ValidationConfig


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"body": f"Document {i} has its text in another column. " * 4} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_text_column_is_a_training_and_validation_key(corpus):
    config = parse_job_config(
        ["--training.dataset", corpus, "--training.text_column", "body",
         "--validation.text_column", "body"]
    )  # fmt: skip
    assert config.training.text_column == config.validation.text_column == "body"
    data = config.training.data_config(seq_len=16, local_batch_size=2, infinite=False)
    inputs, _ = next(iter(build_dataloader(data, load_tokenizer())))
    assert inputs.shape == (2, 16)


@pytest.mark.parametrize("section", ["training", "validation"])
def test_a_missing_column_names_the_sections_key(corpus, section):
    config = parse_job_config([f"--{section}.dataset", corpus])
    source = getattr(config, section)
    data = source.data_config(seq_len=16, local_batch_size=2, infinite=False)
    with pytest.raises(DataError, match=rf"no column 'text'.*Set {section}\.text_column to"):
        next(iter(build_dataloader(data, load_tokenizer())))


def test_validation_data_errors_name_the_validation_section():
    with pytest.raises(DataError, match=r"validation\.text_column='' is not allowed"):
        ValidationConfig(text_column="")
    config = ValidationConfig(dataset="/no/such/val.jsonl")
    data = config.data_config(seq_len=16, local_batch_size=2, infinite=False)
    with pytest.raises(DataError, match=r"validation\.dataset='/no/such/val\.jsonl': no such"):
        build_dataloader(data, load_tokenizer())
