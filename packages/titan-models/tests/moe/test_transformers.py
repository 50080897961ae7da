"""The MoE layer against transformers' DeepseekV3MoE built from a small config (no
download): grouped sigmoid routing with the bias picks the same experts with the same
weights bit for bit in fp32, and the layer's output equals transformers' (the DeepSeek-V3
model's logits are checked against transformers through this layer)."""

from __future__ import annotations

import pytest
import torch

from titan_models.moe import MoE, MoEArgs

transformers = pytest.importorskip("transformers")

DIM, HIDDEN = 16, 8


def pair(num_shared: int = 1, groups: int = 4, limited: int = 2, top_k: int = 3):
    config = transformers.DeepseekV3Config(
        hidden_size=DIM,
        moe_intermediate_size=HIDDEN,
        n_routed_experts=8,
        num_experts_per_tok=top_k,
        n_group=groups,
        topk_group=limited,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_shared_experts=num_shared,
    )
    reference = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(config)
    args = MoEArgs(
        num_experts=8,
        num_shared_experts=num_shared,
        top_k=top_k,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        n_expert_groups=groups,
        n_limited_groups=limited,
    )
    moe = MoE(args, dim=DIM, hidden_dim=HIDDEN)
    torch.manual_seed(0)
    moe.init_weights(0.2)
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 1.0)
        moe.expert_bias.copy_(torch.randn(8) * 0.3)
        reference.gate.weight.copy_(moe.router.gate.weight)
        reference.gate.e_score_correction_bias.copy_(moe.expert_bias)
        experts = moe.experts
        gate_up = torch.cat((experts.w1, experts.w3), dim=2).transpose(1, 2)
        reference.experts.gate_up_proj.copy_(gate_up)
        reference.experts.down_proj.copy_(experts.w2.transpose(1, 2))
        shared, mlp = moe.shared_expert, reference.shared_experts
        mlp.gate_proj.weight.copy_(shared.w1[0].T)
        mlp.up_proj.weight.copy_(shared.w3[0].T)
        mlp.down_proj.weight.copy_(shared.w2[0].T)
    return moe, reference


@pytest.mark.parametrize(("groups", "limited", "top_k"), [(4, 2, 3), (4, 1, 2), (1, 1, 4)])
def test_routing_is_transformers_bit_for_bit(groups, limited, top_k):
    moe, reference = pair(groups=groups, limited=limited, top_k=top_k)
    x = torch.randn(64, DIM)
    _, ref_weights, ref_experts = reference.gate(x)
    routing = moe.router(x, moe.expert_bias)
    order = ref_experts.argsort(dim=-1)
    assert torch.equal(routing.experts, ref_experts.gather(1, order))
    assert torch.equal(routing.weights, ref_weights.gather(1, order))


def test_layer_output_equals_transformers():
    moe, reference = pair()
    x = torch.randn(2, 9, DIM)
    with torch.no_grad():
        expected = reference(x)
    torch.testing.assert_close(moe(x), expected, rtol=1e-6, atol=1e-7)
