"""One training step, and the one forward path training and validation share.

``train_step(run, batches)`` runs a whole optimizer step: clear gradients (which also starts
torchft's quorum), forward and backward of every micro-batch (gradient accumulation, or the
pipeline's microbatches), clipping (torchft averages gradients first, inside its optimizer
container), the non-finite guard, the optimizer and LR steps. It returns a ``StepResult``
of tensors and counts: nothing in it waits for the device, except the one finiteness check
of the gradient norm that deciding to skip an update needs. Reducing the loss over the
ranks and reading numbers on the host happen only on reporting steps (``report_step``).

The loss is normalized by trained tokens (labels other than ``IGNORE_INDEX``) over the whole
global batch: the step's loss is the sum of its token losses, over every micro-batch of
every data-parallel rank, divided by the number of trained tokens among them all
(``trained_tokens``: counted on the host's batches and all-reduced over the data-parallel
ranks, once per step, before any backward). Each micro-batch backpropagates its summed loss
times ``dp x cp / that count``; the gradient averaging of FSDP or DDP over the ``dp x cp``
ranks then leaves the gradient of the global per-token mean. A conversation's long prompt
thus weighs no less than a short one's, whichever micro-batch or rank it lands on; with
every token trained (pretraining) it is the mean over micro-batches of their mean losses,
as before. Under pipeline parallelism the schedule averages its microbatches' mean losses,
which is the same only when every token is trained (``preflight`` refuses chat data there).
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
    """Summed next-token cross entropy of the trained tokens of ``(batch, seq, vocab)``
    logits (labels other than ``IGNORE_INDEX``), computed in fp32: the training loss,
    divided by the global batch's trained tokens in the step (``trained_tokens``)."""
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
    """The training (and validation) loss: ``cross_entropy_sum``, compiled with
    ``config.compile_backend`` when ``config.compile`` is on, as torchtitan does. Eager, the
    loss writes an fp32 copy of the whole ``(tokens x vocab)`` logits (~4 GB per 8k tokens at
    a 128k vocabulary) and its gradient; compiled, the upcast fuses into the softmax and
    loss kernels.

    ``loss_parallel``: the logits arrive sharded over the vocabulary (DTensor) and the loss
    runs under ``loss_parallel()``, whose trace holds this rank's vocabulary offset as a
    constant. torch 2.13's AOTAutograd cache keys the compiled loss without it, so a later
    run (or rank) on the machine would load another rank's offset and a wrong loss (measured
    on 2 gloo ranks: 4.48 for 5.32); this loss is then compiled past that cache."""
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
    """This rank's share of the step's loss (plain, detached): its trained tokens' summed
    loss x ``dp x cp`` / the step's trained tokens over all ranks, so that
    ``titan_models.reduce_loss`` (an average over the ``dp x cp`` ranks) gives the job's
    loss per trained token. ``None`` on a pipeline rank without the last stage."""
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
    """The summed loss of one whole batch's trained tokens on this rank (its share of the
    sequence under context parallel): a plain, detached tensor; ``None`` on a pipeline rank
    without the last stage. Runs inside the plan's step context.

    ``scale`` trains: the backward of ``loss x scale`` runs too (``dp x cp`` / the step's
    trained tokens, ``train_step``). Under a pipeline its schedule runs the backward of each
    microbatch's mean loss, averaged over microbatches, and the sum comes back as that mean
    x the batch's trained tokens. ``None`` evaluates only (call it under ``torch.no_grad``).
    ``documents``: document masking, its keywords (``document_ids``, ``positions``)
    computed from ``inputs`` for the model's forward (every pipeline stage's)."""
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
    """The trained tokens (labels other than ``IGNORE_INDEX``) of ``labels`` (this rank's
    batches, whole sequences) summed over the data-parallel ranks: one all-reduce over the
    ``dp`` mesh. The ranks of a context-parallel group hold the same whole batch, so only
    ``dp`` is summed."""
    count = torch.stack([(batch != IGNORE_INDEX).sum() for batch in labels]).sum()
    if dims.dp_enabled:
        dist.all_reduce(count, group=dims.get_mesh("dp").get_group())
    return count


def loss_share(dims: ParallelDims, count: torch.Tensor) -> torch.Tensor:
    """What a rank multiplies its summed loss by: ``dp x cp / count`` (``count``: the trained
    tokens of the global batch, ``trained_tokens``). The gradients of the ``dp x cp`` ranks
    are averaged (FSDP, DDP) and ``reduce_loss`` averages losses over them: with this
    factor both end as the global batch's sum over its trained tokens. A batch without one
    (``count`` 0) gives 0, not a division by zero."""
    return dims.dp_degree * dims.cp / count.clamp(min=1).to(torch.float32)


def next_batches(
    batch_iter: Iterator[Batch], count: int, device: torch.device
) -> tuple[list[Batch], float]:
    """The next ``count`` (inputs, labels) batches on ``device``, and seconds spent waiting.

    On the accelerator, batches are copied from pinned host memory without blocking: a
    pageable copy would make the host wait for the device at every micro-batch (untested on
    a GPU so far). On the CPU they are moved as they are."""
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
    """One optimizer step of ``run`` over ``batches`` (its accumulation steps' micro-batches);
    advances ``run.train_state``. Raises ``NonFiniteStepsError`` past the allowed run of
    inf/nan gradient norms, before the step's update."""
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
    """Forward and backward of every micro-batch, the loss normalized by the global batch's
    trained tokens (the module docstring); this rank's share of the step's loss (``None``
    on a pipeline rank without the last stage)."""
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
    """Account the step in the metrics. On reporting steps only (``metrics.should_log``) the
    loss is reduced over the ranks and numbers are read on the host: that read waits for
    the device, so the clock is read after it and the step time stays honest."""
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
    """Skipped steps (when clipping reads the norm), the tokens taken from each source of a
    dataset mixture, and the model family's own numbers (``ModelSpec.metrics_fn``); read at
    reporting steps only."""
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
