"""torchtitan's TensorBoard tags (July 2025, ``components/metrics.py``) for titan's record,
so dashboards built on torchtitan's runs read titan's (``metrics.tensorboard_names``).

torchtitan writes each run under ``<dump_folder>/<save_tb_folder>/<YYYYmmdd-HHMM>`` (then
``rank_<r>`` with ``save_for_all_ranks``), with the tags below. A titan value with no
torchtitan counterpart keeps its titan name (``lr``, ``global_tokens``, ``eta_s``,
``validation/loss``, ...); torchtitan's ``loss_metrics/global_max_loss`` and its memory
percentages have no titan value and are not written.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

__all__ = ["TORCHTITAN_TAGS", "torchtitan_run_folder", "torchtitan_scalars"]

TORCHTITAN_TAGS: Mapping[str, str] = {
    "loss": "loss_metrics/global_avg_loss",
    "grad_norm": "grad_norm",
    "tps": "throughput(tps)",
    "tflops": "tflops",
    "mfu_pct": "mfu(%)",
    "step_s": "time_metrics/end_to_end(s)",
    "data_pct": "time_metrics/data_loading(%)",
    "memory_gib": "memory/max_reserved(GiB)",
    "memory_active_gib": "memory/max_active(GiB)",
    "memory_alloc_retries": "memory/num_alloc_retries",
    "memory_ooms": "memory/num_ooms",
}
"""titan record key -> torchtitan tag, where both report the same quantity."""


def torchtitan_run_folder(now: datetime | None = None) -> str:
    """The per-run folder torchtitan adds under ``save_tb_folder``: the start minute."""
    return (now or datetime.now()).strftime("%Y%m%d-%H%M")


def torchtitan_scalars(scalars: Mapping[str, float]) -> dict[str, float]:
    """``scalars`` (titan's keys) under torchtitan's tags; the data-loading seconds per step,
    which torchtitan logs and titan's record holds as a share, computed from it."""
    out = {TORCHTITAN_TAGS.get(key, key): value for key, value in scalars.items()}
    if "data_pct" in scalars and "step_s" in scalars:
        out["time_metrics/data_loading(s)"] = scalars["data_pct"] / 100 * scalars["step_s"]
    return out
