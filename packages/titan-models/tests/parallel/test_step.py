"""The per-step context of a plan, in one process: what it resolves once at plan time, what
it refuses before any work, and ``reduce_loss`` / ``plain_loss`` without collectives.
Under CP, TP and PP the same context drives the integration runs
(integration_tests/test_train_runs.py, equal losses across layouts)."""

from __future__ import annotations

import pytest
import torch

from titan_dims import ParallelDims
from titan_models import (
    ConfigError,
    ParallelizeConfig,
    plain_loss,
    reduce_loss,
    repeat_kv,
    step_context,
)


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
