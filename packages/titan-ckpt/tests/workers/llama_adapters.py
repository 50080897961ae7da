"""Two Llama adapters in the shape model packages give (titan names <-> HF names, q/k rows
permuted per head for HF's RoPE layout), built from an HF config, for tests that must run
with titan-ckpt alone. ``conftest.install_adapters`` installs this file as a distribution
whose entry points (group ``titan.state_dict_adapters``) name them:

- ``test-llama``: whole dicts only (``to_hf``/``from_hf``): titan-ckpt's fallback path;
- ``test-llama-streaming``: also ``to_hf_items``/``from_hf_items``, one tensor at a time.
"""

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
         "num_key_value_heads", "vocab_size")  # fmt: skip


def permute(w, heads, inverse=False):
    rows, cols = w.shape
    half = rows // heads // 2
    split = (heads, 2, half, cols) if inverse else (heads, half, 2, cols)
    return w.view(*split).transpose(1, 2).reshape(rows, cols)


class TestLlamaAdapter:
    def __init__(self, config):
        self.config = {k: config[k] for k in SHAPE}
        self.heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}

    def _to_hf(self, key, value):
        if key in TOP:
            return TOP[key], value
        layer, rest = re.match(r"^layers\.(\d+)\.(.+)$", key).groups()
        hf = LAYER[rest]
        if hf[10] in self.heads and hf.startswith("self_attn"):
            value = permute(value, self.heads[hf[10]])
        return f"model.layers.{layer}.{hf}", value

    def _from_hf(self, key, value):
        top = {v: k for k, v in TOP.items()}
        if key in top:
            return top[key], value
        layers = {v: k for k, v in LAYER.items()}
        layer, rest = re.match(r"^model\.layers\.(\d+)\.(.+)$", key).groups()
        if rest[10] in self.heads and rest.startswith("self_attn"):
            value = permute(value, self.heads[rest[10]], inverse=True)
        return f"layers.{layer}.{layers[rest]}", value

    def to_hf(self, state_dict):
        return dict(self._to_hf(k, v) for k, v in state_dict.items())

    def from_hf(self, hf_state_dict):
        return dict(self._from_hf(k, v) for k, v in hf_state_dict.items())

    def hf_config(self):
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **self.config}


class StreamingTestLlamaAdapter(TestLlamaAdapter):
    def to_hf_items(self, items):
        for key, value in items:
            yield self._to_hf(key, value)
            del value  # hold nothing while the next input is read

    def from_hf_items(self, items):
        for key, value in items:
            yield self._from_hf(key, value)
            del value


def _config(flavor, hf_config):
    if hf_config is None:
        raise ValueError(f"test-llama has no flavor {flavor!r}; give hf_config=")
    missing = [k for k in SHAPE if k not in hf_config]
    if missing:
        raise KeyError(f"the config lacks {missing}")
    return hf_config


def make_adapter(*, flavor=None, hf_config=None):
    return TestLlamaAdapter(_config(flavor, hf_config))


def make_streaming_adapter(*, flavor=None, hf_config=None):
    return StreamingTestLlamaAdapter(_config(flavor, hf_config))
