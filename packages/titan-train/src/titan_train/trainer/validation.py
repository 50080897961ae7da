"""Validation every ``freq`` steps: the mean loss per trained token of a held-out (finite)
dataset over all its batches and all data- and context-parallel ranks, normalized as
training normalizes a step (``titan_train.trainer.step``).

Each evaluation starts the data from its beginning, so every evaluation (at any layout) sees
the same sequences. Batches go through the training step's forward path (``batch_loss``,
in the plan's ``StepContext``), under a pipeline through the schedule's ``eval``;
``reduce_loss`` then gives every rank the same number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from titan_dims import ParallelDims
from titan_models import ParallelizeConfig, Pipeline, StepContext, reduce_loss, step_context
from titan_models.documents import DocumentMasking
from titan_train.data import DataSource, build_dataloader
from titan_train.data.config import IGNORE_INDEX
from titan_train.errors import ConfigError, check_int
from titan_train.tokenizer import Tokenizer
from titan_train.trainer.step import LossFn, batch_loss, cross_entropy_sum, loss_share

__all__ = ["ValidationConfig", "Validator"]


@dataclass(kw_only=True)
class ValidationConfig(DataSource):
    """Evaluate the loss of a validation dataset every ``freq`` training steps. Its data keys
    are ``training``'s (``dataset``, ``dataset_path``, ``text_column``); the default is the
    training corpus itself (titan ships no held-out split): point it at your own."""

    SECTION: ClassVar[str] = "validation"

    enable: bool = False
    """Run validation during training."""
    freq: int = 10
    """Validate after every this many training steps (and after the last step)."""
    steps: int = -1
    """Batches per validation; -1 means the whole (finite) dataset."""
    local_batch_size: int = 8
    """Sequences per rank per validation batch."""
    seq_len: int = 512
    """Tokens per validation sequence."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("freq", "local_batch_size", "seq_len"):
            check_int(f"validation.{key}", getattr(self, key), minimum=1)
        check_int("validation.steps", self.steps, minimum=1, sentinel=(-1, "the whole dataset"))


class Validator:
    """The validation loss of a model (or this rank's pipeline stages), data sharded over
    ``dims``' data-parallel ranks; ``step_context`` (``None``: from ``dims``), ``loss_fn`` and
    ``documents`` are the training run's."""

    def __init__(
        self,
        config: ValidationConfig,
        tokenizer: Tokenizer,
        *,
        dims: ParallelDims,
        dp_rank: int = 0,
        device: torch.device,
        step_context: StepContext | None = None,
        loss_fn: LossFn = cross_entropy_sum,
        documents: DocumentMasking | None = None,
    ) -> None:
        self.config = config
        self.loss_fn = loss_fn
        self.documents = documents
        self.dims = dims
        self.device = device
        self.step_context = step_context or _default_context(dims)
        data = config.data_config(
            seq_len=config.seq_len, local_batch_size=config.local_batch_size, infinite=False
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
    def validate(self, model_parts: list[nn.Module], pipeline: Pipeline | None = None) -> float:
        """The validation loss per trained token, the same on every rank; ``pipeline``: the
        model's ``Pipeline`` (``model_parts`` its stages) when pipelined."""
        # Each part goes back to the mode it had, also when an evaluation fails (a caller that
        # catches the error keeps training, which must not go on in eval mode).
        modes = [part.training for part in model_parts]
        for part in model_parts:
            part.eval()
        try:
            self.dataloader.load_state_dict(self._start)  # every evaluation sees the same data
            total = torch.zeros((), device=self.device, dtype=torch.float64)
            count = torch.zeros((), device=self.device, dtype=torch.int64)
            for batches, (inputs, labels) in enumerate(self.dataloader):
                if self.config.steps != -1 and batches == self.config.steps:
                    break
                loss = batch_loss(
                    model_parts,
                    pipeline,
                    self.step_context,
                    inputs.to(self.device),
                    labels.to(self.device),
                    loss_fn=self.loss_fn,
                    documents=self.documents,
                )
                if loss is not None:  # only a pipeline's last stage has the loss
                    total += loss.double()
                count += (labels != IGNORE_INDEX).sum().to(self.device)
        finally:
            for part, mode in zip(model_parts, modes, strict=True):
                part.train(mode)
        if self.dims.dp_enabled:  # the trained tokens of all data-parallel ranks
            dist.all_reduce(count, group=self.dims.get_mesh("dp").get_group())
        # Pipeline ranks without the last stage contribute zeros to the sum over stages.
        return float(reduce_loss(total * loss_share(self.dims, count).double(), self.dims))


def _default_context(dims: ParallelDims) -> StepContext:
    # Without the plan's context: the model computes in its own dtype (no autocast).
    return step_context(dims, ParallelizeConfig(param_dtype="float32"))
