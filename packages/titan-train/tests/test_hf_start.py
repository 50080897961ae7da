"""preflight's check of a Hugging Face folder to start from (``checkpoint.initial_load_in_hf``,
``titan_train.trainer.hf_start``), in one process, with Llama 3 (registered by the installed
titan-models) and folders that transformers writes from a config (no download): a folder of
the run's model passes, a padded vocabulary included; one of another shape stops with one
``CheckpointConfigError`` naming the folder and what differs, and nothing is written. (A
folder of another architecture, and the Qwen3 user path end to end:
integration_tests/test_qwen3.py.)"""

from __future__ import annotations

import pytest
import torch

from titan_ckpt import CheckpointConfigError
from titan_train import JobConfig, World, preflight
from titan_train.trainer.hf_start import run_vocab_size

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# titan's Llama 3 debugmodel with the shipped tokenizer's 2,048 tokens, as a Hugging Face config.
DEBUGMODEL = {
    "vocab_size": 2048, "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 16,
    "num_key_value_heads": 16, "intermediate_size": 768, "rope_theta": 500000.0,
}  # fmt: skip


def hf_folder(path, **fields):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**DEBUGMODEL, **fields})
    transformers.LlamaForCausalLM(config).save_pretrained(str(path))
    return path


def job(tmp_path, hf) -> JobConfig:
    config = JobConfig()
    config.job.dump_folder = str(tmp_path / "out")
    config.checkpoint.enable = True
    config.checkpoint.initial_load_path = str(hf)
    config.checkpoint.initial_load_in_hf = True
    return config


def world() -> World:
    return World(rank=0, world_size=1, device=torch.device("cpu"))


def test_a_folder_of_the_runs_model_passes(tmp_path):
    preflight(job(tmp_path, hf_folder(tmp_path / "hf")), world())
    assert not (tmp_path / "out").exists()


def test_a_folder_of_another_shape_is_refused_naming_the_fields(tmp_path):
    hf = hf_folder(tmp_path / "hf", hidden_size=128, num_hidden_layers=2)
    with pytest.raises(CheckpointConfigError) as raised:
        preflight(job(tmp_path, hf), world())
    message = str(raised.value)
    assert message.startswith(f"checkpoint.initial_load_path={str(hf)!r}")
    assert "--model.name llama3 --model.flavor debugmodel" in message
    for field in ("hidden_size", "num_hidden_layers"):
        assert field in message, message
    assert not (tmp_path / "out").exists()


def test_a_padded_vocabulary_is_the_runs_and_a_smaller_one_is_refused(tmp_path):
    """Published weights often pad the embedding beyond the tokenizer (Qwen3: 151,936 rows
    for 151,669 tokens): the run builds the folder's rows; fewer rows than tokens cannot
    work."""
    padded = job(tmp_path, hf_folder(tmp_path / "padded", vocab_size=2112))
    preflight(padded, world())
    assert run_vocab_size(padded, 2048) == 2112
    assert run_vocab_size(JobConfig(), 2048) == 2048  # not starting from HF: the tokenizer's
    small = hf_folder(tmp_path / "small", vocab_size=1024)
    with pytest.raises(CheckpointConfigError, match=r"vocab_size=1024 .* tokenizer's 2048"):
        preflight(job(tmp_path, small), world())


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(CheckpointConfigError, match="does not exist"):
        preflight(job(tmp_path, tmp_path / "nowhere"), world())
