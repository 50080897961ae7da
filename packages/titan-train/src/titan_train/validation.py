"""Validation every ``freq`` steps: the mean loss of a held-out (finite) dataset, under
``torch.no_grad``, averaged over the data-parallel and context-parallel ranks.

Each evaluation starts the validation data from its beginning, so every evaluation of a
run (and of runs at other parallel layouts) sees the same sequences. With pipeline
parallelism the batches go forward-only through the pipeline schedule (its ``eval``
path); only the last stage sees the loss, which is then summed over the pipeline group so
every rank reports the same number.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titan_dims import ParallelDims
from titan_train.data import DataConfig, build_dataloader
from titan_train.errors import ConfigError, check_int
from titan_train.tokenizer import Tokenizer

__all__ = ["ValidationConfig", "Validator"]


@dataclass(kw_only=True)
class ValidationConfig:
    """Evaluate the loss of a validation dataset every ``freq`` training steps."""

    enable: bool = False
    """Run validation during training."""
    dataset: str = "embedded"
    """Like ``training.dataset``: ``embedded``, a local json/jsonl/parquet/txt file or
    folder, a format name with ``dataset_path``, or a Hugging Face hub name. The default is
    the training corpus itself (titan ships no held-out split): point it at your own."""
    dataset_path: str | None = None
    """Where the dataset's files are, when ``dataset`` names a hub dataset or a format."""
    freq: int = 10
    """Validate after every this many training steps (and after the last step)."""
    steps: int = -1
    """Batches per validation; -1 means the whole (finite) dataset."""
    local_batch_size: int = 8
    """Sequences per rank per validation batch."""
    seq_len: int = 512
    """Tokens per validation sequence."""

    def __post_init__(self) -> None:
        for key in ("freq", "local_batch_size", "seq_len"):
            check_int(f"validation.{key}", getattr(self, key), minimum=1)
        check_int("validation.steps", self.steps, minimum=1, sentinel=(-1, "the whole dataset"))


class Validator:
    """Computes the validation loss of a model (or of this rank's pipeline stages).

    Args:
        config: the ``[validation]`` section.
        tokenizer: the training tokenizer.
        dims: the run's parallel layout (data is sharded over its data-parallel ranks).
        dp_rank: this rank's index among the data-parallel ranks.
        device: where batches go.
        loss_fn: ``loss_fn(logits, labels)`` -> mean loss of a batch.
        loss_context: a context-manager factory the loss must be computed in (loss
            parallel under tensor parallelism).
        sequence_context: ``sequence_context(inputs, labels)`` is a context manager around a
            forward that yields this rank's share of the whole (batch, seq) tensors (context
            parallel, see ``titan_models.context_parallel_batch``); ``None`` feeds them whole.
        pipeline_microbatches: with pipeline parallelism, the schedule's number of
            microbatches (the validation batch is split into as many); ``None`` otherwise.
    """

    def __init__(
        self,
        config: ValidationConfig,
        tokenizer: Tokenizer,
        *,
        dims: ParallelDims,
        dp_rank: int = 0,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        loss_context: Callable[[], contextlib.AbstractContextManager[Any]],
        sequence_context: Callable[
            [torch.Tensor, torch.Tensor],
            contextlib.AbstractContextManager[tuple[torch.Tensor, torch.Tensor]],
        ]
        | None = None,
        pipeline_microbatches: int | None = None,
    ) -> None:
        if pipeline_microbatches and config.local_batch_size % pipeline_microbatches:
            raise ConfigError(
                f"validation.local_batch_size={config.local_batch_size} must be a multiple of "
                f"the pipeline's {pipeline_microbatches} microbatches (training.local_batch_size"
                " x accumulation steps / pipeline.microbatch_size) under pipeline parallelism; "
                f"e.g. {pipeline_microbatches}."
            )
        self.config = config
        self.dims = dims
        self.device = device
        self.loss_fn = loss_fn
        self.loss_context = loss_context
        self.sequence_context = sequence_context or _whole_batch
        data = DataConfig(
            dataset=config.dataset,
            dataset_path=config.dataset_path,
            seq_len=config.seq_len,
            local_batch_size=config.local_batch_size,
            infinite=False,
        )
        self.dataloader = build_dataloader(
            data, tokenizer, dp_rank=dp_rank, dp_degree=dims.dp_degree
        )
        self._start = self.dataloader.state_dict()
        # Refuse a set too small for one batch now, before training starts.
        if next(iter(self.dataloader), None) is None:
            raise ConfigError(
                f"validation dataset {config.dataset!r} has fewer tokens than one validation "
                f"step ({config.local_batch_size} x {dims.dp_degree} sequences of "
                f"{config.seq_len + 1} tokens); lower validation.local_batch_size or seq_len."
            )

    def should_validate(self, step: int, last_step: int) -> bool:
        """Whether to validate after training step ``step``."""
        return self.config.enable and (step % self.config.freq == 0 or step == last_step)

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module], pipeline: Any = None) -> float:
        """The mean validation loss, the same on every rank. ``pipeline`` is the
        ``titan_models`` Pipeline when the model is pipelined (``model_parts`` its stages)."""
        for part in model_parts:
            part.eval()
        self.dataloader.load_state_dict(self._start)  # every evaluation sees the same data
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        batches = 0
        for inputs, labels in self.dataloader:
            if self.config.steps != -1 and batches == self.config.steps:
                break
            whole = inputs.to(self.device), labels.to(self.device)
            with self.sequence_context(*whole) as (inputs, labels), self.loss_context():
                if pipeline is None:
                    loss = self.loss_fn(model_parts[0](inputs), labels)
                else:
                    loss = _pipeline_eval_loss(pipeline, inputs, labels)
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            if loss is not None:
                total += loss.double()
            batches += 1
        for part in model_parts:
            part.train()
        if self.dims.pp_enabled:
            # Only the last stage saw the losses; the others contribute zeros.
            dist.all_reduce(total, group=self.dims.get_mesh("pp").get_group())
        mean = total / batches
        if self.dims.dp_cp_enabled:
            # Every dp x cp rank evaluated as many tokens: the mean of their means.
            dist.all_reduce(
                mean, op=dist.ReduceOp.AVG, group=self.dims.get_mesh("dp_cp").get_group()
            )
        return float(mean)


@contextlib.contextmanager
def _whole_batch(
    inputs: torch.Tensor, labels: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    yield inputs, labels


def _pipeline_eval_loss(
    pipeline: Any, inputs: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor | None:
    """Forward-only through the schedule; the mean microbatch loss on the last stage's rank,
    ``None`` elsewhere."""
    losses: list[torch.Tensor] = []
    args = (inputs,) if pipeline.has_first_stage else ()
    kwargs = {"target": labels, "losses": losses} if pipeline.has_last_stage else {}
    pipeline.schedule.eval(*args, **kwargs)
    if not pipeline.has_last_stage:
        return None
    plain = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]
    return torch.stack(plain).mean()
