"""DeepSeekV3StateDictAdapter against transformers' own DeepseekV3ForCausalLM, built from
small configs (random weights, no download, fp32): our weights, written as an HF checkpoint
(safetensors + the adapter's config.json) and loaded by ``from_pretrained``, give our logits;
an HF model's ``save_pretrained`` checkpoint, converted, gives its logits in our model; and
converting there and back is exact. With low-rank queries and without, grouped sigmoid
routing with a nonzero selection bias, YaRN, and both RoPE layouts (``rope_interleave``).

Tolerance 1e-5 (fp32): the two models compute the same sums in another order (HF adds the
experts per expert, multiplies RoPE by cos and sin separately, and scales the scores after
the matmul; we fold the YaRN softmax factor into the queries).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_models.deepseek_v3.adapter import DeepSeekV3StateDictAdapter, make_adapter
from titan_models.deepseek_v3.args import DeepSeekV3Args, deepseek_v3_args
from titan_models.deepseek_v3.hf_config import args_from_hf_config
from titan_models.deepseek_v3.model import DeepSeekV3
from titan_models.errors import ModelConfigError

transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-5, "atol": 1e-5}


def tiny_args(**overrides) -> DeepSeekV3Args:
    """Three blocks (one dense), 8 experts in 4 groups, YaRN active (64 > 16 positions)."""
    fields = {
        "vocab_size": 96,
        "dim": 32,
        "inter_dim": 48,
        "moe_inter_dim": 16,
        "n_layers": 3,
        "n_dense_layers": 1,
        "n_heads": 4,
        "norm_eps": 1e-6,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_activated_experts": 2,
        "n_expert_groups": 4,
        "n_limited_groups": 2,
        "score_func": "sigmoid",
        "route_norm": True,
        "route_scale": 2.5,
        "q_lora_rank": 0,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "max_seq_len": 64,
        "original_seq_len": 16,
        "rope_factor": 4.0,
        "mscale": 0.7,
    }
    fields.update(overrides)
    return DeepSeekV3Args(**fields)


VARIANTS = {
    "full-rank q": {},
    "low-rank q": {"q_lora_rank": 12},
    "plain rope, no groups": {"rope_scaling": "none", "n_expert_groups": 1, "n_limited_groups": 1},
}


def our_model(args: DeepSeekV3Args, seed: int = 0) -> DeepSeekV3:
    """Random weights, and a nonzero expert bias so that it matters for selection."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = DeepSeekV3(args)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.05)
    return model.eval()


