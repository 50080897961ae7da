"""DeepSeekV3: names and shapes against torchtitan's own model (recorded by
tools/torchtitan_reference/record_deepseek_v3.py into data/torchtitan_fqns.json), parameter
counts against the args, YaRN against transformers' implementation, pipeline stages, and
initialization. Logits against transformers' model are in test_adapter.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from titan_models.deepseek_v3.args import DeepSeekV3Args, deepseek_v3_args
from titan_models.deepseek_v3.model import DeepSeekV3, yarn_rope_table

TORCHTITAN = json.loads((Path(__file__).parent / "data" / "torchtitan_fqns.json").read_text())


def meta_model(args: DeepSeekV3Args) -> DeepSeekV3:
    with torch.device("meta"):
        return DeepSeekV3(args)


def tiny(**overrides) -> DeepSeekV3Args:
    fields = {
        "vocab_size": 64,
        "dim": 32,
        "inter_dim": 48,
        "moe_inter_dim": 16,
        "n_layers": 3,
        "n_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "n_activated_experts": 2,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "max_seq_len": 32,
    }
    return DeepSeekV3Args(**{**fields, **overrides})


def materialized(args: DeepSeekV3Args, seed: int = 0) -> DeepSeekV3:
    model = meta_model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.mark.parametrize("flavor", ["debugmodel", "16B", "236B", "671B"])
def test_names_and_shapes_equal_torchtitans(flavor):
    recorded = TORCHTITAN["flavors"][flavor]
    model = meta_model(deepseek_v3_args(flavor))
    parameters = {name: list(p.shape) for name, p in model.named_parameters()}
    assert parameters == recorded["parameters"]
    buffers = {k: list(v.shape) for k, v in model.state_dict().items() if k not in parameters}
    # torchtitan also saves its RoPE table (freqs_cis); ours is derived from the args and
    # stays out of checkpoints, as in titan's Llama 3 (loading ignores the extra entry).
    expected = {k: v for k, v in recorded["buffers"].items() if k != "freqs_cis"}
    assert buffers == expected
    assert "freqs_cis" in recorded["buffers"]


@pytest.mark.parametrize("flavor", ["16B", "671B"])
def test_parameter_count_equals_the_model_on_the_meta_device(flavor):
    args = deepseek_v3_args(flavor)
    model = meta_model(args)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    top_k = experts * args.n_activated_experts // args.n_routed_experts
    assert args.num_active_params() == args.num_params() - experts + top_k


def test_dense_and_moe_blocks():
    model = meta_model(deepseek_v3_args("671B"))
    assert [layer.moe_enabled for layer in list(model.layers.values())[:4]] == [0, 0, 0, 1]
    assert model.layers["2"].feed_forward.w1.weight.shape == (18432, 7168)
    assert model.layers["3"].moe.experts.w1.shape == (256, 7168, 2048)
    attention = model.layers["0"].attention
    assert attention.wq_b.weight.shape == (128 * 192, 1536)
    assert attention.wkv_a.weight.shape == (512 + 64, 7168)
    assert not hasattr(meta_model(deepseek_v3_args("16B")).layers["0"].attention, "wq_a")


@pytest.mark.parametrize(("max_seq_len", "yarn"), [(64, True), (16, False)])
def test_rope_table_equals_transformers_yarn(max_seq_len, yarn):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = tiny(max_seq_len=max_seq_len, original_seq_len=16, rope_factor=40.0, mscale=0.7)
    assert args.yarn is yarn
    rope = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16}
    config = DeepseekV3Config(
        qk_rope_head_dim=8,
        max_position_embeddings=max_seq_len,
        rope_parameters={**rope, "rope_theta": 10000.0, "mscale": 0.7, "mscale_all_dim": 0.7},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert attention_factor == 1.0  # mscale == mscale_all_dim: no rescaled rotation
    if not yarn:
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    table = yarn_rope_table(args)
    torch.testing.assert_close(table[..., 0], angles.cos(), rtol=0, atol=2e-6)
    torch.testing.assert_close(table[..., 1], angles.sin(), rtol=0, atol=2e-6)
    # transformers folds the same factor into its softmax scale.
    scale = 192**-0.5 * (0.1 * 0.7 * math.log(40) + 1) ** 2
    assert deepseek_v3_args("16B", max_seq_len=8192).softmax_scale == pytest.approx(scale)


def test_forward_and_pipeline_stages_compose():
    args = tiny(q_lora_rank=8)
    model = materialized(args)
    x = torch.randint(0, args.vocab_size, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, args.vocab_size)
    # Two stages made as a pipeline split makes them: delete blocks, drop the ends.
    first, second = materialized(args), materialized(args)
    del first.layers["2"]
    first.norm = first.output = None
    del second.layers["0"], second.layers["1"]
    second.tok_embeddings = None
    torch.testing.assert_close(second(first(x)), logits, rtol=0, atol=0)


def test_init_weights_is_seeded_and_depth_scaled():
    args = tiny(n_layers=4)
    a, b = materialized(args, seed=3), materialized(args, seed=3)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    stds = [a.layers[str(i)].attention.wo.weight.std().item() for i in range(4)]
    assert stds[0] > stds[3]
    assert a.layers["0"].init_std == pytest.approx(0.02 / math.sqrt(2))
    assert torch.equal(a.rope, yarn_rope_table(args))
    assert not a.layers["1"].moe.expert_bias.any()


def test_backward_reaches_every_parameter():
    args = tiny(q_lora_rank=8, n_activated_experts=4)  # every expert gets tokens
    model = materialized(args)
    model(torch.randint(0, args.vocab_size, (2, 16))).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


def test_latent_attention_under_context_parallel_equals_the_whole_sequence(run_torchrun, tmp_path):
    # titan's all-gather context parallel swaps inner_attention; values (12 channels) are
    # narrower than queries and keys (16), and YaRN's softmax factor rides in the queries.
    results = run_torchrun("deepseek_v3_cp.py", 2, tmp_path, timeout=120)
    assert set(results) == {"plain", "yarn"}  # yarn: max_seq_len 64 > original_seq_len 32
    for name, (out_diff, grad_diff) in results.items():
        assert out_diff < 1e-6, name
        assert grad_diff < 1e-5, name  # relative: the summed gradients are O(10-100)
