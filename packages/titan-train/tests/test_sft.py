"""Supervised fine-tuning as a user runs it: the example config
(``examples/sft_chat_sample.toml``) trains offline with one command and its loss falls; chat
data that cannot train is refused before any work with one line (pipeline parallelism, a
template that does not mark assistant turns, a dataset without the named column)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titan_dims import ParallelismConfig
from titan_train import ConfigError, JobConfig, World, preflight
from titan_train.cli import main

EXAMPLE = Path(__file__).parents[1] / "examples" / "sft_chat_sample.toml"


def _chat_job(tmp_path: Path, **training) -> JobConfig:
    config = JobConfig()
    config.job.dump_folder = str(tmp_path / "out")
    config.model.tokenizer_path = "embedded_chat"
    config.training.dataset, config.training.dataset_format = "chat_sample", "chat"
    for key, value in training.items():
        setattr(config.training, key, value)
    return config


def test_chat_data_passes_preflight(tmp_path):
    preflight(_chat_job(tmp_path), World(rank=0, world_size=1, device=torch.device("cpu")))


def test_chat_data_with_pipeline_parallelism_is_refused(tmp_path):
    config = _chat_job(tmp_path)
    config.parallelism = ParallelismConfig(pipeline_parallel_degree=2)
    with pytest.raises(ConfigError, match=r"dataset_format='chat' cannot be trained with pipel"):
        preflight(config, World(rank=0, world_size=2, device=torch.device("cpu")))


def test_a_template_without_assistant_marks_exits_2_writing_nothing(tmp_path, capsys):
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    out = tmp_path / "out"
    args = ["train", "--job.config_file", str(EXAMPLE), "--job.dump_folder", str(out)]
    assert main([*args, "--training.chat_template", str(plain)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("does not mark assistant turns" in line for line in err)
    assert any(f"training.chat_template ({plain}) with train_on='assistant'" in x for x in err)
    assert not out.exists()


def test_a_dataset_without_the_column_exits_2(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"conversation": [{"role": "user", "content": "hi"}]}) + "\n")
    args = ["train", "--job.config_file", str(EXAMPLE), "--job.dump_folder", str(tmp_path / "o")]
    assert main([*args, "--training.dataset", str(data), "--training.data_shards", "1"]) == 2
    err = capsys.readouterr().err
    assert "row 0 of" in err
    assert "has no column 'messages'; its columns are ['conversation']" in err


@pytest.mark.slow
def test_the_example_config_trains_offline_and_the_loss_falls(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    args = ["train", "--job.config_file", str(EXAMPLE), "--job.dump_folder", str(out)]
    # Shorter than the example (60 steps of 8 x 256 tokens), to keep the suite quick.
    short = ["--training.steps", "8", "--training.seq_len", "128", "--metrics.log_freq", "1"]
    assert main([*args, *short, "--training.local_batch_size", "4"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 1.5, losses  # measured: 8.20 -> 4.62
    assert (out / "checkpoint" / "step-8").is_dir()  # the last step is saved
