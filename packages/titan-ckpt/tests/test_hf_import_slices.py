"""The Hugging Face import cuts each rank's part of a tensor on the host and copies only
that part to the parameter's device (issue 18, F19): torch's ``distribute_tensor`` first
moves the whole tensor to the mesh's device, on every rank.

Checked for every rank of a 2 x 2 mesh (a fake process group: the cut needs no
communication) and the layouts titan uses (FSDP, TP column/row, FSDP over TP's strided
shards, replicated, uneven shards): the parameter's local tensor equals torch's
``distribute_tensor`` cut, and no operation in the copy makes a tensor as large as the full
one (not a cast of it: bf16 file, fp32 model; not a move of it to the device), and nothing
beyond the part on the parameter's device. On an
accelerator (skipped cleanly without one) the same runs with the parameters there. The real
import over gloo ranks is ``test_hf_sharded.py``'s.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from titan_ckpt.hf import _copy_into

LAYOUTS = {
    "fsdp": [Shard(0), Replicate()],
    "tp_colwise": [Replicate(), Shard(0)],
    "tp_rowwise": [Replicate(), Shard(1)],
    "fsdp_x_tp_colwise": [_StridedShard(0, split_factor=2), Shard(0)],
    "fsdp_x_tp_rowwise": [Shard(0), Shard(1)],
    "both_dims": [Shard(1), Shard(0)],
    "replicated": [Replicate(), Replicate()],
}
SHAPES = [(8, 12), (7, 5)]  # even, and uneven on both dims (5 rows over 2 x 2: an empty part)


class _Sizes(TorchDispatchMode):
    """Records (op, numel, device) of every new tensor an operation returns (views of an
    input, which allocate nothing, are left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                self.outputs.append((str(func), t.numel(), t.device.type))
        return out


def _devices() -> list[str]:
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    gated = pytest.mark.skipif(accelerator is None, reason="needs an accelerator")
    return ["cpu", pytest.param(accelerator.type if accelerator else "cuda", marks=gated)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("shape", SHAPES)
def test_each_rank_copies_only_its_part(device, shape):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            mesh = init_device_mesh(device, (2, 2))
            for name, placements in LAYOUTS.items():
                want = distribute_tensor(full.float(), mesh, placements, src_data_rank=None)
                target = distribute_tensor(
                    torch.zeros(shape, device=device), mesh, placements, src_data_rank=None
                )
                with _Sizes() as sizes:
                    _copy_into(target, full)
                where = f"rank {rank}, {name}, {shape}"
                assert torch.equal(target.to_local().cpu(), want.to_local().cpu()), where
                local = target.to_local().numel()
                if device != "cpu":
                    # On the parameter's device nothing beyond its part (the copy is in place).
                    on_device = [n for _, n, kind in sizes.outputs if kind == device]
                    assert max(on_device, default=0) <= local, (where, sizes.outputs)
                if name != "replicated":
                    assert local < full.numel(), where
                    # Nowhere a full-size tensor: no cast or device copy of the whole (FSDP
                    # over TP's strided cut gathers the FSDP part on the host first).
                    made = [n for _, n, _ in sizes.outputs]
                    assert max(made, default=0) < full.numel(), (where, sizes.outputs)
        finally:
            dist.destroy_process_group()
