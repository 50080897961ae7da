"""Context parallel: load-balanced sequence sharding and causal attention across the ``cp``
ranks, by one of three implementations (``ParallelizeConfig.cp_attention``).

``titan`` trains on any device (torch 2.13's ``context_parallel`` has no CPU sharding rule
for SDPA, FlexAttention no CPU backward). Rank r holds chunks r and ``2 cp - 1 - r`` of
``2 cp``, so under the causal mask every rank does the same work; attention all-gathers K
and V over ``cp`` (backward: reduce-scatter) and attends its queries to every earlier key.
Memory: the full sequence's K/V per layer, for one attention. ``titan_ring`` passes K/V
around a ring instead (:mod:`titan_models.parallel.ring_attention`). ``torch`` is torch's
``context_parallel`` (CUDA only; ``auto`` picks it there): it shards the batch in place, in
the same chunk order, and runs ring attention on the flash/efficient kernels, overlapping the
exchange with compute. All three rotate each token by its global position's RoPE angle
through the same attention input hook, so no model buffer needs sharding.

A trainer runs each step inside its :class:`~titan_models.StepContext` (or
:func:`context_parallel_batch`), which does what the implementation needs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_dims import ParallelDims, detect_device_type
from titan_models.errors import ModelConfigError, check_choice
from titan_models.ops import repeat_kv
from titan_models.parallel.config import CP_ATTENTIONS, ParallelizeConfig
from titan_models.parallel.cp_sharding import (
    ShardedAttention,
    context_parallel_positions,
    context_parallel_shard,
)
from titan_models.parallel.ring_attention import RingContextParallelAttention

__all__ = [
    "ContextParallelAttention",
    "TorchContextParallelAttention",
    "apply_context_parallel",
    "context_parallel_batch",
    "context_parallel_positions",
    "context_parallel_shard",
    "open_context_parallel",
    "resolve_cp_attention",
    "torch_context_parallel_runs_on",
]


def torch_context_parallel_runs_on(device_type: str) -> bool:
    """Whether torch 2.13's ``context_parallel`` has SDPA kernels to shard on this device
    type (its flash, efficient and cuDNN attention: CUDA only)."""
    return device_type == "cuda"


def resolve_cp_attention(choice: str, device_type: str) -> str:
    """The implementation ``cp_attention=choice`` means on ``device_type``: ``"torch"``,
    ``"titan"`` or ``"titan_ring"``. ``auto`` is torch's on CUDA and ours elsewhere;
    ``torch`` on any other device raises ``ModelConfigError``."""
    check_choice("cp_attention", choice, CP_ATTENTIONS)
    if choice == "auto":
        return "torch" if torch_context_parallel_runs_on(device_type) else "titan"
    if choice == "torch" and not torch_context_parallel_runs_on(device_type):
        raise ModelConfigError(
            f"cp_attention='torch' cannot run on device {device_type!r}: torch's "
            "context_parallel only shards the CUDA SDPA kernels (flash, efficient, cuDNN). "
            f"Choose cp_attention among {', '.join(map(repr, CP_ATTENTIONS))}; 'titan', "
            f"'titan_ring' and 'auto' run on {device_type!r}."
        )
    return choice


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 2 (sequence of (batch, heads, seq, head_dim)); the backward
    reduce-scatters (sums) the gradients, since every rank's attention used every shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        # Gather along the leading dim (contiguous chunks), then move it next to seq.
        x = x.movedim(2, 0).contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out.movedim(0, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        grad = grad.movedim(2, 0).contiguous()
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, 2), None


class ContextParallelAttention(ShardedAttention):
    """Causal attention of this rank's load-balanced queries over the keys and values of the
    whole ``cp`` group; drop-in for :class:`~titan_models.llama3.model.CausalAttention`."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        local = q.shape[2]
        seq_len = local * self.cp
        k = _AllGatherSeq.apply(k, self.group)
        v = _AllGatherSeq.apply(v, self.group)
        k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])
        q_pos = context_parallel_positions(seq_len, self.cp_rank, self.cp, device=q.device)
        k_pos = torch.cat(
            [
                context_parallel_positions(seq_len, r, self.cp, device=q.device)
                for r in range(self.cp)
            ]
        )
        mask = q_pos[:, None] >= k_pos[None, :]
        return functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _rope_for_positions(cp_rank: int, cp: int):
    """A forward pre-hook for an attention module ``forward(x, rope)``: hand it the RoPE
    rows of this rank's global positions, so local token j is rotated by its true position."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, rope = args
        positions = context_parallel_positions(x.shape[1] * cp, cp_rank, cp, device=rope.device)
        return x, rope.index_select(0, positions)

    return hook


_TORCH_CP_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
]


class TorchContextParallelAttention(nn.Module):
    """Causal SDPA (GQA heads repeated) for torch's ``context_parallel``, which swaps SDPA for
    ring attention while its context is open. Outside :func:`context_parallel_batch` it
    raises rather than silently attend within this rank's shard only."""

    open_contexts = 0
    """torch ``context_parallel`` contexts open now (entered only through
    :func:`open_context_parallel`). Process-wide on purpose, not a context variable: under
    activation checkpointing the forward is recomputed during backward, which autograd may
    run on another thread, and torch's own context is process-wide too."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not TorchContextParallelAttention.open_contexts:
            raise RuntimeError(
                "This model uses torch's context parallel (cp_attention='torch', or 'auto' on "
                "CUDA): run its forward and backward inside titan_models.context_parallel_batch."
            )
        k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])
        # is_causal (not a mask): torch's ring attention handles exactly this case. Only the
        # kernels it shards (flash, efficient, cuDNN): were SDPA to fall back to the math
        # kernel, it would attend over the permuted (load-balanced) sequence unsharded.
        with sdpa_kernel(_TORCH_CP_BACKENDS):
            return functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def apply_context_parallel(
    attentions: list[nn.Module], cp_mesh: DeviceMesh, implementation: str = "titan"
) -> None:
    """Make every attention module (``forward(x, rope)`` with an ``inner_attention``)
    context-parallel over ``cp_mesh`` with ``implementation`` (``titan``, ``titan_ring`` or
    ``torch``, see :func:`resolve_cp_attention`): its inputs are this rank's load-balanced
    share of the sequence (see :func:`context_parallel_batch`). Apply after tensor parallel,
    whose input hook must see the sequence first."""
    cp, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    for attention in attentions:
        if implementation == "torch":
            attention.inner_attention = TorchContextParallelAttention()
        elif implementation == "titan_ring":
            attention.inner_attention = RingContextParallelAttention(cp_mesh)
        else:
            attention.inner_attention = ContextParallelAttention(cp_mesh)
        # torch's load balancing puts the same chunks on each rank as ours.
        attention.register_forward_pre_hook(_rope_for_positions(cp_rank, cp))


@contextlib.contextmanager
def context_parallel_batch(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    parallel_dims: ParallelDims,
    config: ParallelizeConfig,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Open context parallel for one step's forward and backward (run both, or a pipeline's
    ``step``, inside the ``with`` block) and yield this rank's ``(inputs, labels)``: the
    load-balanced share of their sequence (dim 1). Give every rank of a ``cp`` group the same
    full batch; the caller's tensors are never modified. Without context parallel it yields them
    unchanged. It resolves ``config.cp_attention`` at every call; ``step_context`` resolves it
    once."""
    if not parallel_dims.cp_enabled:
        yield inputs, labels
        return
    # Both checks raise before any communication (the cp mesh is not touched yet).
    context_parallel_positions(inputs.shape[1], 0, parallel_dims.cp)
    device_type = parallel_dims.device_type or detect_device_type()
    implementation = resolve_cp_attention(config.cp_attention, device_type)
    with open_context_parallel(
        inputs,
        labels,
        cp_mesh=parallel_dims.get_mesh("cp"),
        implementation=implementation,
        rotate_method=config.cp_rotate_method,
    ) as batch:
        yield batch


