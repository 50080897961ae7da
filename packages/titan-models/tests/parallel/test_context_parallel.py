"""Which context-parallel attention runs where, checked before any work: ``auto`` is torch's
on CUDA and ours elsewhere, torch's is refused on CPU with the device and the choices named,
and torch's attention refuses to run outside ``context_parallel_batch``; torch's
load-balanced shards are ours (checked against torch's own load balancer). That our
attentions equal plain attention and train like one process is checked under torchrun in
tests/llama3/test_parallelize.py; torch's own ring attention needs CUDA and is not run
here."""

from __future__ import annotations

import pytest
import torch

from titan_dims import ParallelDims
from titan_models import ModelConfigError, ParallelizeConfig, context_parallel_batch
from titan_models.parallel import (
    TorchContextParallelAttention,
    context_parallel_positions,
    resolve_cp_attention,
)


@pytest.mark.parametrize(
    ("choice", "device_type", "expected"),
    [
        ("auto", "cuda", "torch"),
        ("auto", "cpu", "titan"),
        ("auto", "xpu", "titan"),
        ("titan", "cuda", "titan"),
        ("titan", "cpu", "titan"),
        ("torch", "cuda", "torch"),
        ("titan_ring", "cpu", "titan_ring"),
        ("titan_ring", "cuda", "titan_ring"),
    ],
)
def test_cp_attention_per_device(choice, device_type, expected):
    assert resolve_cp_attention(choice, device_type) == expected


@pytest.mark.parametrize("device_type", ["cpu", "mps"])
def test_torch_cp_attention_is_refused_off_cuda(device_type):
    match = (
        rf"cp_attention='torch' cannot run on device '{device_type}'.*"
        r"'auto', 'titan', 'titan_ring', 'torch'"
    )
    with pytest.raises(ModelConfigError, match=match):
        resolve_cp_attention("torch", device_type)


def test_unknown_cp_attention_is_refused():
    with pytest.raises(ModelConfigError, match="cp_attention='ring' is not allowed"):
        resolve_cp_attention("ring", "cuda")


def test_batch_without_context_parallel_is_unchanged():
    inputs, labels = torch.arange(12).view(2, 6), torch.arange(12, 24).view(2, 6)
    dims = ParallelDims(world_size=1)
    with context_parallel_batch(inputs, labels, parallel_dims=dims, config=ParallelizeConfig()) as (
        x,
        y,
    ):
        assert x is inputs
        assert y is labels


@pytest.mark.parametrize(
    ("config", "seq_len", "error", "match"),
    [
        (
            ParallelizeConfig(cp_attention="torch"),
            8,
            ModelConfigError,
            "cp_attention='torch' cannot run on device 'cpu'",
        ),
        (ParallelizeConfig(), 6, ValueError, r"seq_len=6 must be divisible by 2 x cp = 4"),
    ],
)
def test_batch_is_checked_before_any_communication(config, seq_len, error, match):
    # No process group exists: reaching for the cp mesh would raise a different error.
    dims = ParallelDims(world_size=2, cp=2, device_type="cpu")
    tokens = torch.zeros(2, seq_len, dtype=torch.long)
    batch = context_parallel_batch(tokens, tokens, parallel_dims=dims, config=config)
    with pytest.raises(error, match=match), batch:
        pass


def test_torch_attention_refuses_to_run_outside_its_context():
    """Outside torch's context its SDPA is not sharded: each rank would attend only to its
    own shard and train on silently wrong attention."""
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match=r"inside titan_models\.context_parallel_batch"):
        TorchContextParallelAttention()(q, kv, kv)


@pytest.mark.parametrize(("seq_len", "cp"), [(16, 2), (32, 4), (24, 3)])
def test_our_shards_are_torchs_load_balanced_shards(seq_len, cp):
    """torch's context_parallel shards the batch with its head-tail load balancer; our RoPE
    hook (used with every cp_attention) assumes it puts the same positions on each rank."""
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    order = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0]
    for rank, share in enumerate(order.chunk(cp)):
        assert share.tolist() == context_parallel_positions(seq_len, rank, cp).tolist()


def test_torchs_attention_runs_only_the_kernels_torchs_context_parallel_shards(monkeypatch):
    """Inside torch's context parallel, SDPA must not fall back to the math kernel (it would
    attend over the permuted sequence unsharded): the attention restricts SDPA to flash,
    efficient and cuDNN. On CPU the flash kernel serves, with causal attention's result."""
    import torch
    from torch.nn import functional

    from titan_models.parallel.context_parallel import TorchContextParallelAttention

    monkeypatch.setattr(TorchContextParallelAttention, "open_contexts", 1)
    chosen = []
    real = torch.nn.attention.sdpa_kernel

    def recording(backends, *args, **kwargs):
        chosen.append(sorted(b.name for b in backends))
        return real(backends, *args, **kwargs)

    monkeypatch.setattr("titan_models.parallel.context_parallel.sdpa_kernel", recording)
    q, k, v = (
        torch.randn(1, 4, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    out = TorchContextParallelAttention()(q, k, v)
    assert chosen == [["CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION"]]
    expected = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)


def test_positions_are_made_where_they_are_used():
    """On an accelerator a host tensor copied over waits for the stream: the positions (and
    the masks built from them) are created on the requested device. The meta device shows
    it without a GPU."""
    import torch

    from titan_models.parallel import context_parallel_positions

    positions = context_parallel_positions(16, 1, 2, device="meta")
    assert positions.device.type == "meta"
    assert context_parallel_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(
        context_parallel_positions(16, 0, 2), torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    )
