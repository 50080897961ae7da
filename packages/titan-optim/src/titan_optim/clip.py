"""Gradient clipping by the global norm over every rank's shard of every model part.

Each gradient element counts once: DTensor gradients are reduced over their own mesh (one
op cannot mix meshes, so mesh by mesh), and pipeline stages, which hold disjoint parameters,
combine their norms over the pipeline group (``sum(n_i ** p) ** (1/p)``, or ``max`` for the
infinity norm). Only then is the norm equal on every rank, so every rank makes the same
clip / skip / raise decision."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_optim.errors import NonFiniteGradError, check_choice, check_number

__all__ = ["NONFINITE_POLICIES", "NonFiniteGradError", "clip_grad_norm_"]

NONFINITE_POLICIES = ("skip", "raise")
"""What to do when the global gradient norm is inf or nan: leave the grads (and skip the
optimizer step, when a container clips) or raise ``NonFiniteGradError``."""


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | DeviceMesh | None = None,
    on_nonfinite: str = "skip",
    mirrored: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` (this rank's, plain or DTensor) in place so their
    global norm is <= ``max_norm``; ``pp_group`` is the pipeline group (or 1-D mesh) of a staged
    model; ``mirrored`` parameters (the last stage's copy of a tied embedding) are clipped but
    not counted. Returns the norm, a plain tensor equal on every rank. A non-finite norm leaves
    the gradients alone and raises ``NonFiniteGradError`` with ``on_nonfinite="raise"``; with
    ``"skip"`` the caller skips the step (``OptimizersContainer`` does)."""
    # Arguments of a call, not settings of a config: plain ValueErrors, in the shared shape.
    check_number("max_norm", max_norm, low=0, error=ValueError)
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"norm_type={norm_type!r} is not allowed; it must be > 0 or inf.")
    check_choice("on_nonfinite", on_nonfinite, NONFINITE_POLICIES, error=ValueError)
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in mirrored}
    counted = [p.grad for p in params if id(p) not in skip]
    total = global_grad_norm(counted, norm_type=norm_type, pp_group=pp_group)
    grads = [p.grad for p in params]
    if not torch.isfinite(total):
        if on_nonfinite == "raise":
            raise NonFiniteGradError(
                f"The global gradient norm is {total.item()} (norm_type={norm_type:g}); "
                "a loss spike or a bad batch produced inf/nan gradients. Lower the lr, check "
                "the data, or set on_nonfinite='skip' to skip such steps."
            )
        return total
    _scale_(grads, max_norm, total)
    return total


def global_grad_norm(
    grads: list[torch.Tensor],
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | DeviceMesh | None = None,
) -> torch.Tensor:
    """The norm of all ``grads`` on all ranks, as a plain fp32 tensor (see module docstring)."""
    by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # the reduction over this mesh's sharded dims
        norms.append(norm.float())
    device = norms[0].device if norms else _default_device(pp_group)
    if norms:
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    else:
        total = torch.zeros((), device=device)
    if pp_group is not None:
        group = pp_group.get_group() if isinstance(pp_group, DeviceMesh) else pp_group
        if norm_type == math.inf:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = total**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            total = total ** (1.0 / norm_type)
    return total


def _scale_(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    # Scale the local data: a DTensor's shards scale like the whole, whatever the placement.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(device=local.device, dtype=local.dtype))


def _default_device(pp_group: dist.ProcessGroup | DeviceMesh | None) -> torch.device:
    # A stage with no gradients still joins the pipeline reduction, on the group's device.
    if isinstance(pp_group, DeviceMesh):
        return torch.device(pp_group.device_type)
    if pp_group is not None and dist.get_backend(pp_group) != "gloo":
        # An accelerator backend (nccl, xccl, ...) reduces on the current accelerator.
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")
