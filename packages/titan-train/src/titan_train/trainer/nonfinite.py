"""What a run does when the gradient norm is inf or nan: skip the update, a bounded number of
times in a row, then stop.

The optimizer container skips a step whose clipped gradient norm is not finite, which alone
repeats silently forever once training diverged. ``NonFiniteGuard`` allows
``training.skip_nonfinite_steps`` in a row (a warning each) and raises
``NonFiniteStepsError`` on the next, before that step's checkpoint, so the last committed
(finite) step stays the resume point. It reads only whether clipping's norm (the same on
every rank) is finite; with clipping off nothing is skipped.
"""

from __future__ import annotations

import logging
import math

import torch

from titan_train.errors import NonFiniteStepsError

__all__ = ["NonFiniteGuard", "NonFiniteStepsError"]

logger = logging.getLogger("titan_train")


class NonFiniteGuard:
    """Counts steps whose gradient norm is not finite; raises past ``limit`` in a row
    (``training.skip_nonfinite_steps``; 0 stops at the first)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.consecutive = 0
        """Non-finite steps in a row, up to the last one observed."""
        self.skipped = 0
        """Non-finite steps skipped in this process, in all."""

    def observe(self, step: int, grad_norm: torch.Tensor | float | None) -> bool:
        """Account ``step`` (``grad_norm`` may be a device scalar); True if its update is
        skipped; raises ``NonFiniteStepsError`` past ``limit`` in a row."""
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
