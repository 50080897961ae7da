"""The Hugging Face export and import of ``CheckpointManager`` on two FSDP2 ranks (gloo,
real files): ``last_save_in_hf`` with a small ``hf_max_shard_size`` writes several
``model-0000k-of-0000n.safetensors`` files and an index that covers every key, with the
bytes of the saved weights; ``initial_load_in_hf`` from that folder into a fresh FSDP2 model
restores every weight exactly. With titan-models and transformers installed, the same for a
titan Llama 3 whose sharded export loads in ``LlamaForCausalLM.from_pretrained`` with
titan's logits (fp32 tolerance).
"""

from __future__ import annotations

import json

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")


def check(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def read_export(hf_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    """The index of a sharded export, and every tensor of its shards."""
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        shard = safetensors_torch.load_file(str(hf_dir / name))
        assert {k for k, v in index["weight_map"].items() if v == name} == set(shard)
        tensors.update(shard)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    return index, tensors


def check_restored(result: dict) -> None:
    assert result["loaded"]
    assert result["fresh_differed"] == result["keys"]  # the fresh model started elsewhere
    assert result["not_restored"] == []
    assert result["local_numel"] < result["full_numel"]  # each rank holds a shard only


@pytest.mark.slow
def test_fsdp_export_is_sharded_with_an_index_and_loads_back(common, torchrun, results, tmp_path):
    # The MLP's float32 tensors: 2048, 128, 4096, 128, 512 and 16 bytes.
    check(torchrun("save_hf.py", 2, str(tmp_path), "mlp", "4096"))
    hf_dir = tmp_path / "run" / "step-3" / "hf"
    assert sorted(p.name for p in hf_dir.iterdir()) == [
        "config.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    index, tensors = read_export(hf_dir)
    reference = common.make_model(seed=0).state_dict()
    assert set(index["weight_map"]) == {f"model.layers.{k}" for k in reference}
    assert index["weight_map"]["model.layers.2.weight"] == "model-00002-of-00003.safetensors"
    for key, value in reference.items():
        assert torch.equal(tensors[f"model.layers.{key}"], value), key
    config = json.loads((hf_dir / "config.json").read_text())
    assert (config["hidden_size"], config["torch_dtype"]) == (32, "float32")
    for result in results(tmp_path, "hf-mlp", 2):
        check_restored(result)


@pytest.mark.slow
def test_pipeline_stages_export_every_parameter_and_load_their_own(
    common, torchrun, results, tmp_path
):
    # 2 stages x 2 FSDP ranks: rank 0 holds only stage 0's layers; stage 1's reach it from
    # rank 2. Loading back, each stage takes its own layers from the full folder.
    check(torchrun("save_hf.py", 4, str(tmp_path), "pp", "4096"))
    index, tensors = read_export(tmp_path / "run" / "step-3" / "hf")
    reference = common.make_model(seed=0).state_dict()
    assert set(index["weight_map"]) == {f"model.layers.{k}" for k in reference}
    for key, value in reference.items():
        assert torch.equal(tensors[f"model.layers.{key}"], value), key
    stage_keys = [["0.bias", "0.weight", "2.bias", "2.weight"]] * 2 + [["4.bias", "4.weight"]] * 2
    for result, keys in zip(results(tmp_path, "hf-pp", 4), stage_keys, strict=True):
        assert result["keys"] == keys
        check_restored(result)


@pytest.mark.slow
def test_llama3_sharded_export_loads_in_transformers(common, torchrun, results, tmp_path):
    pytest.importorskip("titan_models")
    transformers = pytest.importorskip("transformers")
    check(torchrun("save_hf.py", 2, str(tmp_path), "llama3", "100000"))
    hf_dir = tmp_path / "run" / "step-3" / "hf"
    index, tensors = read_export(hf_dir)
    assert len(set(index["weight_map"].values())) > 3
    model = common.make_llama3(seed=0).eval()
    assert len(tensors) == len(model.state_dict())
    for result in results(tmp_path, "hf-llama3", 2):
        check_restored(result)

    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir)).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf_model(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
