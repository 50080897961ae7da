"""The Hugging Face adapter, checked against transformers' own LlamaForCausalLM (built from
the adapter's config.json, no download; skipped without the test extra): same weights give
the same logits. Round trips and name mapping need no transformers. The streaming form
(``to_hf_items``/``from_hf_items``, what titan-ckpt uses to convert one tensor at a time)
is lazy, gives what the whole-dict form gives, and plans the same layout on meta tensors."""

from __future__ import annotations

import pytest
import torch

from titan_models import ConfigError, Llama3, Llama3StateDictAdapter, make_adapter
from titan_models.llama3.adapter import args_from_hf_config


@pytest.fixture(scope="module")
def titan_model(tiny):
    model = Llama3(tiny.tiny_args())
    model.load_state_dict(tiny.reference_state_dict())
    return model.eval()


def test_logits_equal_transformers_llama(tiny, titan_model):
    transformers = pytest.importorskip("transformers")
    adapter = Llama3StateDictAdapter(tiny.tiny_args())
    config = transformers.LlamaConfig(**adapter.hf_config())
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.load_state_dict(adapter.to_hf(titan_model.state_dict()), strict=True)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = titan_model(tokens)
        theirs = hf_model(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # And back: HF's own state dict (with its names) loads into titan unchanged in value.
    back = adapter.from_hf(hf_model.state_dict())
    for name, value in titan_model.state_dict().items():
        assert torch.equal(back[name], value), name


def test_round_trip_is_exact_and_permutes_only_q_and_k(tiny, titan_model):
    adapter = Llama3StateDictAdapter(tiny.tiny_args())
    state = titan_model.state_dict()
    hf = adapter.to_hf(state)
    assert len(hf) == len(state)
    assert not torch.equal(
        hf["model.layers.0.self_attn.q_proj.weight"], state["layers.0.attention.wq.weight"]
    )
    assert torch.equal(
        hf["model.layers.0.self_attn.v_proj.weight"], state["layers.0.attention.wv.weight"]
    )
    assert torch.equal(
        hf["model.layers.1.mlp.up_proj.weight"], state["layers.1.feed_forward.w3.weight"]
    )
    back = adapter.from_hf(hf)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_tied_hf_checkpoint_gets_an_output_copy(tiny, titan_model):
    adapter = Llama3StateDictAdapter(tiny.tiny_args())
    hf = adapter.to_hf(titan_model.state_dict())
    del hf["lm_head.weight"]
    back = adapter.from_hf(hf)
    assert torch.equal(back["output.weight"], back["tok_embeddings.weight"])


def test_unknown_names_raise(tiny):
    adapter = Llama3StateDictAdapter(tiny.tiny_args())
    with pytest.raises(KeyError, match=r"layers\.0\.attention\.wx\.weight"):
        adapter.to_hf({"layers.0.attention.wx.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match=r"model\.foo"):
        adapter.from_hf({"model.foo": torch.zeros(1)})


def test_hf_config_round_trips_to_the_same_args():
    adapter = make_adapter(flavor="8B")
    config = adapter.hf_config()
    assert config["intermediate_size"] == 14336
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert args_from_hf_config(config).num_params() == 8_030_261_248
    assert make_adapter(hf_config=config).args.hidden_dim == 14336


def test_make_adapter_needs_exactly_one_source():
    with pytest.raises(ConfigError, match="exactly one"):
        make_adapter()
    with pytest.raises(ConfigError, match="exactly one"):
        make_adapter(flavor="8B", hf_config={})


def pulled_lazily(convert, items):
    """Run ``convert`` over ``items``; check it takes one input per output; return the output."""
    taken = []

    def source():
        for key, value in items:
            taken.append(key)
            yield key, value

    stream = convert(source())
    out = [next(stream)]
    assert len(taken) == 1  # the first output came before the second input was read
    out += list(stream)
    assert len(taken) == len(items)
    return out


def test_streaming_form_is_lazy_equals_whole_dicts_and_plans_on_meta(tiny, titan_model):
    adapter = Llama3StateDictAdapter(tiny.tiny_args())
    state = list(titan_model.state_dict().items())
    hf = pulled_lazily(adapter.to_hf_items, state)
    whole = adapter.to_hf(dict(state))
    assert [k for k, _ in hf] == list(whole)
    assert all(torch.equal(v, whole[k]) for k, v in hf)
    back = pulled_lazily(adapter.from_hf_items, hf)
    assert all(torch.equal(v, dict(state)[k]) for k, v in back)
    # The layout (keys, shapes, dtypes, order) comes out the same from tensors without data.
    for convert, items in ((adapter.to_hf_items, state), (adapter.from_hf_items, hf)):
        meta = convert((k, v.to("meta")) for k, v in items)
        real = convert(iter(items))
        assert [(k, v.shape, v.dtype) for k, v in meta] == [(k, v.shape, v.dtype) for k, v in real]


def test_streaming_tied_checkpoint_yields_the_embedding_as_output_last(tiny, titan_model):
    adapter = Llama3StateDictAdapter(tiny.tiny_args())
    hf = adapter.to_hf(titan_model.state_dict())
    lm_head = hf.pop("lm_head.weight")
    out = list(adapter.from_hf_items(sorted(hf.items())))
    assert out[-1][0] == "output.weight"
    assert out[-1][1] is hf["model.embed_tokens.weight"]
    # With lm_head in the stream (first, as HF names sort), it is the output weight.
    out = dict(adapter.from_hf_items(sorted({**hf, "lm_head.weight": lm_head}.items())))
    assert out["output.weight"] is lm_head


def test_adapter_is_a_streaming_state_dict_adapter_of_titan_ckpt(tiny):
    titan_ckpt = pytest.importorskip("titan_ckpt.adapter")
    adapter = Llama3StateDictAdapter(tiny.tiny_args())
    assert isinstance(adapter, titan_ckpt.StreamingStateDictAdapter)
    assert titan_ckpt.streams(adapter)
