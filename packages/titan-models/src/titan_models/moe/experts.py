"""The routed experts as stacked weights, run as grouped matmuls or by the fallback.

``GroupedExperts`` holds ``w1``, ``w3`` (num_experts, dim, hidden) and ``w2`` (num_experts,
hidden, dim), torchtitan's layout, and computes ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]``
for rows of ``x`` sorted by expert, by one of two equal implementations:

- ``torch._grouped_mm`` with int32 cumulative offsets, one call per weight. It needs rows
  whose byte strides are multiples of 16 and a dtype its kernel (and, under compile, its meta
  kernel) has: probed once per (device type, dtype) by running it, never by device name.
- the fallback (counts read to the host once per call): batched matmuls over rows padded to
  the longest expert while that at most doubles the rows, else one matmul per expert.

Under autocast ``x`` and the weights are cast to the autocast dtype explicitly: autocast has
no rule for ``_grouped_mm`` and would leave fp32 inputs in fp32 (on CUDA torch's per-expert
fallback, with a host copy of the offsets). The output is cast back to ``x``'s dtype, as
torchtitan does. Under EP/TP plans the experts compute on their local shards."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.nn import functional

from titan_models import init

__all__ = [
    "GroupedExperts",
    "grouped_mm_supported",
    "run_experts_fallback",
    "run_experts_grouped_mm",
    "run_experts_loop",
    "run_experts_padded",
]


def run_experts_grouped_mm(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of each expert over its rows of ``x`` (rows sorted by expert, ``counts[e]``
    of them for expert ``e``, summing to ``len(x)``), by three grouped matmuls."""
    # Offsets are the cumulative row ends; the last must be len(x): rows past it come back
    # uninitialized.
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    hidden = functional.silu(torch._grouped_mm(x, w1, offs=offsets))
    hidden = hidden * torch._grouped_mm(x, w3, offs=offsets)
    return torch._grouped_mm(hidden, w2, offs=offsets)


def run_experts_loop(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The same as ``run_experts_grouped_mm``, one expert's slice at a time."""
    outputs = []
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        rows = x[start : start + count]
        hidden = functional.silu(rows @ w1[expert]) * (rows @ w3[expert])
        outputs.append(hidden @ w2[expert])
        start += count
    if not outputs:
        # No rows (an expert-parallel rank may receive none): expert 0 over the empty rows,
        # so that every weight still takes part in the backward (with zero gradients).
        hidden = functional.silu(x @ w1[0]) * (x @ w3[0])
        return hidden @ w2[0]
    return torch.cat(outputs)


def run_experts_padded(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The same as ``run_experts_grouped_mm``, by three batched matmuls over the experts'
    rows padded with zeros to the largest count (the counts are read to the host)."""
    longest = int(counts.max())
    num_experts, rows = counts.shape[0], x.shape[0]
    starts = torch.cumsum(counts, dim=0) - counts
    expert_of_row = torch.repeat_interleave(
        torch.arange(num_experts, device=x.device), counts, output_size=rows
    )
    # Row i of expert e sits at e * longest + i of the padded batch.
    slot = expert_of_row * longest + torch.arange(rows, device=x.device) - starts[expert_of_row]
    padded = x.new_zeros(num_experts * longest, x.shape[1]).index_copy(0, slot, x)
    padded = padded.view(num_experts, longest, -1)
    hidden = functional.silu(torch.bmm(padded, w1)) * torch.bmm(padded, w3)
    return torch.bmm(hidden, w2).view(num_experts * longest, -1).index_select(0, slot)


def run_experts_fallback(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Where grouped mm is not available: padded batched matmuls while the padding at most
    doubles the rows (few calls; with many experts several times faster than a loop),
    else, for skewed loads, the loop over the experts' slices."""
    rows = x.shape[0]
    if rows and counts.shape[0] * int(counts.max()) <= 2 * rows:
        return run_experts_padded(w1, w2, w3, x, counts)
    return run_experts_loop(w1, w2, w3, x, counts)


# (device type, dtype) -> whether torch._grouped_mm works there: a plain dict, which
# torch.compile reads as a constant once filled.
_GROUPED_MM_SUPPORT: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on ``device_type`` in
    ``dtype`` and agrees with plain matmuls: probed once on tiny aligned inputs (one group
    empty), cached for the process."""
    key = (device_type, dtype)
    if key not in _GROUPED_MM_SUPPORT:
        # On real tensors even when asked under FakeTensorMode (the memory estimate): a fake
        # probe would answer for the meta kernel and cache that for the device.
        with unset_fake_temporarily():
            _GROUPED_MM_SUPPORT[key] = _probe_grouped_mm(device_type, dtype)
    return _GROUPED_MM_SUPPORT[key]


@torch.compiler.disable
def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device_type)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=generator).to(device, dtype).requires_grad_()
    w = torch.randn(3, 16, 16, generator=generator).to(device, dtype).requires_grad_()
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32, device=device)
    try:
        with torch.enable_grad():
            out = torch._grouped_mm(x, w, offs=offsets)
            out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    if device.type == "meta":
        return True
    expected = torch.cat((x[:2] @ w[0], x[2:] @ w[2])).detach()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(
        torch.allclose(out.detach().float(), expected.float(), rtol=tolerance, atol=tolerance)
    )


def _grouped_mm_fits(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``x`` and the weights meet ``_grouped_mm``'s layout rules and the device has
    it for their dtype."""
    if x.shape[0] == 0 or any(w.dtype != x.dtype for w in weights):
        return False
    # Rows (and each matrix's rows) must start at 16-byte multiples.
    align = max(1, 16 // x.element_size())
    if any(w.shape[-1] % align or w.shape[-2] % align for w in weights):
        return False
    # Under torch.compile and on fake tensors the op runs its meta kernel, which may accept
    # fewer dtypes than the device's (torch 2.13: bf16 only, while CPU runs fp32 too).
    traced = torch.compiler.is_compiling() or isinstance(x, FakeTensor)
    if traced and not grouped_mm_supported("meta", x.dtype):
        return False
    return grouped_mm_supported(x.device.type, x.dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype of ``x``'s device when autocast is on there, else ``x``'s own."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts with stacked weights ``w1``, ``w3`` (E, dim, hidden) and
    ``w2`` (E, hidden, dim)."""

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, *, use_grouped_mm: bool = True
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``x`` (N, dim) sorted by expert, ``counts[e]`` rows for (local) expert
        ``e``; with ``counts=None`` every row goes through expert 0 (a shared expert, which
        has only that one)."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        if counts is None:
            hidden = functional.silu(x @ w1[0]) * (x @ w3[0])
            return hidden @ w2[0]
        dtype = _compute_dtype(x)
        rows, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        if self.use_grouped_mm and _grouped_mm_fits(rows, w1, w2, w3):
            out = run_experts_grouped_mm(w1, w2, w3, rows.contiguous(), counts)
        elif isinstance(counts, FakeTensor):
            # Fake tensors (the memory estimate) have no counts to read: every row through
            # expert 0 has grouped mm's shapes, saved activations and full-size gradients.
            hidden = functional.silu(rows @ w1[0]) * (rows @ w3[0])
            out = hidden @ w2[0]
        else:
            out = run_experts_fallback(w1, w2, w3, rows, counts)
        return out.to(x.dtype)

    def init_weights(self, init_std: float) -> None:
        """``w1`` with std 0.02, ``w2`` and ``w3`` with ``init_std`` (truncated normals), as
        torchtitan initializes them."""
        init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        init.trunc_normal_(self.w3, mean=0.0, std=init_std)