@contextlib.contextmanager
def open_context_parallel(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    cp_mesh: DeviceMesh,
    implementation: str,
    rotate_method: str = "allgather",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`context_parallel_batch` for an implementation already resolved
    (:func:`resolve_cp_attention`): yield this rank's share of ``(inputs, labels)``, with
    torch's ``context_parallel`` open around the block when ``implementation == "torch"``."""
    cp = cp_mesh.size()
    # Raises before any communication: a sequence that does not split into 2 x cp chunks
    # would make torch silently drop load balancing.
    context_parallel_positions(inputs.shape[1], 0, cp)
    if implementation != "torch":
        cp_rank = cp_mesh.get_local_rank()
        yield (
            context_parallel_shard(inputs, cp_rank, cp),
            context_parallel_shard(labels, cp_rank, cp),
        )
        return

    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate_method)
    # torch resizes its buffers in place: give it copies, which need no restoring. The RoPE
    # table is not among them: the attention input hook picks its rows by global position.
    inputs, labels = inputs.clone(), labels.clone()
    with context_parallel(
        cp_mesh,
        buffers=[inputs, labels],
        buffer_seq_dims=[1, 1],
        no_restore_buffers={inputs, labels},
    ):
        TorchContextParallelAttention.open_contexts += 1
        try:
            yield inputs, labels
        finally:
            TorchContextParallelAttention.open_contexts -= 1
