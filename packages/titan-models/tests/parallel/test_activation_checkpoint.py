"""Op-level activation checkpointing keeps the outputs of collectives: recomputing a block
in backward must not run sequence parallel's reduce-scatter (or expert parallel's
all-to-all) again. One gloo rank is enough to see how often the collective runs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import reduce_scatter_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from titan_dims import init_distributed
from titan_models.parallel.activation_checkpoint import _op_level_context


class _CountReduceScatter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func == torch.ops._c10d_functional.reduce_scatter_tensor.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_the_reduce_scatter_is_not_recomputed_in_backward():
    init_distributed(device_type="cpu")
    try:
        group = dist.group.WORLD
        weight = torch.randn(8, 8, requires_grad=True)

        def block(x: torch.Tensor) -> torch.Tensor:
            hidden = torch.relu(x @ weight)
            scattered = reduce_scatter_tensor(hidden, "sum", 0, group)
            return scattered * scattered  # its backward needs the collective's output

        x = torch.randn(4, 8)
        with _CountReduceScatter() as counter:
            out = checkpoint(block, x, use_reentrant=False, context_fn=_op_level_context)
            out.sum().backward()
        assert counter.calls == 1  # forward only; without saving it, 2
        expected = torch.relu(x @ weight.detach()).square().sum()
        torch.testing.assert_close(out.sum().detach(), expected)
    finally:
        dist.destroy_process_group()
