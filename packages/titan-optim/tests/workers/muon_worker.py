"""titan's Muon on sharded parameters against ``torch.optim.Muon`` on one process (gloo, CPU).

``muon_worker.py LAYOUT OUT CKPT`` with LAYOUT ``fsdp2`` (2 ranks), ``tp2`` (2 ranks),
``fsdp_tp4`` (4 ranks, dp=2 x tp=2) or ``hsdp4`` (4 ranks, 2 replicas x 2 shards). Every
rank builds the same small network, parallelises its copy, and builds a reference copy that
stays whole, optimised by ``torch.optim.Muon`` and ``torch.optim.AdamW`` directly. Each step
gives both the same gradients: seeded full tensors, sliced for the sharded copy with the
parameter's own layout. This checks the optimizer, not the forward pass: the sharded forward
rounds differently, and Muon's bf16 Newton-Schulz would turn that into 1e-3 differences.
After ``SAVE_AFTER`` steps the sharded container is saved with DCP; a fresh container (other
parameters) loads it and runs the remaining steps, which must match the uninterrupted run.
Rank 0 writes ``OUT/<layout>.json``.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from titan_optim import Muon, MuonConfig, OptimizerConfig, build_optimizers
from titan_optim.muon import _spread_dim

STEPS, SAVE_AFTER = 4, 2
CONFIG = OptimizerConfig(
    name="Muon",
    lr=0.02,
    weight_decay=0.1,
    implementation="for-loop",
    muon=MuonConfig(adjust_lr_fn="original", adamw_lr=3e-3),
)


class Net(nn.Module):
    """Embedding, two MLP matrices of odd shapes (uneven shards), a norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(11, 12)
        self.up = nn.Linear(12, 17)
        self.down = nn.Linear(17, 12, bias=False)
        self.norm = nn.LayerNorm(12)
        self.output = nn.Linear(12, 11, bias=False)
        # A MoE layer's experts: one (experts, rows, cols) stack, orthogonalised per expert.
        self.experts = nn.Parameter(torch.randn(3, 6, 5))
        # A stack of one (a shared expert): FSDP2 leaves some ranks an empty shard.
        self.shared = nn.Parameter(torch.randn(1, 4, 5))


def parallelize(model: Net, layout: str) -> None:
    if layout == "fsdp2":
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        return
    if layout == "hsdp4":  # 2 replicas of 2 shards
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")))
        return
    if layout == "tp2":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        tp = mesh
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
    parallelize_module(model, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if layout == "fsdp_tp4":
        fully_shard(model, mesh=mesh["dp"])


def set_grads(model: nn.Module, ref: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for (_name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        full = torch.randn(q.shape, generator=g)
        q.grad = full.clone()
        if isinstance(p, DTensor):
            whole = DTensor.from_local(full, p.device_mesh, [Replicate()] * p.device_mesh.ndim)
            p.grad = whole.redistribute(p.device_mesh, p.placements)
        else:
            p.grad = full.clone()


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def max_diff(model: nn.Module, ref: nn.Module) -> float:
    return max(
        (full(p.detach()) - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )


class ModelState:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, sd)


def main(layout: str, out: Path, ckpt: Path) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ref = Net()
    init = copy.deepcopy(ref)
    model = copy.deepcopy(ref)
    parallelize(model, layout)

    # The reference: torch's own optimizers on the whole network, split as titan splits it;
    # torch's Muon takes each expert matrix as a parameter of its own.
    hidden = [ref.up.weight, ref.down.weight]
    stacks = [ref.experts, ref.shared]
    experts = [nn.Parameter(m.detach().clone()) for s in stacks for m in s]
    rest = [p for p in ref.parameters() if all(p is not h for h in [*hidden, *stacks])]
    ref_opts = [
        torch.optim.Muon(hidden + experts, **CONFIG.optimizer_kwargs("Muon")),
        torch.optim.AdamW(rest, **CONFIG.optimizer_kwargs("AdamW"), foreach=False),
    ]
    optimizers = build_optimizers(model, CONFIG)
    kinds = [type(o).__name__ for o in optimizers]
    titan_muon = isinstance(optimizers.optimizers[0], Muon)
    on_muon = {id(p) for p in optimizers.optimizers[0].param_groups[0]["params"]}
    spread = [
        n for n, p in model.named_parameters() if id(p) in on_muon and _spread_dim(p) is not None
    ]
    diffs = []
    for step in range(STEPS):
        if step == SAVE_AFTER:
            dcp.save({"model": ModelState(model), "optim": optimizers}, checkpoint_id=str(ckpt))
        set_grads(model, ref, step)
        optimizers.step()
        for e, m in zip(experts, [m for s in stacks for m in s.grad], strict=True):
            e.grad = m.clone()
        for opt in ref_opts:
            opt.step()
        with torch.no_grad():
            ref.experts.copy_(torch.stack(experts[:3]))
            ref.shared.copy_(torch.stack(experts[3:]))
        diffs.append(max_diff(model, ref))
    moved = max_diff(ref, init)

    # Resume: other parameters and a fresh container, everything from the checkpoint.
    torch.manual_seed(1)
    resumed = Net()
    parallelize(resumed, layout)
    resumed_opts = build_optimizers(resumed, CONFIG)
    dcp.load({"model": ModelState(resumed), "optim": resumed_opts}, checkpoint_id=str(ckpt))
    for step in range(SAVE_AFTER, STEPS):
        set_grads(resumed, ref, step)
        resumed_opts.step()
    resume_diff = max(
        (full(p.detach()) - full(q.detach())).abs().max().item()
        for p, q in zip(resumed.parameters(), model.parameters(), strict=True)
    )
    if dist.get_rank() == 0:
        result = {
            "kinds": kinds,
            "titan_muon": titan_muon,
            "spread": spread,
            "diffs": diffs,
            "moved": moved,
            "resume_diff": resume_diff,
            "keys": sorted(optimizers.state_dict()),
        }
        (out / f"{layout}.json").write_text(json.dumps(result))
    del model, resumed, optimizers, resumed_opts
    gc.collect()  # free FSDP state (it holds gloo work) while the group exists
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
    # As dist_worker.py: skip interpreter teardown, where torch 2.13 now and then aborts a
    # gloo process after all its work is done (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
