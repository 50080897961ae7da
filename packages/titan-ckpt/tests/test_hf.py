"""Hugging Face export at the last save and import at the first load, through an adapter
defined here (renames keys like a model package's adapter would)."""

from __future__ import annotations

import json

import pytest
import torch

from titan_ckpt import CheckpointConfig, CheckpointConfigError, CheckpointManager, StateDictAdapter

safetensors_torch = pytest.importorskip("safetensors.torch")


class RenamingAdapter:
    """Native "0.weight" <-> HF "model.layers.0.weight"."""

    def to_hf(self, state_dict):
        return {f"model.layers.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict):
        return {k.removeprefix("model.layers."): v for k, v in hf_state_dict.items()}

    def hf_config(self):
        return {"architectures": ["TinyMLP"], "hidden_size": 32}


def test_adapter_satisfies_the_protocol_structurally():
    assert isinstance(RenamingAdapter(), StateDictAdapter)


def test_last_save_in_hf_then_initial_load_in_hf(common, tmp_path):
    model = common.make_model()
    config = CheckpointConfig(
        enable=True, folder=str(tmp_path / "run"), last_save_in_hf=True, export_dtype="bfloat16"
    )
    manager = CheckpointManager(config, model_parts=model, state_dict_adapter=RenamingAdapter())
    manager.save(9, last_step=True)
    manager.close()

    hf_dir = tmp_path / "run" / "step-9" / "hf"
    assert json.loads((hf_dir / "config.json").read_text())["hidden_size"] == 32
    tensors = safetensors_torch.load_file(str(hf_dir / "model.safetensors"))
    assert set(tensors) == {f"model.layers.{k}" for k in model.state_dict()}
    for k, v in model.state_dict().items():
        assert torch.equal(tensors[f"model.layers.{k}"], v.to(torch.bfloat16))

    fresh = common.make_model(seed=4)
    loader = CheckpointManager(
        CheckpointConfig(
            enable=True,
            folder=str(tmp_path / "finetune"),
            initial_load_path=str(hf_dir),
            initial_load_in_hf=True,
        ),
        model_parts=fresh,
        state_dict_adapter=RenamingAdapter(),
    )
    assert loader.load()
    for k, v in fresh.state_dict().items():
        assert v.dtype == torch.float32
        assert torch.equal(v, model.state_dict()[k].to(torch.bfloat16).float())


def test_hf_without_adapter_is_refused(common, tmp_path):
    config = CheckpointConfig(enable=True, folder=str(tmp_path), last_save_in_hf=True)
    with pytest.raises(
        CheckpointConfigError, match="last_save_in_hf=true needs state_dict_adapter"
    ):
        CheckpointManager(config, model_parts=common.make_model())


def test_hf_folder_without_safetensors_is_refused(common, tmp_path):
    config = CheckpointConfig(
        enable=True,
        folder=str(tmp_path / "run"),
        initial_load_path=str(tmp_path),
        initial_load_in_hf=True,
    )
    manager = CheckpointManager(
        config, model_parts=common.make_model(), state_dict_adapter=RenamingAdapter()
    )
    with pytest.raises(FileNotFoundError, match=r"holds no \*.safetensors files"):
        manager.load()
