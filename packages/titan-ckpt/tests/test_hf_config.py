"""``titan-ckpt convert --hf-config FILE``: a model no flavor describes, given as a Hugging
Face ``config.json``, converts DCP -> HF -> DCP bit-exactly (by ``diff``'s verdict).

The model is a tiny Llama (hidden 48, 6 heads of 8, 2 KV heads, 2 layers, vocab 96) that
matches no flavor. It goes through three adapters, each found the way titan-ckpt finds every
adapter, through the ``titan.state_dict_adapters`` entry-point group:

- ``test-llama`` (whole dicts: the fallback) and ``test-llama-streaming`` (tensor by
  tensor), defined in workers/llama_adapters.py and installed for the test as a
  distribution on sys.path (its own dist-info with entry_points.txt), so these tests run
  with titan-ckpt alone;
- ``llama3``: titan-models' adapter (streaming), when titan-models is installed.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
pytest.importorskip("safetensors")

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 48,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
    "bos_token_id": 7,  # no adapter knows it: it must survive into the written config.json
    "eos_token_id": 8,
}


@pytest.fixture
def test_llama(install_adapters):
    """The whole-dict ``test-llama`` adapter (workers/llama_adapters.py), installed."""
    return "test-llama"


def installed_llama3() -> str:
    found = importlib.metadata.entry_points(group="titan.state_dict_adapters")
    if "llama3" not in {ep.name for ep in found}:
        pytest.skip("titan-models (the llama3 adapter) is not installed")
    return "llama3"


@pytest.fixture(params=["test-llama", "test-llama-streaming", "llama3"])
def adapter_name(request):
    if request.param == "llama3":
        return installed_llama3()
    request.getfixturevalue("install_adapters")
    return request.param


@pytest.fixture
def tiny_llama(tmp_path):
    """A DCP step of the tiny Llama (titan names) plus a train state, and its config.json."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    dim, ffn, kv, vocab = 48, 128, 2 * 8, 96
    state: dict[str, object] = {
        "tok_embeddings.weight": torch.randn(vocab, dim, generator=g),
        "norm.weight": torch.rand(dim, generator=g),
        "output.weight": torch.randn(vocab, dim, generator=g),
    }
    for i in range(2):
        shapes = {
            "attention.wq.weight": (dim, dim),
            "attention.wk.weight": (kv, dim),
            "attention.wv.weight": (kv, dim),
            "attention.wo.weight": (dim, dim),
            "feed_forward.w1.weight": (ffn, dim),
            "feed_forward.w2.weight": (dim, ffn),
            "feed_forward.w3.weight": (ffn, dim),
            "attention_norm.weight": (dim,),
            "ffn_norm.weight": (dim,),
        }
        for name, shape in shapes.items():
            state[f"layers.{i}.{name}"] = torch.randn(*shape, generator=g)
    state["train_state"] = {"step": 11}
    step = tmp_path / "step-11"
    dcp.save(state, checkpoint_id=str(step), no_dist=True)
    config = tmp_path / "tiny-llama.json"
    config.write_text(json.dumps(CONFIG))
    return step, config, state


