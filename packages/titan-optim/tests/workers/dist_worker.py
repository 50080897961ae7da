"""Distributed checks of titan-optim, run under torchrun on gloo: ``dist_worker.py PHASE OUT CKPT``.

``world4`` (4 ranks, mesh dp=2 x tp=2, FSDP2 + TP):
  * clipping: the global grad norm (2 and inf) and the clipped grads equal single-process
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model and the full batch;
  * training: losses of the FSDP2 + TP container equal a single-process container's;
  * checkpoint: after 3 steps, saves model, optimizers and LR schedulers with DCP, then
    records the losses of 3 more steps.
``world2`` (2 ranks, FSDP2 over dp=2, no TP): loads that checkpoint and records the same
3 steps; then checks clipping across pipeline stages: 4 stages, rank r holding r and r+2.

Rank 0 writes ``OUT/<phase>.json``; the pytest side asserts on it.
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
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from titan_optim import (
    LRSchedulerConfig,
    OptimizerConfig,
    ParamGroupRule,
    build_lr_schedulers,
    build_optimizers,
    clip_grad_norm_,
)
from titan_optim.clip import global_grad_norm

STEPS, SAVE_AFTER, MAX_NORM = 6, 3, 0.5
OPT = OptimizerConfig(
    name="AdamW",
    lr=1e-2,
    implementation="fused",
    param_group_rules=[ParamGroupRule(pattern="*norm*", weight_decay=0.0)],
)
SCHED = LRSchedulerConfig(warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x + self.down(torch.relu(self.up(x)))))


class ModelState:
    """The model as a DCP ``Stateful`` (FQN keys, DTensor shards)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, sd)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def local_batch(step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step)
    n = x.shape[0] // dp
    return x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]


def full_grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad


def train_step(model, optimizers, schedulers, x, y, dp_group) -> float:
    optimizers.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizers.clip_grad_norm_(MAX_NORM)
    optimizers.step()
    schedulers.step()
    report = loss.detach().clone()
    if dp_group is not None:
        dist.all_reduce(report, group=dp_group)
        report /= dist.get_world_size(dp_group)
    return report.item()


def world4(out: Path, ckpt: Path) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    meshes = sorted({str(p.device_mesh.mesh_dim_names) for p in model.parameters()})

    # Clipping: FSDP2 + TP on the local batch vs one process on the full batch.
    x, y = local_batch(0, dp_rank, 2)
    nn.functional.mse_loss(model(x), y).backward()
    nn.functional.mse_loss(ref(*batch(0)[:1]), batch(0)[1]).backward()
    grads = [p.grad for p in model.parameters()]
    inf_par = global_grad_norm(grads, norm_type=float("inf")).item()
    inf_ref = max(p.grad.abs().max().item() for p in ref.parameters())
    norm_par = clip_grad_norm_(model.parameters(), MAX_NORM).item()
    norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
    grad_diff = max(
        (full_grad(p) - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    model.zero_grad()
    ref.zero_grad()

    # Training, then a checkpoint after SAVE_AFTER steps, then the rest.
    optimizers = build_optimizers(model, OPT)
    schedulers = build_lr_schedulers(optimizers, SCHED, training_steps=STEPS)
    ref_opt = build_optimizers(ref, OPT)
    ref_sched = build_lr_schedulers(ref_opt, SCHED, training_steps=STEPS)
    losses, ref_losses = [], []
    for step in range(STEPS):
        if step == SAVE_AFTER:
            states = {"model": ModelState(model), "optim": optimizers, "lr": schedulers}
            dcp.save(states, checkpoint_id=str(ckpt))
            lr_at_save = schedulers.get_last_lr()
        losses.append(
            train_step(model, optimizers, schedulers, *local_batch(step, dp_rank, 2), dp_group)
        )
        ref_losses.append(train_step(ref, ref_opt, ref_sched, *batch(step), None))
    return {
        "meshes": meshes,
        "norm_par": norm_par,
        "norm_ref": norm_ref,
        "inf_par": inf_par,
        "inf_ref": inf_ref,
        "grad_diff": grad_diff,
        "losses": losses,
        "ref_losses": ref_losses,
        "lr_at_save": lr_at_save,
        "optim_keys": sorted(optimizers.state_dict()),
    }


def world2(out: Path, ckpt: Path) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = dist.get_rank()
    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    model = Net()
    fully_shard(model, mesh=mesh)
    optimizers = build_optimizers(model, OPT)
    schedulers = build_lr_schedulers(optimizers, SCHED, training_steps=STEPS)
    dcp.load(
        {"model": ModelState(model), "optim": optimizers, "lr": schedulers}, checkpoint_id=str(ckpt)
    )
    lr_loaded = schedulers.get_last_lr()
    losses = [
        train_step(model, optimizers, schedulers, *local_batch(step, rank, 2), mesh.get_group())
        for step in range(SAVE_AFTER, STEPS)
    ]

    # Pipeline clipping: stages 0..3 of one network; this rank holds stages r and r + 2.
    torch.manual_seed(7)
    full = nn.Sequential(*(nn.Linear(6, 6) for _ in range(4)))
    x = torch.randn(5, 6)
    full(x).square().sum().backward()
    parts = [copy.deepcopy(full[i]) for i in (rank, rank + 2)]
    for part, i in zip(parts, (rank, rank + 2), strict=True):
        for p, q in zip(part.parameters(), full[i].parameters(), strict=True):
            p.grad = q.grad.clone()
    pp_opt = build_optimizers(parts, OptimizerConfig(name="SGD", lr=0.1))
    pp_norm = pp_opt.clip_grad_norm_(MAX_NORM, pp_group=dist.group.WORLD).item()
    ref_norm = torch.nn.utils.clip_grad_norm_(full.parameters(), MAX_NORM).item()
    pp_diff = max(
        (p.grad - q.grad).abs().max().item()
        for part, i in zip(parts, (rank, rank + 2), strict=True)
        for p, q in zip(part.parameters(), full[i].parameters(), strict=True)
    )
    return {
        "losses": losses,
        "lr_loaded": lr_loaded,
        "pp_norm": pp_norm,
        "pp_ref_norm": ref_norm,
        "pp_grad_diff": pp_diff,
    }


def main() -> None:
    phase, out, ckpt = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo")
    try:
        result = {"world4": world4, "world2": world2}[phase](out, ckpt)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if dist.get_rank() == 0:
            (out / f"{phase}.json").write_text(json.dumps(gathered))
    finally:
        gc.collect()  # free FSDP state (it holds gloo work) while the group exists
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown: with torch 2.13, a gloo group still referenced
    # somewhere and freed during finalization now and then aborts the process after all its
    # work is done ("terminate called without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
