"""Muon over sharded parameters: ``torch.optim.Muon``'s update for DTensors and expert stacks.

``torch.optim.Muon`` orthogonalises each whole 2-D gradient by Newton-Schulz and refuses
anything else; under FSDP2 and TP a rank holds a slice, and MoE experts are one 3-D
``(experts, rows, cols)`` stack. This ``Muon`` keeps torch's update, state and group keys (a
checkpoint moves between the two) and orthogonalises whole matrices only:

* matrices split by rows only (FSDP2's ``Shard(0)``, TP colwise, HSDP's shard dimension) are
  spread: matrix i's rows are gathered on rank ``i % world`` of that dimension, iterated and
  scattered back. Against gathering every matrix on every rank
  (``tools/bench/muon_sharded.py``, gloo, 2 cores) it takes 0.45-0.52x the time at 2 ranks
  and 0.23-0.26x at 4;
* other DTensor layouts (TP rowwise, FSDP2 + TP) gather the matrix on every rank
  (``full_tensor()``) and keep this rank's slice;
* an expert stack is orthogonalised per expert; sharded only along the experts (EP, FSDP2
  over experts) each rank iterates on its whole matrices with no communication. The LR
  scaling reads one expert matrix's shape.

Every path runs torch's ``_zeropower_via_newtonschulz`` on the whole matrix, so parameters
equal ``torch.optim.Muon``'s bit for bit (tests/test_muon.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

try:  # FSDP2 over expert parallel splits a stack's dim 0 twice: _StridedShard, then Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # a torch without it gives plain Shard placements there
    _StridedShard = Shard

# torch's own iteration and LR scaling (torch >= 2.9; OptimizerConfig refuses Muon without).
try:
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # pragma: no cover - older torch
    _adjust_lr = _zeropower_via_newtonschulz = None  # type: ignore[assignment]

__all__ = ["Muon", "can_orthogonalize", "orthogonalize", "orthogonalize_all"]


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
    if len(update) == 0:  # a rank's empty shard of a short stack (one shared expert, FSDP2)
        return update.to(torch.bfloat16)  # the dtype torch's iteration returns
    return torch.stack([one(m) for m in update])


def _whole_matrices(update: DTensor) -> bool:
    """Whether each rank's slice of a 3-D stack is made of whole matrices (split by expert:
    FSDP2's and expert parallel's splits of dim 0, strided or not), so that each rank
    orthogonalises its own experts without communicating."""
    return update.ndim == 3 and all(
        type(p) is Replicate or (isinstance(p, (Shard, _StridedShard)) and p.dim == 0)
        for p in update.placements
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


def _spread_dim(update: Tensor) -> int | None:
    """The mesh dimension a matrix's rows are sharded over when that is its only split
    (FSDP2's ``Shard(0)``, TP's colwise, HSDP's shard dimension beside replicas): the layout
    whose matrices are spread over the ranks (``orthogonalize_all``); else ``None``."""
    if not isinstance(update, DTensor) or update.ndim != 2:
        return None
    placements = update.placements
    dims = [d for d, p in enumerate(placements) if type(p) is Shard and p.dim == 0]
    others = [p for d, p in enumerate(placements) if d not in dims]
    if len(dims) != 1 or any(type(p) is not Replicate for p in others):
        return None
    return dims[0]


def _rows(t: Tensor, rows: int) -> Tensor:
    """``t`` padded with zero rows (or cut) to ``rows`` rows: gloo's gather and scatter take
    equal pieces, and the last shards of an uneven ``Shard(0)`` are short."""
    if t.shape[0] >= rows:
        return t[:rows].contiguous()
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _spread(updates: list[DTensor], dim: int, group: dict[str, Any]) -> list[Tensor]:
    """Orthogonalise matrices whose rows are sharded over mesh dimension ``dim``, matrix i on
    that dimension's rank ``i % world``: gather each to its owner, iterate there, scatter the
    rows back (replicas, if any, do the same among themselves). Returns DTensors."""
    mesh = updates[0].device_mesh
    pg, world, rank = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
    chunks = [-(-u.shape[0] // world) for u in updates]  # rows per shard, as torch.chunk
    gathered: list[list[Tensor] | None] = []
    handles = []
    for i, (u, chunk) in enumerate(zip(updates, chunks, strict=True)):
        local = _rows(u.to_local(), chunk)
        pieces = [torch.empty_like(local) for _ in range(world)] if i % world == rank else None
        handles.append(dist.gather(local, pieces, group=pg, group_dst=i % world, async_op=True))
        gathered.append(pieces)
    for handle in handles:
        handle.wait()
    outs, handles = [], []
    for i, (u, chunk) in enumerate(zip(updates, chunks, strict=True)):
        pieces = None
        if i % world == rank:
            full = _newton_schulz(torch.cat(gathered[i])[: u.shape[0]], group).to(u.dtype)
            pieces = [_rows(full[r * chunk : (r + 1) * chunk], chunk) for r in range(world)]
        out = u.to_local().new_empty(chunk, u.shape[1])
        handles.append(dist.scatter(out, pieces, group=pg, group_src=i % world, async_op=True))
        outs.append(out)
    for handle in handles:
        handle.wait()
    return [
        DTensor.from_local(
            out[: u.to_local().shape[0]],
            mesh,
            u.placements,
            run_check=False,
            shape=u.shape,
            stride=u.stride(),
        )
        for u, out in zip(updates, outs, strict=True)
    ]


def orthogonalize_all(updates: list[Tensor], group: dict[str, Any]) -> list[Tensor]:
    """:func:`orthogonalize` of each update, with row-sharded matrices spread over the ranks
    of their shard dimension (each iterates on its share) rather than repeated on every rank."""
    out: list[Tensor | None] = [None] * len(updates)
    by_mesh: dict[tuple[Any, int], list[int]] = {}
    for i, u in enumerate(updates):
        dim = _spread_dim(u)
        if dim is None:
            out[i] = orthogonalize(u, group)
        else:
            by_mesh.setdefault((u.device_mesh, dim), []).append(i)
    for (_, dim), indices in by_mesh.items():
        results = _spread([updates[i] for i in indices], dim, group)
        for i, result in zip(indices, results, strict=True):
            out[i] = result
    return out  # type: ignore[return-value]


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
            params, updates = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                params.append(p)
                updates.append(p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
            lr = group["lr"]
            for p, update in zip(params, orthogonalize_all(updates, group), strict=True):
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:]))
        return loss