def half_split(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's RoPE row order of a q/k projection: per head, even rows then odd rows."""
    rows, cols = w.shape
    per_head = w.view(heads, rows // heads, cols)
    return torch.cat([per_head[:, 0::2], per_head[:, 1::2]], dim=1).reshape(rows, cols)


def test_dcp_hf_dcp_with_hf_config_is_bit_exact(tiny_llama, adapter_name, tmp_path, titan_ckpt):
    from safetensors.torch import load_file

    step, config, state = tiny_llama
    hf = tmp_path / "hf"
    code, _, err = titan_ckpt("convert", step, hf, "--to", "hf", "--model", adapter_name,
                              "--hf-config", config)  # fmt: skip
    assert code == 0, err
    written = json.loads((hf / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert written[key] == CONFIG[key]
    assert (written["bos_token_id"], written["torch_dtype"]) == (7, "float32")
    tensors = load_file(str(hf / "model.safetensors"))
    # The head counts came from the config: q has 6 heads, k has 2.
    q, k = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(tensors[q], half_split(state["layers.1.attention.wq.weight"], 6))
    assert torch.equal(tensors[k], half_split(state["layers.1.attention.wk.weight"], 2))

    # Back from the folder (its config.json), and from the bare weights with --hf-config.
    back = tmp_path / "back"
    code, _, err = titan_ckpt("convert", hf, back, "--to", "dcp", "--model", adapter_name)
    assert code == 0, err
    # --to safetensors with --model converts too (it once kept the HF names).
    native = tmp_path / "native.safetensors"
    code, _, err = titan_ckpt("convert", hf, native, "--to", "safetensors", "--model", adapter_name)
    assert code == 0, err
    code, report, _ = titan_ckpt("diff", step, native, "--exclude", "train_state.*")
    assert code == 0, report
    assert "equal (atol=0, rtol=0; compared 21 tensors" in report
    bare = tmp_path / "bare.safetensors"
    (hf / "model.safetensors").rename(bare)
    back2 = tmp_path / "back2"
    code, _, err = titan_ckpt("convert", bare, back2, "--to", "dcp", "--model", adapter_name,
                              "--hf-config", config)  # fmt: skip
    assert code == 0, err
    for out in (back, back2):
        code, report, _ = titan_ckpt("diff", step, out, "--exclude", "train_state.*")
        assert code == 0, report
        assert "equal (atol=0, rtol=0; compared 21 tensors" in report


def test_hf_config_usage_errors(tiny_llama, test_llama, tmp_path, titan_ckpt):
    step, config, _ = tiny_llama
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "partial.json").write_text(json.dumps({"hidden_size": 48}))
    to_hf = ("convert", step, tmp_path / "o", "--to", "hf")
    cases = [
        ((*to_hf, "--model", test_llama, "--flavor", "x", "--hf-config", config),
         "Give --flavor or --hf-config, not both"),
        ((*to_hf[:-1], "dcp", "--hf-config", config), "--hf-config needs --model"),
        ((*to_hf, "--model", test_llama, "--hf-config", tmp_path / "nope.json"),
         "No such file or directory"),
        ((*to_hf, "--model", test_llama, "--hf-config", tmp_path / "broken.json"), "is not JSON"),
        ((*to_hf, "--model", test_llama, "--hf-config", tmp_path / "list.json"),
         "holds a list, not an object"),
        ((*to_hf, "--model", test_llama, "--hf-config", tmp_path / "partial.json"),
         "The 'test-llama' adapter cannot be built from"),
        ((*to_hf, "--model", test_llama, "--flavor", "8B"), "test-llama has no flavor '8B'"),
    ]  # fmt: skip
    for args, message in cases:
        code, _, err = titan_ckpt(*args)
        assert code == 2, (args, err)
        assert message in err, (args, err)
    assert not (tmp_path / "o").exists()


def test_adapter_factory_takes_hf_config(test_llama):
    from titan_ckpt import load_state_dict_adapter

    adapter = load_state_dict_adapter(test_llama, hf_config=CONFIG)
    assert adapter.hf_config()["num_key_value_heads"] == 2
    with pytest.raises(ValueError, match="has no flavor"):
        load_state_dict_adapter(test_llama, flavor="tiny")


@pytest.mark.parametrize("name", ["test-llama-streaming", "llama3"])
def test_streaming_adapter_refuses_unknown_keys_before_writing(
    tiny_llama, install_adapters, name, tmp_path, titan_ckpt
):
    import torch.distributed.checkpoint as dcp

    if name == "llama3":
        installed_llama3()
    _, config, state = tiny_llama
    state = {**state, "layers.0.attention.wx.weight": torch.zeros(4, 4)}
    step = tmp_path / "odd"
    dcp.save(state, checkpoint_id=str(step), no_dist=True)
    out = tmp_path / "out"
    code, _, err = titan_ckpt("convert", step, out, "--to", "hf", "--model", name,
                              "--hf-config", config)  # fmt: skip
    assert code == 2, err
    assert f"The {name!r} adapter cannot convert {step}: KeyError" in err
    assert "wx" in err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
