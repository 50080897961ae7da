"""What a run does when the gradient norm is inf or nan: skip the update, a bounded number of
times in a row, then stop.

The optimizer container already skips the update of a step whose clipped gradient norm is
not finite (the weights stay as they were). Without a bound that repeats silently forever
once training diverged. ``NonFiniteGuard`` bounds it: up to ``training.skip_nonfinite_steps``
consecutive skipped steps, each with one warning line; the next one stops the run with
``NonFiniteStepsError``, before that step's checkpoint, so the last committed step (which
holds finite weights: no skipped update touched them) stays the resume point. The total is
reported in the metrics as ``skipped_steps``.

The norm is the one clipping computes, the same on every rank, so every rank decides alike;
with clipping off (``training.max_norm = 0``) no norm exists and nothing is skipped or
counted. The guard takes the norm as a device tensor and reads only whether it is finite:
the one host sync per step that deciding to skip an update needs (clipping already waited
for the norm to decide the same); the value itself is read only on the rare bad step.
"""

from __future__ import annotations

import logging
import math

import torch

from titan_train.errors import NonFiniteStepsError

__all__ = ["NonFiniteGuard", "NonFiniteStepsError"]

logger = logging.getLogger("titan_train")


class NonFiniteGuard:
    """Counts steps whose gradient norm is not finite; raises past ``limit`` in a row.

    Args:
        limit: consecutive non-finite steps to skip (``training.skip_nonfinite_steps``);
            0 stops at the first.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.consecutive = 0
        """Non-finite steps in a row, up to the last one observed."""
        self.skipped = 0
        """Non-finite steps skipped in this process, in all."""

    def observe(self, step: int, grad_norm: torch.Tensor | float | None) -> bool:
        """Account ``step``; True if its update is skipped. Raises ``NonFiniteStepsError``
        when this makes more than ``limit`` in a row. ``grad_norm`` may be a tensor on the
        device (a scalar)."""
        if grad_norm is None:
            self.consecutive = 0
            return False
        if isinstance(grad_norm, torch.Tensor):
            if bool(torch.isfinite(grad_norm)):
                self.consecutive = 0
                return False
            grad_norm = grad_norm.item()
        elif math.isfinite(grad_norm):
            self.consecutive = 0
            return False
        self.consecutive += 1
        if self.consecutive > self.limit:
            raise NonFiniteStepsError(
                f"Step {step}: the gradient norm is {grad_norm}, the {_nth(self.consecutive)} "
                f"non-finite one in a row, and training.skip_nonfinite_steps={self.limit} "
                "allows no more: training has diverged. Stopped without saving this step; "
                "the last committed checkpoint is the resume point. Lower optimizer.lr, raise "
                "lr_scheduler.warmup_steps, check the data, or allow more skipped steps."
            )
        self.skipped += 1
        logger.warning(
            "Step %d: gradient norm %s, update skipped (%d in a row of at most %d allowed by "
            "training.skip_nonfinite_steps; %d skipped in all)",
            step,
            grad_norm,
            self.consecutive,
            self.limit,
            self.skipped,
        )
        return True


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
