"""MoE numerics that a GPU run depends on, checked on CPU: under bf16 autocast the routed
experts compute in bf16 (explicit casts; autocast has no rule for ``_grouped_mm`` and would
leave fp32 inputs in fp32) and the router's gate in fp32; expert token counts are exact
integers past 2^24 and a checkpoint with the former fp32 counts still loads (by
``load_state_dict`` and by DCP)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.nn import functional

from titan_models.moe import (
    GroupedExperts,
    MoE,
    MoEArgs,
    TokenChoiceTopKRouter,
    grouped_mm_supported,
    run_experts_fallback,
    run_experts_grouped_mm,
    update_expert_bias,
)

DIM, HIDDEN, EXPERTS = 16, 32, 4
BF16 = torch.bfloat16


def experts_and_rows(seed: int = 0) -> tuple[GroupedExperts, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    experts = GroupedExperts(DIM, HIDDEN, EXPERTS)
    experts.init_weights(init_std=0.5)
    counts = torch.tensor([5, 0, 7, 4])  # one expert without tokens
    return experts, torch.randn(int(counts.sum()), DIM), counts


@pytest.mark.skipif(not grouped_mm_supported("cpu", BF16), reason="no bf16 grouped mm here")
def test_grouped_mm_under_autocast_computes_in_the_autocast_dtype():
    experts, x, counts = experts_and_rows()
    x.requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        out = experts(x, counts)
    weights = [w.detach().to(BF16) for w in (experts.w1, experts.w2, experts.w3)]
    expected = run_experts_grouped_mm(*weights, x.detach().to(BF16), counts).float()
    assert out.dtype == torch.float32  # back in the input's dtype, as torchtitan returns it
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # The fp32 computation differs from it by bf16 rounding: the test can tell them apart.
    fp32 = run_experts_grouped_mm(experts.w1, experts.w2, experts.w3, x, counts)
    assert not torch.equal(out, fp32.detach())
    out.sum().backward()
    assert experts.w1.grad.dtype == torch.float32
    assert x.grad.dtype == torch.float32
    assert torch.isfinite(experts.w2.grad).all()
    assert experts.w2.grad[1].abs().sum() == 0


def test_fallback_under_autocast_computes_in_the_autocast_dtype():
    experts, x, counts = experts_and_rows(seed=1)
    experts.use_grouped_mm = False
    with torch.autocast("cpu", dtype=BF16):
        out = experts(x, counts)
    weights = [w.detach().to(BF16) for w in (experts.w1, experts.w2, experts.w3)]
    expected = run_experts_fallback(*weights, x.to(BF16), counts).float()
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=0)


def test_without_autocast_the_experts_keep_their_dtype():
    experts, x, counts = experts_and_rows(seed=2)
    out = experts(x, counts)
    expected = run_experts_fallback(experts.w1, experts.w2, experts.w3, x, counts)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def router(seed: int = 0) -> TokenChoiceTopKRouter:
    torch.manual_seed(seed)
    r = TokenChoiceTopKRouter(DIM, MoEArgs(num_experts=EXPERTS, top_k=2, score_func="softmax"))
    r.init_weights(init_std=1.0)
    return r


def fp32_scores(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return functional.softmax(functional.linear(x.float(), weight.float()), dim=-1)


def test_router_gate_runs_in_fp32_under_autocast():
    r, x = router(), torch.randn(64, DIM)
    with torch.autocast("cpu", dtype=BF16):
        routing = r(x)
    torch.testing.assert_close(routing.scores, fp32_scores(x, r.gate.weight), rtol=0, atol=0)
    # What a bf16 gate would give differs: the test tells the two apart.
    bf16 = functional.softmax(functional.linear(x.to(BF16), r.gate.weight.to(BF16)).float(), -1)
    assert not torch.equal(routing.scores, bf16.detach())


def test_router_gate_runs_in_fp32_with_bf16_weights():
    """FSDP with ``param_dtype=bfloat16`` hands the router bf16 weights and inputs."""
    r, x = router(seed=1).to(BF16), torch.randn(64, DIM).to(BF16)
    routing = r(x)
    assert routing.scores.dtype == torch.float32
    torch.testing.assert_close(routing.scores, fp32_scores(x, r.gate.weight), rtol=0, atol=0)


def make_moe() -> MoE:
    moe = MoE(MoEArgs(num_experts=EXPERTS, top_k=2), dim=DIM, hidden_dim=HIDDEN)
    torch.manual_seed(0)
    moe.init_weights(init_std=0.1)
    return moe


def test_token_counts_are_int64_and_exact_past_2_to_the_24():
    moe = make_moe()
    assert moe.tokens_per_expert.dtype == torch.int64
    big = 2**24
    moe.tokens_per_expert.fill_(big)
    moe(torch.randn(1, 3, DIM))  # 3 tokens, 6 slots
    assert moe.tokens_per_expert.sum().item() == EXPERTS * big + 6
    assert (moe.tokens_per_expert - big).sum().item() == 6


def test_bias_update_sees_a_one_token_difference_at_2_to_the_25():
    moe = make_moe()
    moe.load_balance_coeff = 1.0
    # Above fp32's exact range, mean - n would round to 0 for the last two experts.
    moe.tokens_per_expert.copy_(torch.tensor([2**25 + 2, 2**25 + 2, 2**25 - 1, 2**25 - 3]))
    update_expert_bias(moe)
    assert moe.expert_bias.tolist() == [-1.0, -1.0, 1.0, 1.0]
    assert moe.tokens_per_expert.dtype == torch.int64
    assert not moe.tokens_per_expert.any()


def old_state_dict(moe: MoE) -> dict[str, torch.Tensor]:
    """The state dict as titan wrote it before (and torchtitan writes it): fp32 counts."""
    state = {k: v.clone() for k, v in moe.state_dict().items()}
    state["tokens_per_expert"] = torch.tensor([3.0, 2.0**24, 0.0, 5.0])
    return state


def test_fp32_counts_of_an_old_checkpoint_load_as_int64():
    moe = make_moe()
    moe.load_state_dict(old_state_dict(moe))
    assert moe.tokens_per_expert.dtype == torch.int64
    assert moe.tokens_per_expert.tolist() == [3, 2**24, 0, 5]


def test_fp32_counts_of_an_old_dcp_checkpoint_load_as_int64(tmp_path):
    moe = make_moe()
    dcp.save(old_state_dict(moe), checkpoint_id=str(tmp_path), no_dist=True)
    target = moe.state_dict()
    dcp.load(target, checkpoint_id=str(tmp_path), no_dist=True)
    moe.load_state_dict(target)
    assert moe.tokens_per_expert.dtype == torch.int64
    assert moe.tokens_per_expert.tolist() == [3, 2**24, 0, 5]
