"""The MoE layer: every expert receives exactly the tokens the router sent it; grouped
matmuls, the per-expert fallback and a naive per-token loop give equal outputs and
gradients; token counts survive activation checkpointing's recomputation uncounted; the
sequence balance loss reaches the gradients as autograd of the explicit loss would; names
and shapes are torchtitan's; and the layer equals transformers' DeepseekV3MoE (the
numerical reference the DeepSeek-V3 model is checked against)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

from titan_models.moe import (
    MoE,
    MoEArgs,
    grouped_mm_supported,
    run_experts_grouped_mm,
    run_experts_loop,
    run_experts_padded,
)

DIM, HIDDEN = 16, 32


def assert_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to fp32 rounding whichever kernels the CPU's matmul library picks for each
    shape (they differ between CPUs: an AMD EPYC's differ from an Intel Xeon's): within
    1e-5 relative, or 1e-6 of the tensor's largest magnitude (an element that is a nearly
    cancelling sum is small, but carries the rounding of its large terms)."""
    scale = float(expected.abs().max()) or 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * scale)


def make_moe(seed: int = 0, **fields) -> MoE:
    fields = {"num_experts": 8, "top_k": 2, "score_func": "sigmoid", **fields}
    moe = MoE(MoEArgs(**fields), dim=DIM, hidden_dim=HIDDEN)
    torch.manual_seed(seed)
    moe.init_weights(init_std=0.1)
    with torch.no_grad():  # larger gate weights: routing that differs per token
        moe.router.gate.weight.normal_(0, 1.0)
    return moe


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return (functional.silu(x @ w1) * (x @ w3)) @ w2


def per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer one token and one chosen expert at a time, from the router's decisions."""
    tokens = x.reshape(-1, DIM)
    routing = moe.router(tokens, moe.expert_bias)
    rows = []
    for t in range(tokens.shape[0]):
        out = torch.zeros(DIM)
        for expert, weight in zip(routing.experts[t].tolist(), routing.weights[t], strict=True):
            w = moe.experts
            out = out + weight * swiglu(tokens[t], w.w1[expert], w.w2[expert], w.w3[expert])
        if moe.shared_expert is not None:
            s = moe.shared_expert
            out = out + swiglu(tokens[t], s.w1[0], s.w2[0], s.w3[0])
        rows.append(out)
    return torch.stack(rows).view_as(x)


def test_every_expert_receives_exactly_the_tokens_the_router_sent():
    moe = make_moe()
    x = torch.randn(2, 6, DIM)
    seen = {}
    moe.experts.register_forward_hook(
        lambda mod, args, out: seen.update(rows=args[0], counts=args[1])
    )
    moe(x)
    routing = moe.router(x.reshape(-1, DIM), moe.expert_bias)
    start = 0
    for expert in range(8):
        sent = [t for t in range(12) if expert in routing.experts[t].tolist()]
        assert seen["counts"][expert].item() == len(sent)
        rows = seen["rows"][start : start + len(sent)]
        torch.testing.assert_close(rows, x.reshape(-1, DIM)[sent], rtol=0, atol=0)
        start += len(sent)
    assert start == 12 * 2
    assert moe.tokens_per_expert.tolist() == seen["counts"].float().tolist()


@pytest.mark.parametrize("shared", [0, 1, 2])
def test_grouped_mm_fallback_and_per_token_loop_agree(shared):
    torch.manual_seed(1)
    x = torch.randn(3, 5, DIM)
    results = []
    for use_grouped_mm in (True, False, None):
        moe = make_moe(num_shared_experts=shared, use_grouped_mm=bool(use_grouped_mm))
        xi = x.clone().requires_grad_()
        out = moe(xi) if use_grouped_mm is not None else per_token_reference(moe, xi)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        grads = [xi.grad] + [p.grad for p in moe.parameters()]
        results.append((out.detach(), grads))
    (grouped, g_grads), (loop, l_grads), (naive, n_grads) = results
    # Grouped mm and the fallback: the same per-expert products; the fallback's padded
    # batched matmul may pick another kernel for its shapes, so equal to fp32 rounding.
    assert_rounding(grouped, loop)
    for a, b in zip(g_grads, l_grads, strict=True):
        assert_rounding(a, b)
    # The per-token loop adds in another order: equal to rounding.
    assert_rounding(grouped, naive)
    for a, b in zip(g_grads, n_grads, strict=True):
        assert_rounding(a, b)


