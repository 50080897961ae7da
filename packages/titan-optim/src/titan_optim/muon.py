"""Muon over sharded parameters: ``torch.optim.Muon``'s update for DTensors and expert stacks.

``torch.optim.Muon`` orthogonalises each 2-D gradient with a Newton-Schulz iteration, which
needs the whole matrix; it refuses anything but plain 2-D parameters. Under FSDP2 (``Shard(0)``)
and TP a rank holds only a slice, and MoE layers keep their experts as one 3-D ``(experts,
rows, cols)`` stack. This ``Muon`` keeps torch's update, state and param-group keys (so a
checkpoint moves between the two) and, per parameter:

* gathers the update matrix (``DTensor.full_tensor()``), runs torch's own Newton-Schulz on it
  and keeps this rank's slice; a 3-D stack sharded only along its expert dimension (expert
  parallelism, or FSDP2 over experts) holds whole matrices and is orthogonalised in place;
* orthogonalises a 3-D stack expert by expert and scales the LR by the shape of one expert
  matrix.

Gathering per matrix was measured against spreading the matrices over the ranks (each rank
iterating on its share, then scattering the results): ``tools/bench/muon_sharded.py``. Every
rank repeats the iterations of every matrix here, the simpler of the two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

__all__ = ["Muon", "can_orthogonalize", "orthogonalize"]


def can_orthogonalize(param: Tensor) -> bool:
    """Whether Muon can update ``param``: a matrix, or a 3-D stack of (expert) matrices."""
    return param.ndim in (2, 3) and not torch.is_complex(param)


def _newton_schulz(update: Tensor, group: dict[str, Any]) -> Tensor:
    """torch's Newton-Schulz on a matrix, or on each matrix of a 3-D stack."""

    def one(m: Tensor) -> Tensor:
        return _zeropower_via_newtonschulz(
            m, group["ns_coefficients"], group["ns_steps"], group["eps"]
        )

    if update.ndim == 2:
        return one(update)
    return torch.stack([one(m) for m in update])


def _whole_matrices(update: DTensor) -> bool:
    """Whether each rank's slice of a 3-D stack is made of whole matrices (split by expert)."""
    return update.ndim == 3 and all(
        type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in update.placements
    )


def orthogonalize(update: Tensor, group: dict[str, Any]) -> Tensor:
    """The Newton-Schulz orthogonalisation of ``update`` with ``group``'s settings, laid out
    (sharded) as ``update`` is."""
    if not isinstance(update, DTensor):
        return _newton_schulz(update, group)
    mesh, placements = update.device_mesh, update.placements
    if _whole_matrices(update):
        local = _newton_schulz(update.to_local(), group)
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=update.shape, stride=update.stride()
        )
    full = _newton_schulz(update.full_tensor(), group)
    # A replicated DTensor redistributed to shards slices locally: no communication.
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, placements)


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s update for DTensor parameters and 3-D expert stacks.

    Same arguments, defaults, state (``momentum_buffer``) and param-group keys as
    ``torch.optim.Muon``; the momentum arithmetic runs on this rank's shard, only the
    orthogonalisation sees whole matrices (see the module docstring). The LR adjustment reads
    the shape of one matrix: ``(rows, cols)`` of a 2-D parameter, of one expert for a stack.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if not can_orthogonalize(p):
                    raise ValueError(
                        f"Muon updates 2-D matrices and 3-D stacks of expert matrices; got a "
                        f"parameter of shape {tuple(p.shape)} ({p.dtype}). Give it AdamW."
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One Muon update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, group)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:]))
        return loss
