"""``MetricsConfig``: what the metrics logger reports, how often and where.

Keys follow torchtitan's ``[metrics]`` section; ``enable_jsonl``, ``save_jsonl_file`` and
``peak_flops`` are titan's. Unlike torchtitan, TensorBoard is on by default.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MetricsConfig", "MetricsError"]


class MetricsError(ValueError):
    """A metrics setting is impossible, or an optional backend it asks for is missing."""


@dataclass(kw_only=True)
class MetricsConfig:
    """Every ``log_freq`` steps: a console line, TensorBoard scalars, a JSONL record."""

    log_freq: int = 10
    """Report every this many steps (and at the first and last step)."""
    enable_tensorboard: bool = True
    """Write TensorBoard event files under ``<dump_folder>/<save_tb_folder>``."""
    save_tb_folder: str = "tb"
    """Folder for TensorBoard files, relative to the job's dump folder."""
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
    or, on CPU, measures fp32 matmul once (~0.5 s)."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.log_freq, bool)
            or not isinstance(self.log_freq, int)
            or (self.log_freq <= 0)
        ):
            raise MetricsError(
                f"metrics.log_freq={self.log_freq!r} is not allowed; it must be an int > 0."
            )
        if (
            isinstance(self.peak_flops, bool)
            or not isinstance(self.peak_flops, int | float)
            or (self.peak_flops < 0)
        ):
            raise MetricsError(
                f"metrics.peak_flops={self.peak_flops!r} is not allowed; it must be >= 0 "
                "(FLOP/s of one device, e.g. 989e12 for an H100; 0 finds it)."
            )
        for key in ("save_tb_folder", "save_jsonl_file"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise MetricsError(
                    f"metrics.{key}={value!r} is not allowed; it must be a non-empty path."
                )