def test_expert_kernels_agree_with_empty_and_full_experts():
    assert grouped_mm_supported("cpu", torch.float32)
    torch.manual_seed(2)
    w1, w3 = torch.randn(4, DIM, HIDDEN), torch.randn(4, DIM, HIDDEN)
    w2 = torch.randn(4, HIDDEN, DIM)
    counts = torch.tensor([0, 5, 0, 3])
    x = torch.randn(8, DIM)
    expected = torch.cat([swiglu(x[:5], w1[1], w2[1], w3[1]), swiglu(x[5:], w1[3], w2[3], w3[3])])
    grads = []
    for run in (run_experts_grouped_mm, run_experts_loop, run_experts_padded):
        inputs = [t.clone().requires_grad_() for t in (w1, w2, w3, x)]
        out = run(*inputs, counts)
        torch.testing.assert_close(out, expected, msg=run.__name__)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        grads.append([t.grad for t in inputs])
    # The same per-expert products: the slice loop bit for bit (torch's CPU grouped mm runs
    # each group's plain matmul), the padded batch to rounding (its own matmul kernel).
    for other, exact in zip(grads[1:], (True, False), strict=True):
        for a, b in zip(grads[0], other, strict=True):
            if exact:
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            else:
                assert_rounding(a, b)
    # No tokens at all (an expert-parallel rank may receive none): an empty result whose
    # backward still reaches every weight.
    weights = [w.clone().requires_grad_() for w in (w1, w2, w3)]
    empty = run_experts_loop(*weights, torch.zeros(0, DIM), torch.zeros(4, dtype=torch.long))
    empty.sum().backward()
    assert empty.shape == (0, DIM)
    assert all(w.grad.abs().sum() == 0 for w in weights)


def test_unaligned_shapes_fall_back_and_agree():
    # hidden 12: fp32 rows of 48 bytes are 16-byte aligned, dim 6 (24 bytes) is not.
    moe_args = MoEArgs(num_experts=4, top_k=2)
    torch.manual_seed(3)
    grouped = MoE(moe_args, dim=6, hidden_dim=12)
    grouped.init_weights(0.1)
    loop = MoE(MoEArgs(num_experts=4, top_k=2, use_grouped_mm=False), dim=6, hidden_dim=12)
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(grouped(x), loop(x), rtol=0, atol=0)


def test_counts_are_not_doubled_by_activation_checkpointing():
    x = torch.randn(2, 7, DIM)
    counts = []
    for use_checkpoint in (False, True):
        moe = make_moe()
        xi = x.clone().requires_grad_()
        out = checkpoint(moe, xi, use_reentrant=False) if use_checkpoint else moe(xi)
        out.sum().backward()
        counts.append(moe.tokens_per_expert.clone())
        assert xi.grad is not None
    assert counts[0].sum() == 2 * 7 * 2
    torch.testing.assert_close(counts[0], counts[1], rtol=0, atol=0)
    # Evaluation does not count.
    with torch.no_grad():
        moe(x)
    torch.testing.assert_close(moe.tokens_per_expert, counts[1], rtol=0, atol=0)


