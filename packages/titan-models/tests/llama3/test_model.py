"""The Llama 3 module: meta-device construction and init, RoPE, pipeline-style layer deletion,
and that a few optimizer steps on CPU reduce the loss."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional

from titan_models.llama3 import Llama3, Llama3Args, RopeScaling, llama3_args
from titan_models.llama3.model import apply_rope, rope_table

TORCHTITAN_NAMES = {
    "tok_embeddings.weight",
    "norm.weight",
    "output.weight",
    *(
        f"layers.{i}.{name}.weight"
        for i in range(6)
        for name in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
            "attention_norm",
            "ffn_norm",
        )
    ),
}


def test_state_dict_names_equal_torchtitans():
    with torch.device("meta"):
        model = Llama3(llama3_args("debugmodel"))
    assert set(model.state_dict()) == TORCHTITAN_NAMES  # the RoPE table is not persistent


def test_meta_construction_then_init_weights():
    args = llama3_args("debugmodel", max_seq_len=64)
    with torch.device("meta"):
        model = Llama3(args)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    torch.testing.assert_close(model.rope, rope_table(16, 64, 500000.0, args.rope_scaling))
    # Output std dim^-1/2, cut at 3 sigma; embedding N(0, 1); norms start at one.
    out = model.output.weight
    assert abs(out.std().item() - 256**-0.5) < 0.1 * 256**-0.5
    assert out.abs().max().item() <= 3 * 256**-0.5 + 1e-6
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 0.05
    assert torch.equal(model.layers["3"].ffn_norm.weight, torch.ones(256))
    # Depth-scaled init: deeper output projections start smaller.
    assert model.layers["5"].attention.wo.weight.std() < model.layers["0"].attention.wo.weight.std()
    # A fresh model predicts roughly uniformly: loss near log(vocab).
    tokens = torch.randint(0, 2048, (2, 64))
    loss = functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - math.log(2048)) < 1.0


def test_init_buffers_computes_the_rope_table_alone():
    args = llama3_args("debugmodel", max_seq_len=64)
    with torch.device("meta"):
        model = Llama3(args)
    model.to_empty(device="cpu")  # the table's values are garbage now, the weights too
    before = [p.clone() for p in model.parameters()]
    model.init_buffers()
    torch.testing.assert_close(model.rope, rope_table(16, 64, 500000.0, args.rope_scaling))
    # The weights are left as they were (compared as bytes: garbage may hold NaNs).
    assert all(
        torch.equal(a.view(torch.int32), b.view(torch.int32))
        for a, b in zip(before, model.parameters(), strict=True)
    )


def test_rope_rotates_pairs_and_preserves_norms():
    table = rope_table(8, 5, 10000.0)
    x = torch.randn(1, 5, 2, 8)
    y = apply_rope(x, table)
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0: no rotation
    pair_norm = lambda t: t.unflatten(-1, (-1, 2)).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pair_norm(y), pair_norm(x))
    # Channel pair 0 of position 3 turns by 3 radians (inverse frequency 1).
    angle = torch.atan2(y[0, 3, 0, 1], y[0, 3, 0, 0]) - torch.atan2(x[0, 3, 0, 1], x[0, 3, 0, 0])
    assert math.isclose(math.remainder(angle.item() - 3.0, 2 * math.pi), 0.0, abs_tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_traced_path_equals_eager_path_forward_and_backward(dtype):
    # Under torch.compile apply_rope takes real arithmetic (inductor fuses it), in eager a
    # complex multiply; both must rotate identically. backend="eager" runs the traced path
    # without inductor.
    table = rope_table(16, 32, 500000.0)
    x = torch.randn(2, 32, 4, 16, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 32, 4, 16, dtype=dtype)
    eager = apply_rope(x, table)
    (eager_grad,) = torch.autograd.grad(eager, x, grad)
    traced = torch.compile(apply_rope, backend="eager", fullgraph=True)(x, table)
    (traced_grad,) = torch.autograd.grad(traced, x, grad)
    assert torch.equal(traced, eager)
    torch.testing.assert_close(traced_grad, eager_grad, rtol=0, atol=1e-6)


def test_llama31_scaling_slows_only_low_frequencies():
    plain = rope_table(128, 2, 500000.0)[1, :, 1].asin()  # angle at position 1 = inv_freq
    scaled = rope_table(128, 2, 500000.0, RopeScaling())[1, :, 1].asin()
    torch.testing.assert_close(scaled[:10], plain[:10])  # short wavelengths kept
    torch.testing.assert_close(scaled[-10:], plain[-10:] / 8)  # long ones divided by factor


def test_layers_can_be_deleted_like_a_pipeline_stage(tiny):
    model = Llama3(tiny.tiny_args())
    model.load_state_dict(tiny.reference_state_dict())
    tokens = torch.randint(0, 256, (2, 32))
    full = model(tokens)
    # Stage 0: embedding + layer 0; stage 1: layer 1 + norm + output.
    first = Llama3(tiny.tiny_args())
    first.load_state_dict(tiny.reference_state_dict())
    del first.layers["1"]
    first.norm = first.output = None
    second = Llama3(tiny.tiny_args())
    second.load_state_dict(tiny.reference_state_dict())
    del second.layers["0"]
    second.tok_embeddings = None
    assert set(second.state_dict()) == {n for n in model.state_dict() if "layers.0." not in n} - {
        "tok_embeddings.weight"
    }
    torch.testing.assert_close(second(first(tokens)), full)


def test_training_steps_on_cpu_reduce_the_loss(tiny):
    torch.manual_seed(0)
    model = Llama3(tiny.tiny_args())
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, labels = tiny.batches()
    losses = []
    for _ in range(8):
        loss = tiny.cross_entropy(model(inputs[0]), labels[0])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_gqa_matches_explicitly_repeated_heads():
    torch.manual_seed(0)
    gqa = Llama3(
        Llama3Args(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=16, max_seq_len=8)
    )
    gqa.init_weights()
    mha = Llama3(Llama3Args(dim=32, n_layers=1, n_heads=4, vocab_size=16, max_seq_len=8))
    state = gqa.state_dict()
    for name in ("wk", "wv"):
        w = state[f"layers.0.attention.{name}.weight"].view(2, 8, 32)
        state[f"layers.0.attention.{name}.weight"] = w.repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 16, (2, 8))
    torch.testing.assert_close(gqa(tokens), mha(tokens))
