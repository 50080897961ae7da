"""One training step, and the one forward path training and validation share.

``train_step(run, batches)`` runs a whole optimizer step (zero_grad, which starts torchft's
quorum; every micro-batch's forward and backward; clipping; the non-finite guard; optimizer
and LR steps) and returns a ``StepResult`` on the device: its one host sync is the gradient
norm's finiteness. The loss is reduced over ranks only on reporting steps (``report_step``).

The loss is normalized by the global batch's trained tokens (labels not ``IGNORE_INDEX``):
each micro-batch backpropagates its summed loss times ``dp x cp / count`` (``count``
all-reduced once per step), and FSDP's or DDP's averaging leaves the gradient of the global
per-token mean wherever a long prompt lands. A pipeline schedule averages its microbatches'
mean losses, the same only when every token is trained (``preflight`` refuses chat data).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_ckpt import CheckpointManager
from titan_dims import ParallelDims
from titan_models import ParallelizeConfig, Pipeline, StepContext, plain_loss, reduce_loss
from titan_models.documents import DocumentMasking
from titan_optim import LRSchedulersContainer, Optimizers
from titan_train.data.config import IGNORE_INDEX
from titan_train.fault_tolerance import ReplicaGroup
from titan_train.metrics import MetricsLogger, StepTokens, tokens_of_step
from titan_train.trainer.nonfinite import NonFiniteGuard
from titan_train.trainer.state import TrainState

__all__ = [
    "Batch",
    "LossFn",
    "StepResult",
    "StepRun",
    "batch_loss",
    "build_loss_fn",
    "cross_entropy_loss",
    "cross_entropy_sum",
    "loss_share",
    "mean_loss",
    "next_batches",
    "report_step",
    "train_step",
    "trained_tokens",
]

Batch = tuple[torch.Tensor, torch.Tensor]
"""``(inputs, labels)``, each ``(batch, seq_len)`` token ids."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(logits, labels)``: the summed loss of one batch's trained tokens."""


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``(batch, seq, vocab)`` logits over the trained
    tokens (labels other than ``IGNORE_INDEX``), computed in fp32."""
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX
    )


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy, in fp32, of the trained tokens (labels not
    ``IGNORE_INDEX``) of ``(batch, seq, vocab)`` logits."""
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def mean_loss(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` (a summed loss) divided by the batch's trained tokens: the mean loss per
    trained token a pipeline schedule takes for each microbatch."""

    def mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, labels) / (labels != IGNORE_INDEX).sum().clamp(min=1)

    return mean


def build_loss_fn(config: ParallelizeConfig, *, loss_parallel: bool = False) -> LossFn:
    """The training (and validation) loss: ``cross_entropy_sum``, compiled when
    ``config.compile`` is on (eager, it writes an fp32 copy of the whole logits, ~4 GB per 8k
    tokens at a 128k vocabulary; compiled, the upcast fuses into the kernels).

    ``loss_parallel``: vocabulary-sharded logits, whose trace holds this rank's vocabulary
    offset as a constant; torch 2.13's AOTAutograd cache keys it without the offset (another
    rank's loaded: 4.48 for 5.32 on 2 gloo ranks), so this loss is compiled past that cache."""
    if not config.compile:
        return cross_entropy_sum
    compiled = torch.compile(cross_entropy_sum, backend=config.compile_backend)
    if not loss_parallel:
        return compiled

    def sharded_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Compilation happens inside the first call: the patch must be on then.
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compiled(logits, labels)

    return sharded_loss


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step produced, still on the device."""

    step: int
    """The step just taken (1-based)."""
    loss: torch.Tensor | None
    """This rank's share of the step's loss (plain, detached; ``reduce_loss`` over ``dp x cp``
    gives the per-token loss); ``None`` on a pipeline rank without the last stage."""
    grad_norm: torch.Tensor | None
    """The global gradient norm before clipping; ``None`` with clipping off."""
    tokens: StepTokens
    """Tokens of the whole step (all ranks and replica groups) and the devices sharing it."""
    lr: float
    """The learning rate this step trained with."""


class StepRun(Protocol):
    """What ``train_step`` and ``report_step`` read of a run: ``TrainingRun`` has it all; a
    loop of your own may pass any object with these attributes."""

    @property
    def model_parts(self) -> list[nn.Module]: ...
    @property
    def pipeline(self) -> Pipeline | None: ...
    @property
    def step_context(self) -> StepContext: ...
    @property
    def loss_fn(self) -> LossFn: ...
    @property
    def documents(self) -> DocumentMasking | None: ...
    @property
    def optimizers(self) -> Optimizers: ...
    @property
    def schedulers(self) -> LRSchedulersContainer: ...
    @property
    def checkpointer(self) -> CheckpointManager: ...
    @property
    def train_state(self) -> TrainState: ...
    @property
    def nonfinite(self) -> NonFiniteGuard: ...
    @property
    def replicas(self) -> ReplicaGroup | None: ...
    @property
    def metrics(self) -> MetricsLogger | None: ...
    @property
    def dataloader(self) -> object: ...
    @property
    def parallel_dims(self) -> ParallelDims: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def pp_mesh(self) -> DeviceMesh | None: ...
    @property
    def max_norm(self) -> float: ...
    @property
    def metrics_fn(self) -> Callable[[Sequence[nn.Module]], Mapping[str, float]] | None: ...


def batch_loss(
    model_parts: list[nn.Module],
    pipeline: Pipeline | None,
    context: StepContext,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    scale: torch.Tensor | float | None = None,
    loss_fn: LossFn = cross_entropy_sum,
    documents: DocumentMasking | None = None,
) -> torch.Tensor | None:
    """This rank's summed loss of a batch's trained tokens in the step context, detached
    (``None`` on a pipeline rank without the last stage). ``scale``: also backward of ``loss
    x scale`` (a pipeline's: of its microbatches' mean, returning mean x trained tokens;
    ``None``: under ``no_grad``); ``documents``: masking keywords from ``inputs``."""
    with context(inputs, labels) as (inputs, labels):
        kwargs = {} if documents is None else documents.forward_kwargs(inputs)
        if pipeline is not None:
            run = pipeline.step if scale is not None else pipeline.eval
            mean = run(inputs, labels, **kwargs)
            return None if mean is None else mean * (labels != IGNORE_INDEX).sum()
        loss = loss_fn(model_parts[0](inputs, **kwargs), labels)
        if scale is not None:
            (loss * scale).backward()
    # Under loss parallel the loss is a replicated DTensor; hand out its plain value.
    return plain_loss(loss.detach())


def trained_tokens(labels: list[torch.Tensor], dims: ParallelDims) -> torch.Tensor:
    """The trained tokens of this rank's ``labels`` summed over the ``dp`` mesh (one
    all-reduce; a context-parallel group holds one whole batch, so only ``dp``)."""
    count = torch.stack([(batch != IGNORE_INDEX).sum() for batch in labels]).sum()
    if dims.dp_enabled:
        dist.all_reduce(count, group=dims.get_mesh("dp").get_group())
    return count


def loss_share(dims: ParallelDims, count: torch.Tensor) -> torch.Tensor:
    """What a rank multiplies its summed loss by, ``dp x cp / count`` (``count``: the global
    batch's trained tokens; 0 gives 0), so averaging over ranks ends as the token mean."""
    return dims.dp_degree * dims.cp / count.clamp(min=1).to(torch.float32)


def next_batches(
    batch_iter: Iterator[Batch], count: int, device: torch.device
) -> tuple[list[Batch], float]:
    """The next ``count`` batches on ``device`` and the seconds waited; to an accelerator copied
    from pinned memory without blocking (a pageable copy waits every micro-batch)."""
    started = time.perf_counter()
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    pinned = accelerator is not None and device.type == accelerator.type
    out = []
    for _ in range(count):
        batch = next(batch_iter)
        if pinned:  # the caching host allocator keeps the pinned source alive until copied
            inputs, labels = (t.pin_memory().to(device, non_blocking=True) for t in batch)
        else:
            inputs, labels = (t.to(device) for t in batch)
        out.append((inputs, labels))
    return out, time.perf_counter() - started


def train_step(run: StepRun, batches: list[Batch]) -> StepResult:
    """One optimizer step of ``run`` over ``batches``, advancing ``run.train_state``;
    ``NonFiniteStepsError`` past the allowed inf/nan norms, before the update."""
    state = run.train_state
    state.step += 1
    run.optimizers.zero_grad()
    loss = _forward_backward(run, batches)
    mirrored = []
    if run.pipeline is not None:
        # Tied embeddings split over the first and last stage: each end gets the sum.
        run.pipeline.sync_tied_grads()
        mirrored = run.pipeline.mirrored_parameters
    replica_groups = 1 if run.replicas is None else run.replicas.participants()
    tokens = tokens_of_step(
        sum(labels.numel() for _, labels in batches), run.parallel_dims, replica_groups
    )
    grad_norm = None
    if run.max_norm > 0:
        grad_norm = run.optimizers.clip_grad_norm_(
            run.max_norm, pp_group=run.pp_mesh, mirrored=mirrored
        )
        # Past the limit this raises: before the step's update and its checkpoint.
        run.nonfinite.observe(state.step, grad_norm)
    run.checkpointer.maybe_wait_for_staging()
    run.optimizers.step()
    # After the optimizer step: a torchft replica group that heals loads its peer's train
    # state there (as of before this step's tokens), and must count this step's tokens too.
    state.tokens_seen += tokens.global_tokens
    lr = run.schedulers.get_last_lr()[0]  # the lr this step trained with
    run.schedulers.step()
    return StepResult(step=state.step, loss=loss, grad_norm=grad_norm, tokens=tokens, lr=lr)


def _forward_backward(run: StepRun, batches: list[Batch]) -> torch.Tensor | None:
    """Forward and backward of every micro-batch; this rank's share of the step's loss."""
    dims = run.parallel_dims
    scale = loss_share(dims, trained_tokens([labels for _, labels in batches], dims))
    if run.pipeline is not None:
        # One schedule step over all micro-batches, concatenated: the schedule splits them
        # into its microbatches and divides the gradients by their count.
        inputs = torch.cat([inputs for inputs, _ in batches])
        labels = torch.cat([labels for _, labels in batches])
        loss = batch_loss(
            run.model_parts,
            run.pipeline,
            run.step_context,
            inputs,
            labels,
            scale=scale,
            documents=run.documents,
        )
        return None if loss is None else loss * scale
    loss_sum = torch.zeros((), device=batches[0][1].device)
    for inputs, labels in batches:
        loss_sum += batch_loss(
            run.model_parts,
            None,
            run.step_context,
            inputs,
            labels,
            scale=scale,
            loss_fn=run.loss_fn,
            documents=run.documents,
        )
    return loss_sum * scale


def report_step(run: StepRun, result: StepResult, *, started: float, data_seconds: float) -> None:
    """Account the step in the metrics; only on reporting steps is the loss reduced and read
    on the host (waiting for the device, so the clock is read after it)."""
    reporting = run.metrics.should_log(result.step)
    loss = grad_norm = None
    if reporting:
        loss = reduce_loss(result.loss, run.parallel_dims, device=run.device).item()
        grad_norm = None if result.grad_norm is None else float(result.grad_norm)
    run.metrics.log(
        step=result.step,
        loss=loss,
        grad_norm=grad_norm,
        lr=result.lr,
        tokens=result.tokens.global_tokens,
        devices=result.tokens.devices,
        step_seconds=time.perf_counter() - started,
        data_seconds=data_seconds,
        extra=_extra_metrics(run, result) if reporting else None,
    )


def _extra_metrics(run: StepRun, result: StepResult) -> dict[str, float]:
    """Skipped steps, a mixture's tokens per source, and the family's ``metrics_fn``."""
    extra: dict[str, float] = {}
    if result.grad_norm is not None:
        extra["skipped_steps"] = run.nonfinite.skipped
    tokens_by_source = getattr(run.dataloader, "tokens_by_source", None)
    if tokens_by_source is not None:  # a dataset mixture: tokens taken from each source
        extra.update({f"tokens_seen/{k}": v for k, v in tokens_by_source().items()})
    metrics_fn = run.metrics_fn
    if metrics_fn is not None:
        extra.update(metrics_fn(run.model_parts))
    return extra
