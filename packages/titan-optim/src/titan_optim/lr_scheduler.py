"""Warmup-stable-decay learning-rate schedules, one per optimizer of a container.

The schedule multiplies each param group's own lr by a factor of the step alone, so per-group
lrs keep their ratios. It follows torchtitan's ``linear_warmup_stable_decay`` step for step.
With ``T`` training steps, ``W`` warmup steps (at most ``T``), ``D`` decay steps
(``round(T * decay_ratio)``, or ``T - W`` when ``decay_ratio`` is ``None``; at most ``T -
W``) and ``S = T - W - D`` stable steps, the factor of 0-based step ``s`` is::

    s <  W              (s + 1) / W                         linear warmup, 1 at s = W - 1
    s <= W + S          1                                   stable (and the first decay step)
    s >  W + S          m + (1 - m) * curve(p),  p = min(1, (s - W - S) / D)

with ``m = min_lr_factor`` and ``curve`` = ``1 - p`` (linear), ``1 - sqrt(p)`` (sqrt) or
``(1 + cos(pi * p)) / 2`` (cosine): decay starts at the peak and reaches ``m`` at ``s = T``,
one step after the last training step (torchtitan's "virtual last step"). Past ``T``, steps
no run trains, titan stays at ``m`` (torchtitan's progress runs past 1) and at 1 with ``D =
0`` (torchtitan divides by zero).

Only the step count is saved: a resume with other lengths carries the position over and
applies the new schedule from the next step on."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from titan_optim.container import OptimizersContainer
from titan_optim.errors import check_choice, check_int, check_number

__all__ = [
    "DECAY_TYPES",
    "LRSchedulerConfig",
    "LRSchedulersContainer",
    "WarmupStableDecay",
    "build_lr_schedulers",
]

DECAY_TYPES = ("linear", "sqrt", "cosine")
"""Shapes of the decay phase."""


@dataclass(kw_only=True)
class LRSchedulerConfig:
    """How the learning rate moves over training: warmup, stable, decay.

    >>> LRSchedulerConfig(warmup_steps=10, decay_ratio=0.2, decay_type="cosine").min_lr_factor
    0.0
    """

    warmup_steps: int = 200
    """Steps of linear warmup from lr/warmup_steps to the peak lr."""
    decay_ratio: float | None = None
    """Fraction of the training steps spent decaying at the end; the steps between warmup
    and decay stay at the peak. ``None`` decays over every step after warmup."""
    decay_type: str = "linear"
    """Decay curve: ``linear``, ``sqrt`` or ``cosine``."""
    min_lr_factor: float = 0.0
    """The lr the decay ends at, as a fraction of the peak lr; in [0, 1]. Reached one step
    after the last training step, as in torchtitan, so no step trains at it."""

    def __post_init__(self) -> None:
        check_int("lr_scheduler.warmup_steps", self.warmup_steps, minimum=0)
        if self.decay_ratio is not None:
            self.decay_ratio = check_number(
                "lr_scheduler.decay_ratio", self.decay_ratio, low=0, high=1
            )
        check_choice("lr_scheduler.decay_type", self.decay_type, DECAY_TYPES)
        self.min_lr_factor = check_number(
            "lr_scheduler.min_lr_factor", self.min_lr_factor, low=0, high=1
        )


@dataclass(frozen=True, kw_only=True)
class WarmupStableDecay:
    """The lr factor of each step (see the module docstring), as resolved for a run.

    A plain callable with only numbers as state, so ``LambdaLR`` can hold and save it.
    """

    warmup_steps: int
    stable_steps: int
    decay_steps: int
    decay_type: str = "linear"
    min_lr_factor: float = 0.0

    @classmethod
    def from_config(cls, config: LRSchedulerConfig, training_steps: int) -> WarmupStableDecay:
        """Fit ``config`` to ``training_steps``, clamping impossible lengths with one warning."""
        check_int("training.steps", training_steps, minimum=1)
        notes = []
        warmup = config.warmup_steps
        if warmup > training_steps:
            notes.append(
                f"lr_scheduler.warmup_steps={warmup} is longer than training.steps="
                f"{training_steps}; warming up over all {training_steps} steps instead"
            )
            warmup = training_steps
        if config.decay_ratio is None:
            decay = training_steps - warmup
        else:
            decay = round(training_steps * config.decay_ratio)
            if warmup + decay > training_steps:
                notes.append(
                    f"warmup ({warmup}) + decay (decay_ratio={config.decay_ratio:g} x "
                    f"{training_steps} = {decay}) is longer than training.steps="
                    f"{training_steps}; decaying over the {training_steps - warmup} steps "
                    "after warmup instead"
                )
                decay = training_steps - warmup
        if notes:
            warnings.warn("; ".join(notes) + ".", UserWarning, stacklevel=3)
        return cls(
            warmup_steps=warmup,
            stable_steps=training_steps - warmup - decay,
            decay_steps=decay,
            decay_type=config.decay_type,
            min_lr_factor=config.min_lr_factor,
        )

    @property
    def training_steps(self) -> int:
        """``T``: the steps of the run this schedule was fitted to."""
        return self.warmup_steps + self.stable_steps + self.decay_steps

    def __call__(self, step: int) -> float:
        """The lr factor of 0-based step ``step`` (see the module docstring)."""
        w, s, d, m = self.warmup_steps, self.stable_steps, self.decay_steps, self.min_lr_factor
        if step < w:
            return (step + 1) / w
        if step <= w + s or d == 0:
            return 1.0
        # torchtitan's "+ 1" on both the stable length and the step cancel out here.
        p = min(1.0, (step - w - s) / d)
        if self.decay_type == "linear":
            curve = 1.0 - p
        elif self.decay_type == "sqrt":
            curve = 1.0 - math.sqrt(p)
        else:
            curve = 0.5 * (1.0 + math.cos(math.pi * p))
        return m + (1.0 - m) * curve


class LRSchedulersContainer:
    """One ``LambdaLR`` per optimizer of an ``OptimizersContainer``, stepped together; a
    ``Stateful``. The saved state is the shared step count alone, so it loads at another number
    of optimizers (another pipeline layout). The schedule owns the lr: loading an optimizer's
    state (which carries the lr it was saved with) sets every group's lr back to the schedule's
    at the current step, whichever loads first, so a resumed run trains at its schedule's lr."""

    def __init__(self, optimizers: OptimizersContainer, schedule: WarmupStableDecay) -> None:
        self.schedule = schedule
        self.schedulers = [LambdaLR(opt, schedule) for opt in optimizers]
        for scheduler in self.schedulers:
            scheduler.optimizer.register_load_state_dict_post_hook(
                functools.partial(_apply_schedule, scheduler)
            )

    def __iter__(self) -> Iterator[LambdaLR]:
        return iter(self.schedulers)

    def __len__(self) -> int:
        return len(self.schedulers)

    @property
    def last_step(self) -> int:
        """How many times :meth:`step` has been called (since the start of training)."""
        return self.schedulers[0].last_epoch if self.schedulers else 0

    def step(self) -> None:
        """Advance every schedule by one step; call once after each optimizer step."""
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        """The lr of every param group of every optimizer for the coming optimizer step
        (before the first :meth:`step`: the first training step's lr)."""
        return [lr for s in self.schedulers for lr in s.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        """``{"step": n}``: the shared step count (torchtitan's ``last_epoch``)."""
        return {"step": self.last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Move every schedule to the saved step and set the lrs this schedule gives it.

        Accepts torchtitan's key ``last_epoch`` for the step too (same meaning).
        """
        key = "step" if "step" in state_dict else "last_epoch"
        step = int(state_dict[key])
        for scheduler in self.schedulers:
            scheduler.last_epoch = step
            # _step_count > 1 tells LambdaLR the optimizer has stepped, as it had when saved.
            scheduler._step_count = step + 1
            _apply_schedule(scheduler, scheduler.optimizer)


def _apply_schedule(scheduler: LambdaLR, optimizer: torch.optim.Optimizer) -> None:
    """Set each group's lr to its base lr times the schedule's factor at the scheduler's
    step (also an optimizer ``load_state_dict`` post-hook, hence the argument order)."""
    step = scheduler.last_epoch
    lrs = [
        float(base) * fn(step)
        for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):  # a tensor lr (e.g. capturable) stays one
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    scheduler._last_lr = lrs


def build_lr_schedulers(
    optimizers: OptimizersContainer,
    config: LRSchedulerConfig | None = None,
    *,
    training_steps: int,
) -> LRSchedulersContainer:
    """One warmup-stable-decay scheduler per optimizer in ``optimizers``."""
    schedule = WarmupStableDecay.from_config(config or LRSchedulerConfig(), training_steps)
    return LRSchedulersContainer(optimizers, schedule)
