"""The per-step context of a plan, in one process: what it resolves once at plan time, what
it refuses before any work, mixed precision by autocast where FSDP does not do it, and
``reduce_loss`` / ``plain_loss`` without collectives. Under CP, TP and PP the same context
drives the integration runs (integration_tests/test_train_runs.py, equal losses across
layouts)."""

from __future__ import annotations

import pytest
import torch

from titan_dims import ParallelDims
from titan_models import ConfigError, ParallelizeConfig, plain_loss, reduce_loss, step_context
from titan_models.ops import repeat_kv


def test_without_cp_or_tp_the_context_hands_the_batch_through():
    context = step_context(ParallelDims(world_size=1, device_type="cpu"))
    assert (context.cp_attention, context.loss_parallel) == (None, False)
    inputs, labels = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    with context(inputs, labels) as (x, y):
        assert x is inputs
        assert y is labels


@pytest.mark.parametrize(
    ("choice", "expected"), [("auto", "titan"), ("titan", "titan"), ("titan_ring", "titan_ring")]
)
def test_the_cp_implementation_is_resolved_at_plan_time(choice, expected):
    dims = ParallelDims(world_size=4, cp=2, tp=2, device_type="cpu")
    context = step_context(dims, ParallelizeConfig(cp_attention=choice))
    assert context.cp_attention == expected
    assert context.loss_parallel
    assert not step_context(dims, ParallelizeConfig(loss_parallel=False)).loss_parallel


def test_plan_time_checks_raise_before_any_process_group():
    dims = ParallelDims(world_size=2, cp=2, device_type="cpu")
    with pytest.raises(ConfigError, match="cp_attention='torch' cannot run on device 'cpu'"):
        step_context(dims, ParallelizeConfig(cp_attention="torch"))
    with pytest.raises(ConfigError, match=r"training\.seq_len=6 must be divisible by 4 = "):
        step_context(dims, seq_lens={"training.seq_len": 6})


def test_reduce_loss_in_one_process_is_a_plain_copy():
    dims = ParallelDims(world_size=1, device_type="cpu")
    loss = torch.tensor(2.5)
    reduced = reduce_loss(loss, dims)
    assert reduced.item() == 2.5
    assert reduced is not loss
    with pytest.raises(ValueError, match="only pipeline ranks"):
        reduce_loss(None, dims)
    assert plain_loss(loss) is loss


def test_repeat_kv_is_repeat_interleave_of_the_heads():
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    rk, rv = repeat_kv(k, v, 3)
    assert torch.equal(rk, k.repeat_interleave(3, dim=1))
    assert torch.equal(rv[:, 3:], v[:, 1:2].expand(1, 3, 3, 4))
    assert repeat_kv(k, v, 1) == (k, v)


@pytest.mark.parametrize(
    ("degrees", "param_dtype", "expected"),
    [
        ({"world_size": 1}, "bfloat16", torch.bfloat16),  # one device: autocast
        ({"world_size": 2, "dp_replicate": 2, "dp_shard": 1}, "bfloat16", torch.bfloat16),  # DDP
        ({"world_size": 2, "tp": 2, "dp_shard": 1}, "bfloat16", torch.bfloat16),
        ({"world_size": 2, "dp_shard": 2}, "bfloat16", None),  # FSDP's policy does it
        ({"world_size": 1}, "float32", None),
    ],
)
def test_mixed_precision_without_fsdp_is_autocast(degrees, param_dtype, expected, monkeypatch):
    from titan_models.parallel import data_parallel

    monkeypatch.setattr(data_parallel, "cpu_has_fast_bf16", lambda: True)
    dims = ParallelDims(device_type="cpu", **degrees)
    context = step_context(dims, ParallelizeConfig(param_dtype=param_dtype))
    assert context.autocast_dtype == expected


def test_auto_on_a_cpu_without_bf16_instructions_keeps_fp32(monkeypatch):
    from titan_models.parallel import data_parallel

    monkeypatch.setattr(data_parallel, "cpu_has_fast_bf16", lambda: False)
    context = step_context(ParallelDims(world_size=1, device_type="cpu"), ParallelizeConfig())
    assert context.autocast_dtype is None
    monkeypatch.setattr(data_parallel, "cpu_has_fast_bf16", lambda: True)
    context = step_context(ParallelDims(world_size=1, device_type="cpu"), ParallelizeConfig())
    assert context.autocast_dtype == torch.bfloat16
    # Asked for explicitly (torchtitan's default for its files), still fp32 on such a CPU.
    monkeypatch.setattr(data_parallel, "cpu_has_fast_bf16", lambda: False)
    explicit = ParallelizeConfig(param_dtype="bfloat16")
    assert (
        step_context(ParallelDims(world_size=1, device_type="cpu"), explicit).autocast_dtype is None
    )


def test_a_bf16_step_on_one_device_computes_in_bf16_and_keeps_fp32_weights(tiny, monkeypatch):
    """bf16 forced on CPU: blocks compute in bf16, parameters and gradients stay fp32, and
    the losses track the fp32 run within bf16 rounding without equalling it."""
    from titan_models.llama3 import Llama3
    from titan_models.parallel import data_parallel

    monkeypatch.setattr(data_parallel, "cpu_has_fast_bf16", lambda: True)  # bf16 forced

    def train(param_dtype: str) -> tuple[list[float], set[str], set[str]]:
        model = Llama3(tiny.tiny_args())
        model.load_state_dict(tiny.reference_state_dict())
        dtypes = set()
        for block in model.layers.values():
            block.feed_forward.register_forward_hook(lambda m, a, out: dtypes.add(str(out.dtype)))
        one_device = ParallelDims(world_size=1, device_type="cpu")
        context = step_context(one_device, ParallelizeConfig(param_dtype=param_dtype))
        optimizer = torch.optim.AdamW(model.parameters(), lr=tiny.LR)
        inputs, labels = tiny.batches()
        losses = []
        for step in range(tiny.STEPS):
            with context(inputs[step], labels[step]) as (x, y):
                loss = tiny.cross_entropy(model(x), y)
                loss.backward()
            grads = {str(p.grad.dtype) for p in model.parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert {str(p.dtype) for p in model.parameters()} == {"torch.float32"}
        return losses, dtypes, grads

    fp32, fp32_dtypes, _ = train("float32")
    bf16, bf16_dtypes, bf16_grads = train("bfloat16")
    assert (fp32_dtypes, bf16_dtypes) == ({"torch.float32"}, {"torch.bfloat16"})
    assert bf16_grads == {"torch.float32"}
    assert bf16[-1] < bf16[0]
    torch.testing.assert_close(bf16, fp32, rtol=0, atol=1e-2)  # see test_fsdp_bf16_...
    assert bf16 != fp32
