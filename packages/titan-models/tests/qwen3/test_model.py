"""Qwen3: names and shapes against torchtitan's Qwen3 (read from its source at the commit
that graduated it, d880de214, October 2025: the July 2025 working copy has no Qwen3), tied
embeddings through materialization, loading and pipeline stages, the half-split RoPE against
Llama 3's interleaved one, initialization, and gradients. Logits and gradients against
transformers' models are in test_adapter.py."""

from __future__ import annotations

import math

import pytest
import torch

from titan_models.llama3.model import apply_rope, rope_table
from titan_models.qwen3.args import Qwen3Args, qwen3_args
from titan_models.qwen3.model import Qwen3


def tiny(**overrides) -> Qwen3Args:
    fields = {
        "dim": 32,
        "n_layers": 3,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "hidden_dim": 48,
        "vocab_size": 64,
        "max_seq_len": 32,
        "moe_inter_dim": 16,
        "num_experts": 4,
        "top_k": 2,
    }
    return Qwen3Args(**{**fields, **overrides})


def meta_model(args: Qwen3Args) -> Qwen3:
    with torch.device("meta"):
        return Qwen3(args)


def materialized(args: Qwen3Args, seed: int = 0) -> Qwen3:
    model = meta_model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


# torchtitan's Qwen3 (torchtitan/models/qwen3/model/model.py and state_dict_adapter.py at
# d880de214): block entries, and its MoE's (torchtitan/models/moe.py) with shapes.
TORCHTITAN_BLOCK = {
    "attention.wq.weight": lambda a: (a.n_heads * a.head_dim, a.dim),
    "attention.wk.weight": lambda a: (a.n_kv_heads * a.head_dim, a.dim),
    "attention.wv.weight": lambda a: (a.n_kv_heads * a.head_dim, a.dim),
    "attention.wo.weight": lambda a: (a.dim, a.n_heads * a.head_dim),
    "attention.q_norm.weight": lambda a: (a.head_dim,),
    "attention.k_norm.weight": lambda a: (a.head_dim,),
    "attention_norm.weight": lambda a: (a.dim,),
    "ffn_norm.weight": lambda a: (a.dim,),
}
TORCHTITAN_DENSE = {
    "feed_forward.w1.weight": lambda a: (a.hidden_dim, a.dim),
    "feed_forward.w2.weight": lambda a: (a.dim, a.hidden_dim),
    "feed_forward.w3.weight": lambda a: (a.hidden_dim, a.dim),
}
TORCHTITAN_MOE = {
    "moe.router.gate.weight": lambda a: (a.num_experts, a.dim),
    "moe.experts.w1": lambda a: (a.num_experts, a.dim, a.moe_inter_dim),
    "moe.experts.w2": lambda a: (a.num_experts, a.moe_inter_dim, a.dim),
    "moe.experts.w3": lambda a: (a.num_experts, a.dim, a.moe_inter_dim),
    "moe.expert_bias": lambda a: (a.num_experts,),
    "moe.tokens_per_expert": lambda a: (a.num_experts,),
}


@pytest.mark.parametrize("flavor", ["0.6B", "8B", "30B-A3B"])
def test_names_and_shapes_are_torchtitans(flavor):
    args = qwen3_args(flavor)
    block = {**TORCHTITAN_BLOCK, **(TORCHTITAN_MOE if args.moe_enabled else TORCHTITAN_DENSE)}
    expected = {
        "tok_embeddings.weight": (args.vocab_size, args.dim),
        "norm.weight": (args.dim,),
        "output.weight": (args.vocab_size, args.dim),
    }
    for i in range(args.n_layers):
        expected.update({f"layers.{i}.{k}": shape(args) for k, shape in block.items()})
    got = {k: tuple(v.shape) for k, v in meta_model(args).state_dict().items()}
    assert got == expected


def test_tied_output_is_the_embedding_through_to_empty_init_and_load():
    args = tiny(enable_weight_tying=True)
    model = materialized(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == len(model.state_dict()) - 1
    # Loading a state dict (both keys, as ours and torchtitan's have) keeps the tie.
    other = materialized(args, seed=1).state_dict()
    model.load_state_dict(other)
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.output.weight, other["tok_embeddings.weight"])
    # One gradient, the sum of both uses.
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    assert model.tok_embeddings.weight.grad is model.output.weight.grad


