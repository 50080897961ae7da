"""The Hugging Face adapter, checked against transformers' own LlamaForCausalLM (built from
the adapter's config.json, no download; skipped without the test extra): same weights give
the same logits. Round trips and name mapping need no transformers. The streaming form
(``to_hf_items``/``from_hf_items``, what titan-ckpt uses to convert one tensor at a time)
is lazy, gives what the whole-dict form gives, and plans the same layout on meta tensors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from titan_models import ModelConfigError
from titan_models.llama3 import Llama3, Llama3StateDictAdapter, llama3_args, make_adapter
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


def test_make_adapter_needs_a_description_and_not_two_conflicting_ones():
    with pytest.raises(ModelConfigError, match="needs model_args=, flavor="):
        make_adapter()
    with pytest.raises(ModelConfigError, match="not both"):
        make_adapter(flavor="8B", hf_config={})


def meta_shapes(args) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Llama3(args).state_dict().items()}


def test_vocabulary_comes_from_the_tensors_not_the_flavor():
    shapes = meta_shapes(llama3_args("debugmodel", vocab_size=2000))
    adapter = make_adapter(flavor="debugmodel", tensor_shapes=shapes)
    config = adapter.hf_config()
    assert (config["vocab_size"], config["hidden_size"], config["intermediate_size"]) == (
        2000, 256, 768)  # fmt: skip


def test_a_contradicting_flavor_names_each_field_expected_and_found():
    shapes = meta_shapes(llama3_args("debugmodel", vocab_size=2000))
    with pytest.raises(ModelConfigError) as error:
        make_adapter(flavor="8B", tensor_shapes=shapes)
    message = str(error.value)
    for expected in (
        "dim (hidden_size): expected 4096 from flavor '8B', found 256",
        "n_layers (num_hidden_layers): expected 32 from flavor '8B', found 6",
        "n_kv_heads x head_dim (num_key_value_heads x head_dim): expected 1024",
        "ffn hidden size (intermediate_size): expected 14336 from flavor '8B', found 768",
    ):
        assert expected in message
    assert "vocab_size" not in message  # a flavor's vocabulary is only a placeholder


def test_a_contradicting_hf_config_names_the_vocabulary_too():
    args = llama3_args("debugmodel", vocab_size=2000)
    config = {**Llama3StateDictAdapter(args).hf_config(), "vocab_size": 2048,
              "num_key_value_heads": 8}  # fmt: skip
    with pytest.raises(ModelConfigError) as error:
        make_adapter(hf_config=config, tensor_shapes=meta_shapes(args))
    assert "vocab_size: expected 2048 from the HF config, found 2000" in str(error.value)
    assert "expected 128 from the HF config, found 256" in str(error.value)  # 8 kv heads of 16


def test_recorded_args_round_trip_and_refuse_a_contradicting_override():
    args = llama3_args("debugmodel", vocab_size=2000, max_seq_len=64, rope_scaling="none")
    recorded = json.loads(json.dumps(dataclasses.asdict(args)))
    adapter = make_adapter(model_args=recorded, tensor_shapes=meta_shapes(args))
    assert adapter.args == args
    assert adapter.hf_config()["rope_scaling"] is None
    assert make_adapter(model_args=recorded, overrides={"rope_scaling": "none"}).args == args
    with pytest.raises(ModelConfigError, match="contradicts the model args recorded"):
        make_adapter(model_args=recorded, overrides={"rope_scaling": "llama3"})
    # With a flavor beside the record, the flavor is checked too (n_heads shows in no tensor).
    with pytest.raises(ModelConfigError, match="n_heads: 16 from the recorded model args, 32 from"):
        make_adapter(model_args=recorded, flavor="8B", tensor_shapes=meta_shapes(args))


@pytest.mark.parametrize("rope", ["none", "llama3"])
def test_rope_override_reaches_config_json_and_matches_transformers(tiny, rope):
    transformers = pytest.importorskip("transformers")
    # As convert --hf-config FILE --rope-scaling NAME does: the override replaces the config's.
    described = Llama3StateDictAdapter(tiny.tiny_args()).hf_config()
    adapter = make_adapter(hf_config=described, overrides={"rope_scaling": rope})
    config = adapter.hf_config()
    assert config["rope_scaling"] == (None if rope == "none" else described["rope_scaling"])
    assert (config["rope_scaling"] is None) == (rope == "none")
    # transformers 5 reads rope_parameters first: it says the same, so a base config.json's
    # (convert --hf-config) cannot override the choice.
    rope_type = config["rope_scaling"] or {"rope_type": "default"}
    assert config["rope_parameters"] == {**rope_type, "rope_theta": adapter.args.rope_theta}
    model = Llama3(adapter.args)
    model.load_state_dict(tiny.reference_state_dict())
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    hf_model.load_state_dict(adapter.to_hf(model.state_dict()), strict=True)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), hf_model(tokens).logits,
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


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
