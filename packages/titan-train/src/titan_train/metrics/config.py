"""``MetricsConfig``: what the metrics logger reports, how often and where.

Keys follow torchtitan's ``[metrics]`` section; ``enable_jsonl``, ``save_jsonl_file``,
``peak_flops`` and ``tensorboard_names`` are titan's. Unlike torchtitan, TensorBoard is on
by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan_train.errors import MetricsError, check_int, check_number

__all__ = ["MetricsConfig", "MetricsError"]


@dataclass(kw_only=True)
class MetricsConfig:
    """Every ``log_freq`` steps: a console line, TensorBoard scalars, a JSONL record."""

    log_freq: int = 10
    """Report every this many steps (and at the first and last step)."""
    enable_tensorboard: bool = True
    """Write TensorBoard event files under ``<dump_folder>/<save_tb_folder>``."""
    save_tb_folder: str = "tb"
    """Folder for TensorBoard files, relative to the job's dump folder."""
    tensorboard_names: Literal["titan", "torchtitan"] = "titan"
    """TensorBoard tags and folders: titan's (``loss``, ``tps``, ... in ``save_tb_folder``)
    or torchtitan's (``loss_metrics/global_avg_loss``, ``throughput(tps)``, ... in a
    ``<YYYYmmdd-HHMM>`` folder per run under it), so dashboards built on torchtitan's runs
    read titan's. A titan key."""
    enable_jsonl: bool = True
    """Append one JSON object per report to ``<dump_folder>/<save_jsonl_file>``, for scripts."""
    save_jsonl_file: str = "metrics.jsonl"
    """The JSONL file, relative to the job's dump folder."""
    save_for_all_ranks: bool = False
    """Write files on every rank (in per-rank names), not just rank 0."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (needs ``pip install 'titan-train[wandb]'``; project from
    ``WANDB_PROJECT``, default ``titan``)."""
    disable_color_printing: bool = False
    """Print the console line without ANSI colors."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device, for MFU; 0 looks the GPU up in a table of bf16 dense peaks
    or, on CPU, measures fp32 matmul once (~0.5 s). The log states which; a peak below what
    training reaches is raised to it (with a warning), so MFU never exceeds 100%."""

    def __post_init__(self) -> None:
        check_int("metrics.log_freq", self.log_freq, minimum=1, error=MetricsError)
        check_number(
            "metrics.peak_flops",
            self.peak_flops,
            low=0,
            hint="FLOP/s of one device, e.g. 989e12 for an H100; 0 finds it",
            error=MetricsError,
        )
        if self.tensorboard_names not in ("titan", "torchtitan"):
            raise MetricsError(
                f"metrics.tensorboard_names={self.tensorboard_names!r} is not allowed; use "
                "'titan' or 'torchtitan'."
            )
        for key in ("save_tb_folder", "save_jsonl_file"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise MetricsError(
                    f"metrics.{key}={value!r} is not allowed; it must be a non-empty path."
                )