def hf_from_checkpoint(path) -> torch.nn.Module:
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def write_hf_checkpoint(path, adapter: DeepSeekV3StateDictAdapter, state_dict) -> None:
    """What ``titan-ckpt convert --to hf`` writes: config.json and safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(adapter.hf_config()))
    save_file(dict(adapter.to_hf_items(state_dict.items())), path / "model.safetensors")


def tokens(args: DeepSeekV3Args, length: int = 40) -> torch.Tensor:
    return torch.randint(
        0, args.vocab_size, (2, length), generator=torch.Generator().manual_seed(1)
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_model_loads_our_weights_and_gives_our_logits(tmp_path, variant):
    args = tiny_args(**VARIANTS[variant])
    model = our_model(args)
    adapter = make_adapter(model_args=args)
    write_hf_checkpoint(tmp_path, adapter, model.state_dict())
    hf = hf_from_checkpoint(tmp_path)
    x = tokens(args)
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    torch.testing.assert_close(theirs, ours, **TOL)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_our_model_loads_an_hf_checkpoint_and_gives_its_logits(tmp_path, variant, interleave):
    config = make_adapter(model_args=tiny_args(**VARIANTS[variant])).hf_config()
    config["rope_interleave"] = interleave
    torch.manual_seed(2)
    hf = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**config, attn_implementation="eager")
    )
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.05)
    hf.save_pretrained(tmp_path)
    hf = hf_from_checkpoint(tmp_path)  # as a user's checkpoint loads

    saved = json.loads((tmp_path / "config.json").read_text())
    adapter = make_adapter(hf_config=saved)
    assert adapter.rope_interleave is interleave
    state_dict = adapter.from_hf(load_file(tmp_path / "model.safetensors"))
    model = DeepSeekV3(adapter.args)
    model.load_state_dict(state_dict, strict=True)
    x = tokens(adapter.args)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), hf(x).logits, **TOL)
    # transformers 5 holds the experts fused in memory; that form converts the same.
    fused = adapter.from_hf(hf.state_dict())
    assert fused.keys() == state_dict.keys()
    for name, tensor in fused.items():
        torch.testing.assert_close(tensor, state_dict[name], rtol=0, atol=0)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_exact(variant, interleave):
    args = tiny_args(**VARIANTS[variant])
    state_dict = our_model(args).state_dict()
    adapter = DeepSeekV3StateDictAdapter(args, rope_interleave=interleave)
    hf = adapter.to_hf(state_dict)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf
    assert hf["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (32, 16)
    back = adapter.from_hf(hf)
    assert back.keys() == state_dict.keys()
    for name, tensor in state_dict.items():
        assert torch.equal(back[name], tensor), name


def test_rope_layouts_differ_only_in_the_rotated_rows():
    args = tiny_args(q_lora_rank=12)
    state_dict = our_model(args).state_dict()
    interleaved = DeepSeekV3StateDictAdapter(args).to_hf(state_dict)
    half = DeepSeekV3StateDictAdapter(args, rope_interleave=False).to_hf(state_dict)
    differs = sorted(k for k in interleaved if not torch.equal(interleaved[k], half[k]))
    layers = range(args.n_layers)
    assert differs == sorted(
        f"model.layers.{i}.self_attn.{p}.weight"
        for i in layers
        for p in ("kv_a_proj_with_mqa", "q_b_proj")
    )
    wkv_a = state_dict["layers.0.attention.wkv_a.weight"]
    rotated = half["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][16:]
    assert torch.equal(rotated[:4], wkv_a[16::2])
    assert torch.equal(rotated[4:], wkv_a[17::2])


def test_hf_config_round_trips_to_the_same_args():
    for variant in VARIANTS.values():
        args = tiny_args(**variant)
        back = args_from_hf_config(make_adapter(model_args=args).hf_config())
        if not args.yarn:  # plain RoPE: YaRN's fields are not part of the function
            yarn = ("original_seq_len", "rope_factor", "beta_fast", "beta_slow", "mscale")
            back = dataclasses.replace(back, **{k: getattr(args, k) for k in yarn})
        assert back == args


def test_deepseek_v3s_own_config_reads():
    # The fields of deepseek-ai/DeepSeek-V3's config.json that describe the model.
    config = {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "num_nextn_predict_layers": 1,
    }  # fmt: skip
    args = args_from_hf_config(config)
    flavor = deepseek_v3_args("671B", max_seq_len=163840, norm_eps=1e-6)
    assert args == flavor


def test_hf_configs_titan_cannot_express_are_refused():
    config = make_adapter(model_args=tiny_args()).hf_config()
    with pytest.raises(ModelConfigError, match=r"mscale=1\.0 and mscale_all_dim=0\.7"):
        args_from_hf_config(
            {**config, "rope_parameters": {**config["rope_parameters"], "mscale": 1.0}}
        )
    with pytest.raises(ModelConfigError, match="rope type 'linear'"):
        args_from_hf_config({**config, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ModelConfigError, match="num_key_value_heads=2 differs"):
        args_from_hf_config({**config, "num_key_value_heads": 2})
    with pytest.raises(ModelConfigError, match="has no 'kv_lora_rank'"):
        args_from_hf_config({k: v for k, v in config.items() if k != "kv_lora_rank"})


def test_tensor_shapes_fix_the_vocabulary_and_catch_contradictions():
    args = deepseek_v3_args("debugmodel", vocab_size=2000)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in DeepSeekV3(args).state_dict().items()}
    assert make_adapter(flavor="debugmodel", tensor_shapes=shapes).args.vocab_size == 2000
    assert make_adapter(model_args=args, tensor_shapes=shapes).args == args
    with pytest.raises(ModelConfigError, match=r"flavor '16B': .*expected \[2048\]"):
        make_adapter(flavor="16B", tensor_shapes=shapes)
    recorded = dataclasses.asdict(dataclasses.replace(args, q_lora_rank=64))
    with pytest.raises(ModelConfigError, match=r"wq_a\.weight: missing"):
        make_adapter(model_args=recorded, tensor_shapes=shapes)


def test_bad_requests_are_refused():
    with pytest.raises(ModelConfigError, match="flavor= or hf_config=, not both"):
        make_adapter(flavor="16B", hf_config={})
    with pytest.raises(ModelConfigError, match="needs model_args="):
        make_adapter()
    with pytest.raises(ModelConfigError, match="contradicts the model args recorded"):
        make_adapter(model_args=tiny_args(), overrides={"dim": 64})
    adapter = make_adapter(model_args=tiny_args())
    with pytest.raises(KeyError, match=r"layers\.0\.attention\.wk\.weight"):
        adapter.to_hf({"layers.0.attention.wk.weight": torch.zeros(1)})
    hf = adapter.to_hf(our_model(tiny_args()).state_dict())
    del hf["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ModelConfigError, match="layer 2 up_proj: 1 of 8 experts missing"):
        adapter.from_hf(hf)


def test_multi_token_prediction_layers_are_dropped():
    args = tiny_args()
    adapter = make_adapter(model_args=args)
    hf = adapter.to_hf(our_model(args).state_dict())
    mtp = {k.replace("layers.2.", "layers.3."): v for k, v in hf.items() if ".layers.2." in k}
    assert adapter.from_hf({**hf, **mtp}).keys() == adapter.from_hf(hf).keys()


def test_torchtitans_rope_table_is_dropped_and_meta_tensors_convert():
    args = tiny_args(load_balance_coeff=None)
    state_dict = our_model(args).state_dict()
    assert not any(k.endswith("expert_bias") or k.endswith("tokens_per_expert") for k in state_dict)
    with_table = {**state_dict, "freqs_cis": torch.zeros(64, 4, dtype=torch.complex64)}
    adapter = make_adapter(
        model_args=args, tensor_shapes={k: v.shape for k, v in with_table.items()}
    )
    hf = adapter.to_hf(with_table)
    # HF's router always has the selection bias: a zero one stands in for none.
    assert not hf["model.layers.1.mlp.gate.e_score_correction_bias"].any()
    assert adapter.from_hf(hf).keys() == state_dict.keys()
    # titan-ckpt plans a conversion on meta tensors first: same keys and shapes.
    meta = {k: torch.empty_like(v, device="meta") for k, v in hf.items()}
    planned = dict(adapter.from_hf_items(meta.items()))
    assert {k: v.shape for k, v in planned.items()} == {k: v.shape for k, v in state_dict.items()}
    hf["model.layers.1.mlp.gate.e_score_correction_bias"] += 1.0
    with pytest.raises(ModelConfigError, match=r"expert_bias is nonzero.*load_balance_coeff"):
        adapter.from_hf(hf)
