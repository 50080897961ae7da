"""How a parallel plan is driven at every step, handed out beside the plan.

``step_context(parallel_dims, config, seq_len=...)`` checks the per-step rules once and
returns a :class:`StepContext`: ``with context(inputs, labels) as (inputs, labels):`` opens
context parallel (resolved once), loss parallel and, for mixed precision without FSDP,
autocast, so a trainer steps alike whatever the layout. :func:`reduce_loss` makes a rank's
loss the job's: summed over pipeline stages, averaged over data- and context-parallel ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_dims import ParallelDims, detect_device_type
from titan_models.errors import ModelConfigError
from titan_models.ops import plain_loss
from titan_models.parallel import data_parallel
from titan_models.parallel.config import ParallelizeConfig
from titan_models.parallel.context_parallel import open_context_parallel, resolve_cp_attention
from titan_models.parallel.data_parallel import resolve_param_dtype

__all__ = [
    "StepContext",
    "autocast_dtype",
    "check_seq_len",
    "plain_loss",
    "reduce_loss",
    "step_context",
]


def check_seq_len(seq_len: int, parallel_dims: ParallelDims, *, name: str = "seq_len") -> None:
    """Raise ``ModelConfigError`` unless ``seq_len`` splits as the layout needs: a multiple of
    ``parallel_dims.seq_len_divisor`` = tp x cp x 2. ``name`` is how the caller's user
    knows the setting (e.g. ``training.seq_len``)."""
    divisor = parallel_dims.seq_len_divisor
    if seq_len % divisor:
        below = seq_len // divisor * divisor
        allowed = " or ".join(str(n) for n in (below, below + divisor) if n > 0)
        raise ModelConfigError(
            f"{name}={seq_len} must be divisible by {divisor} = tensor_parallel_degree "
            f"({parallel_dims.tp}) x context_parallel_degree ({parallel_dims.cp}) x 2 (sequence "
            "parallel splits a sequence tp ways, load-balanced context parallel into 2 x cp "
            f"chunks); e.g. {allowed}."
        )


@dataclass(frozen=True)
class StepContext:
    """The per-step context of one parallel plan (build it with :func:`step_context`):
    ``with context(inputs, labels) as (inputs, labels):`` around each step's forward and backward
    (or ``Pipeline.step``/``eval``) yields this rank's share of the batch (its part of the
    sequence under context parallel), with torch's ``context_parallel`` and ``loss_parallel``
    open where the plan needs them."""

    parallel_dims: ParallelDims
    cp_attention: str | None
    """The context-parallel implementation (``titan``, ``titan_ring``, ``torch``), resolved
    once; ``None`` without context parallel."""
    loss_parallel: bool
    """Whether the loss must be computed inside ``loss_parallel()`` (tensor parallel with
    sharded logits)."""
    cp_rotate_method: str = "allgather"
    """How torch's context parallel passes K/V (``cp_attention == "torch"`` only)."""
    autocast_dtype: torch.dtype | None = None
    """The compute dtype of ``torch.autocast`` around the step, for mixed precision without
    FSDP (whose parameter dtype does it otherwise); ``None``: no autocast."""

    @contextlib.contextmanager
    def __call__(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        with contextlib.ExitStack() as stack:
            if self.cp_attention is not None:
                inputs, labels = stack.enter_context(
                    open_context_parallel(
                        inputs,
                        labels,
                        cp_mesh=self.parallel_dims.get_mesh("cp"),
                        implementation=self.cp_attention,
                        rotate_method=self.cp_rotate_method,
                    )
                )
            if self.loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            if self.autocast_dtype is not None:
                # Around the whole step, as a pipeline schedule interleaves forward and
                # backward; backward ops take the dtypes autocast chose in forward.
                device_type = self.parallel_dims.device_type or detect_device_type()
                stack.enter_context(torch.autocast(device_type, dtype=self.autocast_dtype))
            yield inputs, labels


def step_context(
    parallel_dims: ParallelDims,
    config: ParallelizeConfig | None = None,
    *,
    seq_lens: dict[str, int] | None = None,
) -> StepContext:
    """The :class:`StepContext` of a model parallelized by ``parallel_dims`` and ``config``.

    Checks, before any work, every rule a step depends on: each of ``seq_lens`` (name ->
    length, e.g. ``{"training.seq_len": 2048}``) against the layout (:func:`check_seq_len`),
    and that the chosen context-parallel implementation runs on this device. Needs no
    process group until the context is entered.
    """
    config = config or ParallelizeConfig()
    for name, seq_len in (seq_lens or {}).items():
        check_seq_len(seq_len, parallel_dims, name=name)
    implementation = None
    if parallel_dims.cp_enabled:
        device_type = parallel_dims.device_type or detect_device_type()
        implementation = resolve_cp_attention(config.cp_attention, device_type)
    return StepContext(
        parallel_dims=parallel_dims,
        cp_attention=implementation,
        loss_parallel=parallel_dims.tp_enabled and config.loss_parallel,
        cp_rotate_method=config.cp_rotate_method,
        autocast_dtype=autocast_dtype(parallel_dims, config),
    )


def autocast_dtype(parallel_dims: ParallelDims, config: ParallelizeConfig) -> torch.dtype | None:
    """The dtype to autocast a step to: ``config.param_dtype`` as the device resolves it, when
    it is not fp32 and FSDP is off (with FSDP its mixed-precision policy computes in that dtype,
    as torchtitan). A CPU without bf16 instructions keeps fp32 even when ``bfloat16`` is asked
    for (torchtitan's TOML default): there bf16 matmuls run hundreds of times slower."""
    if parallel_dims.fsdp_enabled:
        return None
    device_type = parallel_dims.device_type or detect_device_type()
    dtype = resolve_param_dtype(config.param_dtype, device_type)
    if dtype == torch.float32 or (device_type == "cpu" and not data_parallel.cpu_has_fast_bf16()):
        return None
    return dtype


def reduce_loss(
    loss: torch.Tensor | None,
    parallel_dims: ParallelDims,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The job's loss from this rank's (a collective: every rank of the job calls it).

    ``loss`` is this rank's mean loss, ``None`` on a pipeline rank without the last stage
    (it contributes zeros to the pipeline sum, which is exact: one stage holds the loss).
    Summed over the ``pp`` ranks, then averaged over the ``dp_cp`` ranks (each saw as many
    tokens). Returns a new plain tensor; ``loss`` is not modified.
    """
    if loss is None:
        if not parallel_dims.pp_enabled:
            raise ValueError("reduce_loss got no loss, which only pipeline ranks may pass.")
        loss = torch.zeros((), device=device)
    else:
        loss = plain_loss(loss).detach().clone()
    if parallel_dims.pp_enabled:
        dist.all_reduce(loss, group=parallel_dims.get_mesh("pp").get_group())
    if parallel_dims.dp_cp_enabled:
        group = parallel_dims.get_mesh("dp_cp").get_group()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
    return loss