def explicit_balance_loss(moe: MoE, x: torch.Tensor, alpha: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss written out per sequence and expert."""
    batch, seq_len, _ = x.shape
    losses = []
    for b in range(batch):
        routing = moe.router(x[b], moe.expert_bias)
        scores = routing.scores / routing.scores.sum(dim=-1, keepdim=True)
        loss = 0.0
        for expert in range(moe.num_experts):
            chosen = (routing.experts == expert).any(dim=-1).sum().item()
            f = moe.num_experts / (moe.top_k * seq_len) * chosen
            loss = loss + f * scores[:, expert].mean()
        losses.append(loss)
    return alpha * torch.stack(losses).mean()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_gradient_equals_autograd_of_the_explicit_loss(score_func):
    torch.manual_seed(4)
    x = torch.randn(3, 5, DIM)
    grad = torch.randn(3, 5, DIM)
    with_aux = make_moe(score_func=score_func, aux_loss_alpha=0.5)
    xa = x.clone().requires_grad_()
    with_aux(xa).backward(grad)
    plain = make_moe(score_func=score_func)
    xp = x.clone().requires_grad_()
    out = plain(xp)
    aux = explicit_balance_loss(plain, xp, 0.5)
    ((out * grad).sum() + aux).backward()
    torch.testing.assert_close(with_aux.aux_loss, aux.detach(), rtol=1e-6, atol=0)
    assert with_aux.router.gate.weight.grad.abs().sum() > 0
    torch.testing.assert_close(xa.grad, xp.grad, rtol=1e-5, atol=1e-7)
    for (name, a), b in zip(with_aux.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    # Without the loss the router's gradient differs: the test can see the aux term.
    no_aux = make_moe(score_func=score_func)
    no_aux(x.clone().requires_grad_()).backward(grad)
    assert not torch.allclose(no_aux.router.gate.weight.grad, with_aux.router.gate.weight.grad)


def test_names_shapes_and_persistence_are_torchtitans():
    moe = MoE(MoEArgs(num_experts=8, num_shared_experts=2), dim=DIM, hidden_dim=HIDDEN)
    shapes = {name: tuple(t.shape) for name, t in moe.state_dict().items()}
    assert shapes == {
        "expert_bias": (8,),
        "tokens_per_expert": (8,),
        "router.gate.weight": (8, DIM),
        "experts.w1": (8, DIM, HIDDEN),
        "experts.w2": (8, HIDDEN, DIM),
        "experts.w3": (8, DIM, HIDDEN),
        "shared_expert.w1": (1, DIM, 2 * HIDDEN),
        "shared_expert.w2": (1, 2 * HIDDEN, DIM),
        "shared_expert.w3": (1, DIM, 2 * HIDDEN),
    }
    bare = MoE(MoEArgs(num_shared_experts=0, load_balance_coeff=None), dim=DIM, hidden_dim=HIDDEN)
    assert bare.shared_expert is None
    assert bare.expert_bias is None
    assert set(bare.state_dict()) == {
        "router.gate.weight",
        "experts.w1",
        "experts.w2",
        "experts.w3",
    }


def test_init_weights_materializes_buffers_on_the_given_device():
    with torch.device("meta"):
        moe = MoE(MoEArgs(), dim=DIM, hidden_dim=HIDDEN)
    moe.to_empty(device="cpu")
    moe.init_weights(0.02, buffer_device=torch.device("cpu"))
    assert moe.expert_bias.device.type == "cpu"
    assert moe.expert_bias.abs().sum() == 0
    assert moe.tokens_per_expert.abs().sum() == 0
    assert 0.015 < moe.experts.w1.std().item() < 0.025


@pytest.mark.full  # compile on CPU (~30 s); CI compiles in test_inductor_compiled_loss_equals...
def test_compiled_layer_equals_eager():
    # torch.compile traces _grouped_mm through its meta kernel (bf16 only in torch 2.13), so
    # a compiled fp32 layer on CPU takes the fallback; results, gradients and counts agree.
    torch.manual_seed(5)
    x = torch.randn(2, 8, DIM)
    eager, compiled = make_moe(aux_loss_alpha=0.01), make_moe(aux_loss_alpha=0.01)
    for moe in (eager, torch.compile(compiled)):
        moe(x.clone().requires_grad_()).sum().backward()
    torch.testing.assert_close(compiled.tokens_per_expert, eager.tokens_per_expert)
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
