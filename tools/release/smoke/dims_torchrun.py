"""titan-dims as another framework would use it: a plain script under torchrun.

    torchrun --nproc-per-node 2 dims_torchrun.py

Builds the mesh from titan-dims, trains a small FSDP2 model on it for 3 steps, checks that
every rank sees the same falling global loss, and prints ``dims smoke ok`` on rank 0.
"""

import gc

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from titan_dims import ParallelDims, init_distributed

device = init_distributed()
dims = ParallelDims(world_size=dist.get_world_size())
assert dims.dp_degree == dist.get_world_size(), dims
mesh = dims.get_mesh("dp_shard_cp")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
model = model.to(device)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
inputs = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
targets = inputs.sum(dim=1, keepdim=True).sin()
per_rank = 32 // dims.dp_degree
mine = slice(dims.dp_rank() * per_rank, (dims.dp_rank() + 1) * per_rank)
losses = []
for _ in range(3):
    loss = torch.nn.functional.mse_loss(model(inputs[mine].to(device)), targets[mine].to(device))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh.get_group())
    losses.append(loss.item())
assert losses[-1] < losses[0], losses
rank = dims.dp_rank()
del model, optimizer
gc.collect()
dist.destroy_process_group()
if rank == 0:
    print(f"dims smoke ok: world {dims.world_size}, losses {[round(x, 4) for x in losses]}")
