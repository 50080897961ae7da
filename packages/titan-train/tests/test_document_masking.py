"""``training.document_masking``: a run on packed short documents trains with attention
kept inside each document (the titan_models reference is in its tests), in training and
validation; context parallel with masking is refused in preflight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_dims import ParallelismConfig
from titan_models import ModelConfigError
from titan_train import ConfigError, JobConfig, World, preflight
from titan_train.config import TrainingConfig
from titan_train.data.embedded import embedded_documents


def _short_documents(path: Path) -> Path:
    """The embedded corpus's paragraphs as JSON lines: many documents per 128-token window."""
    paragraphs = [p.strip() for doc in embedded_documents() for p in doc.split("\n\n")]
    with path.open("w") as f:
        for text in (p for p in paragraphs if 20 < len(p) < 300):
            f.write(json.dumps({"text": text}) + "\n")
    return path


def _train(tmp_path: Path, data: Path, *args: str) -> dict[str, list[float]]:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "titan_train.cli", "train", "--job.dump_folder", str(out)]
    command += ["--training.dataset", str(data), "--validation.dataset", str(data)]
    sizes = {"training.steps": 8, "training.seq_len": 128, "training.local_batch_size": 4}
    sizes |= {"validation.freq": 8, "validation.steps": 1, "validation.seq_len": 128}
    sizes |= {"validation.local_batch_size": 2, "metrics.log_freq": 1}
    command += [item for key, value in sizes.items() for item in (f"--{key}", str(value))]
    # A narrow 2-block model: the proof is the masked attention, not the model's size.
    command += ["--model.args.dim", "64", "--model.args.n_layers", "2", "--model.args.n_heads", "4"]
    command += ["--optimizer.lr", "1e-2", "--checkpoint.no-enable", "--validation.enable", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return {key: [r[key] for r in records if key in r] for key in ("loss", "validation/loss")}


@pytest.mark.slow
def test_a_run_with_document_masking_trains(tmp_path):
    data = _short_documents(tmp_path / "docs.jsonl")
    masked = _train(tmp_path / "masked", data, "--training.document_masking")
    plain = _train(tmp_path / "plain", data)
    assert len(masked["loss"]) == 8
    assert masked["loss"][-1] < masked["loss"][0] - 0.3
    # The same data and weights: only the attention differs, in training and validation.
    assert not torch.allclose(torch.tensor(masked["loss"]), torch.tensor(plain["loss"]), atol=1e-3)
    assert len(masked["validation/loss"]) == 1
    assert abs(masked["validation/loss"][0] - plain["validation/loss"][0]) > 1e-3


def test_context_parallel_with_document_masking_is_refused_in_preflight(tmp_path):
    config = JobConfig(
        parallelism=ParallelismConfig(data_parallel_shard_degree=1, context_parallel_degree=2)
    )
    config.job.dump_folder = str(tmp_path / "out")
    config.training.seq_len = 64
    config.training.document_masking = True
    with pytest.raises(ModelConfigError, match="document masking cannot be combined with cont"):
        preflight(config, World(rank=0, world_size=2, device=torch.device("cpu")))
    assert not (tmp_path / "out").exists()
    config.training.document_masking = False
    preflight(config, World(rank=0, world_size=2, device=torch.device("cpu")))


def test_document_positions_must_be_restart_or_continue():
    with pytest.raises(ConfigError, match="'restart' or 'continue'"):
        TrainingConfig(document_positions="reset")
