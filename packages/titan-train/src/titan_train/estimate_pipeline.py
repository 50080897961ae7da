"""Replay one rank's pipeline schedule step on its real stage modules (for ``estimate``)."""

from __future__ import annotations

from typing import Any

import torch


def replay_pipeline_step(pipeline: Any, plan: Any, inputs: torch.Tensor, labels: torch.Tensor) -> None:
    raise NotImplementedError
