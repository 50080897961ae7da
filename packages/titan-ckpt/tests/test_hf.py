"""Hugging Face export at the last save and import at the first load in one process: through
an adapter defined here with whole dicts only (renames keys like a model package's adapter
would; titan-ckpt's fallback path), and through the streaming renaming adapter of
workers/common.py into sharded files on an fsspec URL. A folder that does not fit the model
is refused before any tensor is read. (Two FSDP2 ranks: test_hf_sharded.py.)"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from titan_ckpt import CheckpointConfig, CheckpointConfigError, CheckpointManager, StateDictAdapter
from titan_ckpt.errors import CheckpointReadError

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


def test_truncated_hf_folder_is_reported_by_file_and_key(common, tmp_path):
    model = common.make_model()
    config = CheckpointConfig(enable=True, folder=str(tmp_path / "run"), last_save_in_hf=True)
    manager = CheckpointManager(config, model_parts=model, state_dict_adapter=RenamingAdapter())
    manager.save(9, last_step=True)
    manager.close()
    weights = tmp_path / "run" / "step-9" / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])  # the last tensor loses 8 bytes

    loader = CheckpointManager(
        CheckpointConfig(
            enable=True,
            folder=str(tmp_path / "finetune"),
            initial_load_path=str(weights.parent),
            initial_load_in_hf=True,
        ),
        model_parts=common.make_model(seed=4),
        state_dict_adapter=RenamingAdapter(),
    )
    # The header's byte range of the last tensor no longer fits: refused before reading.
    with pytest.raises(CheckpointReadError, match=r"model\.safetensors: tensor .*truncated"):
        loader.load()


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
    with pytest.raises(CheckpointConfigError, match=r"holds no \*.safetensors files"):
        manager.load()


def test_sharded_export_and_import_through_an_fsspec_url(common, tmp_path):
    pytest.importorskip("fsspec")
    url = f"file://{tmp_path}/run"
    model = common.make_model()
    adapter = common.StreamingRenamingAdapter()
    config = CheckpointConfig(enable=True, folder=url, last_save_in_hf=True, hf_max_shard_size=4096)
    manager = CheckpointManager(config, model_parts=model, state_dict_adapter=adapter)
    manager.save(2, last_step=True)
    manager.close()
    hf_dir = tmp_path / "run" / "step-2" / "hf"
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in hf_dir.iterdir()) == sorted(
        [*files, "config.json", "model.safetensors.index.json"]
    )

    fresh = common.make_model(seed=4)
    loader = CheckpointManager(
        CheckpointConfig(enable=True, folder=f"file://{tmp_path}/fresh",
                         initial_load_path=f"file://{hf_dir}", initial_load_in_hf=True),
        model_parts=fresh,
        state_dict_adapter=adapter,
    )  # fmt: skip
    assert loader.load()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def mlp(*sizes: int) -> torch.nn.Sequential:
    """Linear layers between ``sizes`` with ReLUs between them (keys 0, 2, 4, ...)."""
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers += [torch.nn.ReLU()] if i else []
        layers.append(torch.nn.Linear(a, b))
    return torch.nn.Sequential(*layers)


@pytest.mark.parametrize(
    ("other", "error", "message"),
    [
        (mlp(16, 8, 32, 4), CheckpointConfigError,
         r"does not fit the model: 0.weight: \[32, 16\] in the checkpoint, \[8, 16\] in the"),
        (mlp(16, 32, 32, 4, 4), CheckpointConfigError,
         r"lacks model keys \['6.weight', '6.bias'\]"),
        (mlp(16, 32), CheckpointConfigError,
         r"keys no model part owns .*\['2.bias', '2.weight', '4.bias'"),
    ],
)  # fmt: skip
def test_hf_folder_that_does_not_fit_is_refused_before_loading(
    common, tmp_path, other, error, message
):
    adapter = common.StreamingRenamingAdapter()
    config = CheckpointConfig(enable=True, folder=str(tmp_path / "run"), last_save_in_hf=True)
    manager = CheckpointManager(config, model_parts=common.make_model(), state_dict_adapter=adapter)
    manager.save(1, last_step=True)
    manager.close()
    target = other
    before = {k: v.clone() for k, v in target.state_dict().items()}
    loader = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path / "fresh"),
                         initial_load_path=str(tmp_path / "run" / "step-1" / "hf"),
                         initial_load_in_hf=True),
        model_parts=target,
        state_dict_adapter=adapter,
    )  # fmt: skip
    with pytest.raises(error, match=message):
        loader.load()
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_check_hf_folder_refuses_a_misfit_from_the_headers_alone(common, tmp_path):
    """``check_hf_folder``: the check ``load`` makes, from shapes (no model, no tensor data),
    for a trainer to run before any work; a whole-dict adapter is not checked (False)."""
    from titan_ckpt.hf import check_hf_folder
    from titan_ckpt.storage import LocalStorage

    model = common.make_model()
    config = CheckpointConfig(enable=True, folder=str(tmp_path / "run"), last_save_in_hf=True)
    adapter = common.StreamingRenamingAdapter()
    manager = CheckpointManager(config, model_parts=model, state_dict_adapter=adapter)
    manager.save(1, last_step=True)
    manager.close()
    hf_dir = str(tmp_path / "run" / "step-1" / "hf")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert check_hf_folder(LocalStorage(), hf_dir, adapter, shapes)
    wrong = {**shapes, "0.weight": (8, 16)}
    with pytest.raises(CheckpointConfigError, match=r"0.weight: \[32, 16\] in the checkpoint"):
        check_hf_folder(LocalStorage(), hf_dir, adapter, wrong)
    with pytest.raises(CheckpointConfigError, match=r"lacks model keys \['9.weight'\]"):
        check_hf_folder(LocalStorage(), hf_dir, adapter, {**shapes, "9.weight": (1,)})
    assert not check_hf_folder(LocalStorage(), hf_dir, RenamingAdapter(), wrong)
