"""TiedWeights where one rank holds both ends of a tied weight (a V-shaped schedule puts the
first and the last stage on pipeline rank 0): the copies are summed and synced in place, the
last stage's copy is the mirrored one, and ends sharded differently are refused. The two-rank
exchange is proven by training in qwen3/test_parallelize.py (pp_*_tied layouts) and
integration_tests/test_qwen3.py (dense_pp)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from titan_models import ModelConfigError
from titan_models.parallel.pipeline_tied import TiedWeights


@pytest.fixture
def group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


class End(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, 3))


def ends(group, first_rows: int = 4) -> tuple[End, End, TiedWeights]:
    first, last = End(first_rows), End(4)
    tied = TiedWeights(
        [("weight", "weight")],
        [first, last],
        [0, 3],
        num_stages=4,
        last_stage_pp_rank=0,
        pp_group=group,
    )
    return first, last, tied


def test_one_rank_with_both_ends_syncs_in_place(group):
    first, last, tied = ends(group)
    tied.sync_weights()
    assert torch.equal(last.weight, first.weight)
    assert tied.mirrored == [last.weight]
    first.weight.grad = torch.ones(4, 3)
    last.weight.grad = torch.full((4, 3), 2.0)
    tied.sync_grads()
    assert torch.equal(first.weight.grad, torch.full((4, 3), 3.0))
    assert torch.equal(last.weight.grad, torch.full((4, 3), 3.0))


def test_ends_sharded_differently_are_refused(group):
    _, _, tied = ends(group, first_rows=2)
    with pytest.raises(ModelConfigError, match=r"different shapes \(\[2, 3\] here, \[4, 3\]"):
        tied.sync_weights()


def test_a_missing_gradient_says_when_to_call(group):
    _, _, tied = ends(group)
    with pytest.raises(RuntimeError, match="call sync_grads after a backward"):
        tied.sync_grads()