def test_untied_output_is_its_own_matrix():
    model = materialized(tiny())
    assert model.output.weight is not model.tok_embeddings.weight
    assert not torch.equal(model.output.weight, model.tok_embeddings.weight)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("moe", [True, False])
def test_pipeline_stages_compose(tied, moe):
    args = tiny(enable_weight_tying=tied, moe_enabled=moe)
    model = materialized(args).eval()
    x = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        logits = model(x)
    # Two stages made as a pipeline split makes them: delete blocks, drop the ends.
    first, second = materialized(args), materialized(args)
    del first.layers["2"]
    first.norm = first.output = None
    del second.layers["0"], second.layers["1"]
    second.tok_embeddings = None
    # A stage with one end keeps that end's weight (tied: the same values at both ends).
    assert "output.weight" not in first.state_dict()
    assert "tok_embeddings.weight" not in second.state_dict()
    second.init_weights()  # re-tying has nothing to tie; the output keeps its init
    first.eval(), second.eval()
    for stage in (first, second):
        stage.load_state_dict(
            {k: v for k, v in model.state_dict().items() if k in stage.state_dict()}
        )
    with torch.no_grad():
        torch.testing.assert_close(second(first(x)), logits, rtol=0, atol=0)


def test_half_split_rope_is_interleaved_rope_on_permuted_channels():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8)
    table = rope_table(8, 5, 1e6)
    # Channel i pairs with i + 4 in the half-split layout, with 2i + 1 in the interleaved one.
    to_interleaved = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    interleaved = apply_rope(x[..., to_interleaved], table)
    half = apply_rope(x, table, half_split=True)
    torch.testing.assert_close(half[..., to_interleaved], interleaved, rtol=1e-6, atol=1e-6)
    # transformers' rotate_half formula, as Qwen3 (and torchtitan's Qwen3) computes it.
    angles = torch.outer(torch.arange(5.0), 1e6 ** -(torch.arange(0, 8, 2) / 8))
    cos, sin = (
        torch.cat([angles.cos()] * 2, -1)[:, None],
        torch.cat([angles.sin()] * 2, -1)[:, None],
    )
    rotated = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    torch.testing.assert_close(half, x * cos + rotated * sin, rtol=1e-5, atol=1e-5)


def test_qk_norm_normalizes_each_head_before_rope():
    args = tiny()
    model = materialized(args)
    attention = model.layers["0"].attention
    captured = {}
    attention.inner_attention.register_forward_pre_hook(
        lambda _, inputs: captured.update(q=inputs[0])
    )
    with torch.no_grad():
        attention.q_norm.weight.fill_(2.0)
        model(torch.randint(0, 64, (1, 6)))
    # RoPE rotates pairs (keeps each pair's norm): every head's query has rms 2.
    rms = captured["q"].pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.full_like(rms, 2.0), rtol=1e-4, atol=1e-4)


def test_init_weights_is_seeded_and_depth_scaled():
    args = tiny(n_layers=4, moe_enabled=True)
    a, b = materialized(args, seed=3), materialized(args, seed=3)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert a.layers["0"].init_std == pytest.approx(0.02 / math.sqrt(2))
    stds = [a.layers[str(i)].attention.wo.weight.std().item() for i in range(4)]
    assert stds[0] > stds[3]
    assert torch.equal(a.rope, rope_table(16, 32, 1e6))
    assert not a.layers["1"].moe.expert_bias.any()
    assert torch.equal(a.layers["2"].attention.k_norm.weight, torch.ones(16))


def test_backward_reaches_every_parameter():
    args = tiny(moe_enabled=True, top_k=4, enable_weight_tying=True)  # every expert used
    model = materialized(args)
    model(torch.randint(0, args.vocab_size, (2, 16))).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


def test_sequence_longer_than_the_rope_table_is_refused():
    model = materialized(tiny(max_seq_len=8))
    with pytest.raises(ValueError, match="exceeds the RoPE table's 8 positions"):
        model(torch.zeros(1, 9, dtype=torch.long))
