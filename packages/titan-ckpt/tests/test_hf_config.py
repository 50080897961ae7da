"""``titan-ckpt convert --hf-config FILE``: a model no flavor describes, given as a Hugging
Face ``config.json``, converts DCP -> HF -> DCP bit-exactly (by ``diff``'s verdict).

The model is a tiny Llama (hidden 48, 6 heads of 8, 2 KV heads, 2 layers, vocab 96) that
matches no flavor. It goes through two adapters, each found the way titan-ckpt finds every
adapter, through the ``titan.state_dict_adapters`` entry-point group:

- ``test-llama``: defined below and installed for the test as a distribution on sys.path
  (its own dist-info with entry_points.txt), so these tests run with titan-ckpt alone;
- ``llama3``: titan-models' adapter, when titan-models is installed.
"""

from __future__ import annotations

import importlib
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

# A Llama adapter in the shape model packages give (titan names <-> HF names, q/k rows
# permuted per head for HF's RoPE layout), built only from an HF config.
ADAPTER_MODULE = """
import re

LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "vocab_size")


def permute(w, heads, inverse=False):
    rows, cols = w.shape
    half = rows // heads // 2
    split = (heads, 2, half, cols) if inverse else (heads, half, 2, cols)
    return w.view(*split).transpose(1, 2).reshape(rows, cols)


class TestLlamaAdapter:
    def __init__(self, config):
        self.config = {k: config[k] for k in SHAPE}
        self.heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}

    def to_hf(self, state_dict):
        out = {}
        for key, value in state_dict.items():
            if key in TOP:
                out[TOP[key]] = value
                continue
            layer, rest = re.match(r"^layers\\.(\\d+)\\.(.+)$", key).groups()
            hf = LAYER[rest]
            if hf[10] in self.heads and hf.startswith("self_attn"):
                value = permute(value, self.heads[hf[10]])
            out[f"model.layers.{layer}.{hf}"] = value
        return out

    def from_hf(self, hf_state_dict):
        top = {v: k for k, v in TOP.items()}
        layers = {v: k for k, v in LAYER.items()}
        out = {}
        for key, value in hf_state_dict.items():
            if key in top:
                out[top[key]] = value
                continue
            layer, rest = re.match(r"^model\\.layers\\.(\\d+)\\.(.+)$", key).groups()
            if rest[10] in self.heads and rest.startswith("self_attn"):
                value = permute(value, self.heads[rest[10]], inverse=True)
            out[f"layers.{layer}.{layers[rest]}"] = value
        return out

    def hf_config(self):
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **self.config}


def make_adapter(*, flavor=None, hf_config=None):
    if hf_config is None:
        raise ValueError(f"test-llama has no flavor {flavor!r}; give hf_config=")
    missing = [k for k in SHAPE if k not in hf_config]
    if missing:
        raise KeyError(f"the config lacks {missing}")
    return TestLlamaAdapter(hf_config)
"""


@pytest.fixture
def test_llama(tmp_path_factory, monkeypatch):
    """Install the ``test-llama`` adapter as a distribution on sys.path for this test."""
    site = tmp_path_factory.mktemp("site")
    (site / "titan_test_llama.py").write_text(ADAPTER_MODULE)
    info = site / "titan_test_llama-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: titan-test-llama\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[titan.state_dict_adapters]\ntest-llama = titan_test_llama:make_adapter\n"
    )
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return "test-llama"


def installed_llama3() -> str:
    found = importlib.metadata.entry_points(group="titan.state_dict_adapters")
    if "llama3" not in {ep.name for ep in found}:
        pytest.skip("titan-models (the llama3 adapter) is not installed")
    return "llama3"


@pytest.fixture(params=["test-llama", "llama3"])
def adapter_name(request):
    if request.param == "test-llama":
        return request.getfixturevalue("test_llama")
    return installed_llama3()


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
