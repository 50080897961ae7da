"""Qwen3StateDictAdapter against transformers' own Qwen3ForCausalLM and Qwen3MoeForCausalLM,
built from small configs (random weights, no download, fp32, eager attention): our weights,
written as an HF checkpoint (safetensors + the adapter's config.json) and loaded by
``from_pretrained``, give our logits; an HF model's ``save_pretrained`` checkpoint, converted,
gives its logits in our model; the gradients of one cross-entropy loss on the same batch are
equal parameter by parameter; converting there and back is exact. Dense tied and untied, MoE
(all blocks sparse, and every other block with one kept dense).

Tolerance 1e-5 (fp32): the two models compute the same sums in another order (HF adds the
experts one by one, rotates with cos and sin tables of fp32 angles where ours are fp64's,
and scales the scores after the matmul).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional

from titan_models.errors import ModelConfigError
from titan_models.qwen3.adapter import Qwen3StateDictAdapter, make_adapter
from titan_models.qwen3.args import Qwen3Args, qwen3_args
from titan_models.qwen3.hf_config import args_from_hf_config, differences
from titan_models.qwen3.model import Qwen3

transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-5, "atol": 1e-5}


def tiny_args(**overrides) -> Qwen3Args:
    """Three blocks, 4 query heads of 16 channels (64 != dim 32: head_dim is explicit)."""
    fields = {
        "vocab_size": 96,
        "dim": 32,
        "n_layers": 3,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "hidden_dim": 48,
        "max_seq_len": 64,
        "moe_inter_dim": 16,
        "num_experts": 8,
        "top_k": 2,
    }
    return Qwen3Args(**{**fields, **overrides})


VARIANTS = {
    "dense tied": {"enable_weight_tying": True},
    "dense untied": {},
    "moe": {"moe_enabled": True},
    "moe mixed, tied": {
        "moe_enabled": True,
        "n_layers": 4,
        "decoder_sparse_step": 2,
        "mlp_only_layers": (3,),
        "enable_weight_tying": True,
    },
}


def hf_class(args: Qwen3Args):
    return transformers.Qwen3MoeForCausalLM if args.moe_enabled else transformers.Qwen3ForCausalLM


def hf_config_class(args: Qwen3Args):
    return transformers.Qwen3MoeConfig if args.moe_enabled else transformers.Qwen3Config


def our_model(args: Qwen3Args, seed: int = 0) -> Qwen3:
    """Random weights; QK-norm and block norms away from 1 so that they matter."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Qwen3(args)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def hf_from_checkpoint(path, args: Qwen3Args) -> torch.nn.Module:
    model = hf_class(args).from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def write_hf_checkpoint(path, adapter: Qwen3StateDictAdapter, state_dict) -> None:
    """What ``titan-ckpt convert --to hf`` writes: config.json and safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(adapter.hf_config()))
    save_file(dict(adapter.to_hf_items(state_dict.items())), path / "model.safetensors")


def batch(args: Qwen3Args, length: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(
        0, args.vocab_size, (2, length + 1), generator=torch.Generator().manual_seed(1)
    )
    return data[:, :-1], data[:, 1:]


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_model_loads_our_weights_and_gives_our_logits_and_gradients(tmp_path, variant):
    args = tiny_args(**VARIANTS[variant])
    model = our_model(args)
    adapter = make_adapter(model_args=args)
    write_hf_checkpoint(tmp_path, adapter, model.state_dict())
    saved = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in saved) is not args.enable_weight_tying
    hf = hf_from_checkpoint(tmp_path, args)
    assert type(hf).__name__ == hf.config.architectures[0]
    x, y = batch(args)
    ours, theirs = model(x), hf(x).logits
    torch.testing.assert_close(theirs, ours, **TOL)
    # One backward step each: the same gradients, HF's mapped to our names.
    loss_of(ours, y).backward()
    loss_of(theirs, y).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    mapped = adapter.from_hf(hf_grads)
    ours_grads = {n: p.grad for n, p in model.named_parameters()}
    if args.enable_weight_tying:
        ours_grads["output.weight"] = model.output.weight.grad
    assert set(ours_grads) == {k for k in mapped if not k.endswith(("bias", "per_expert"))}
    for name, grad in ours_grads.items():
        torch.testing.assert_close(mapped[name], grad, **TOL, msg=name)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_our_model_loads_an_hf_checkpoint_and_gives_its_logits(tmp_path, variant):
    config = make_adapter(model_args=tiny_args(**VARIANTS[variant])).hf_config()
    args = args_from_hf_config(config)
    torch.manual_seed(2)
    hf = hf_class(args)(hf_config_class(args)(**config, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    if args.moe_enabled:  # the checkpoint format: one tensor per expert
        assert on_disk["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (32, 16)
    hf = hf_from_checkpoint(tmp_path, args)  # as a user's checkpoint loads

    adapter = make_adapter(hf_config=json.loads((tmp_path / "config.json").read_text()))
    assert adapter.args == args
    state_dict = adapter.from_hf(on_disk)
    model = Qwen3(adapter.args)
    model.load_state_dict(state_dict, strict=True)
    model.tie_weights()
    x, _ = batch(adapter.args)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), hf(x).logits, **TOL)
    # transformers 5 holds the experts fused in memory; that form converts the same.
    fused = adapter.from_hf(hf.state_dict())
    assert fused.keys() == state_dict.keys()
    for name, tensor in fused.items():
        torch.testing.assert_close(tensor, state_dict[name], rtol=0, atol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_exact(variant):
    args = tiny_args(**VARIANTS[variant])
    state_dict = our_model(args).state_dict()
    adapter = Qwen3StateDictAdapter(args)
    hf = adapter.to_hf(state_dict)
    # No permutation: the query rows and QK-norm weights cross as they are.
    assert torch.equal(
        hf["model.layers.0.self_attn.q_proj.weight"], state_dict["layers.0.attention.wq.weight"]
    )
    assert torch.equal(
        hf["model.layers.0.self_attn.k_norm.weight"], state_dict["layers.0.attention.k_norm.weight"]
    )
    back = adapter.from_hf(hf)
    assert back.keys() == state_dict.keys()
    for name, tensor in state_dict.items():
        assert torch.equal(back[name], tensor), name


def test_hf_config_round_trips_to_the_same_args():
    for variant in VARIANTS.values():
        args = tiny_args(**variant)
        back = args_from_hf_config(make_adapter(model_args=args).hf_config())
        # A dense config says nothing of experts: the MoE fields keep their defaults.
        assert back == args if args.moe_enabled else differences(back, args, vocab=True) == []


def test_a_published_config_reads_as_its_flavor():
    # The fields of Qwen/Qwen3-30B-A3B's config.json that describe the model.
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": None, "attention_bias": False,
        "hidden_act": "silu",
    }  # fmt: skip
    assert args_from_hf_config(config) == qwen3_args("30B-A3B")
    assert make_adapter(flavor="30B-A3B").hf_config()["num_experts"] == 128


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
            r"architectures=\['LlamaForCausalLM'\] \(model_type='llama'\) is not "
            "Qwen3ForCausalLM or Qwen3MoeForCausalLM",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
        ({"use_sliding_window": True}, "use_sliding_window=true"),
        ({"attention_bias": True}, "attention_bias=true"),
    ],
)
def test_an_hf_config_titan_cannot_express_is_refused(change, message):
    config = {**make_adapter(model_args=tiny_args()).hf_config(), **change}
    with pytest.raises(ModelConfigError, match=message):
        make_adapter(hf_config=config)


def test_an_hf_config_of_another_shape_than_the_model_is_named():
    config = make_adapter(model_args=tiny_args(n_layers=4, head_dim=8)).hf_config()
    with pytest.raises(ModelConfigError, match=r"n_layers: 3 vs 4; head_dim: 16 vs 8"):
        make_adapter(model_args=tiny_args(), hf_config=config)


def test_tensor_shapes_that_contradict_the_description_are_named():
    args = tiny_args()
    shapes = {k: tuple(v.shape) for k, v in our_model(args).state_dict().items()}
    with torch.device("meta"):
        debug = {k: tuple(v.shape) for k, v in Qwen3(qwen3_args("debugmodel")).state_dict().items()}
    # A flavor's vocabulary is the tokenizer's: taken from the tensors.
    debug |= {"tok_embeddings.weight": (77, 256), "output.weight": (77, 256)}
    assert make_adapter(flavor="debugmodel", tensor_shapes=debug).args.vocab_size == 77
    del debug["layers.7.attention.q_norm.weight"]
    with pytest.raises(ModelConfigError, match=r"layers\.7\.attention\.q_norm\.weight: missing"):
        make_adapter(flavor="debugmodel", tensor_shapes=debug)
    with pytest.raises(
        ModelConfigError,
        match=r"layers.0.attention.wq.weight: expected \[2048, 256\], found \[64, 32\]",
    ):
        make_adapter(flavor="debugmodel", tensor_shapes=shapes)
    assert make_adapter(model_args=args, tensor_shapes=shapes).args == args
    # A tied checkpoint may hold the matrix once.
    tied = tiny_args(enable_weight_tying=True)
    once = {k: v for k, v in shapes.items() if k != "output.weight"}
    assert make_adapter(model_args=tied, tensor_shapes=once).args == tied


def test_missing_experts_and_unknown_names_are_refused():
    args = tiny_args(moe_enabled=True)
    hf = Qwen3StateDictAdapter(args).to_hf(our_model(args).state_dict())
    del hf["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ModelConfigError, match="layer 2 up_proj: 1 of 8 experts missing"):
        Qwen3StateDictAdapter(args).from_hf(hf)
    with pytest.raises(KeyError, match="not a Qwen3 parameter name"):
        Qwen3StateDictAdapter(args).to_hf({"layers.0.attention.wqkv.weight": torch.zeros(1)})


def test_recorded_args_are_not_overridden_and_rope_scaling_none_is_accepted():
    args = tiny_args()
    assert make_adapter(model_args=args, overrides={"rope_scaling": "none"}).args == args
    with pytest.raises(ModelConfigError, match="contradicts the model args recorded"):
        make_adapter(model_args=args, overrides={"n_layers": 5})
    recorded = make_adapter(model_args=tiny_args(mlp_only_layers=(1,))).model_args()
    assert make_adapter(model_args=json.loads(json.dumps(recorded))).args.mlp_only_layers == (1,)


# torchtitan's Qwen3StateDictAdapter.from_hf_map (torchtitan/models/qwen3/model/
# state_dict_adapter.py at d880de214, October 2025), experts and rotary buffers aside.
TORCHTITAN_FROM_HF = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def test_names_map_as_torchtitans_adapter_maps_them():
    args = tiny_args(moe_enabled=True, n_layers=2, mlp_only_layers=(0,))
    adapter = Qwen3StateDictAdapter(args)
    state_dict = our_model(args).state_dict()
    for hf_name, titan_name in TORCHTITAN_FROM_HF.items():
        hf_name, titan_name = hf_name.format(0), titan_name.format(0)
        if titan_name not in state_dict:  # the router is in block 1, the dense MLP in 0
            hf_name, titan_name = hf_name.replace(".0.", ".1."), titan_name.replace(".0.", ".1.")
        mapped = dict(adapter.to_hf_items([(titan_name, state_dict[titan_name])]))
        assert list(mapped) == [hf_name]


def test_exporting_a_learnt_expert_bias_warns_that_hf_cannot_hold_it(caplog):
    """Qwen3-MoE's HF format routes without a selection bias: exporting a nonzero one is said
    once per layer (the export itself goes on, as HF's model would load it)."""
    import logging

    from titan_models.qwen3 import Qwen3StateDictAdapter, qwen3_args

    adapter = Qwen3StateDictAdapter(qwen3_args("debugmodel_moe"))
    zeros, biased = torch.zeros(8), torch.tensor([0.1, -0.1, 0, 0, 0, 0, 0, 0])
    items = [("layers.0.moe.expert_bias", zeros), ("layers.1.moe.expert_bias", biased)]
    with caplog.at_level(logging.WARNING, logger="titan_models"):
        assert list(adapter.to_hf_items(items)) == []
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert messages[0].startswith("layers.1.moe.expert_bias is not zero (max 0.1)")
