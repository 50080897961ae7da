"""``MetricsLogger``: the training run's numbers, every ``log_freq`` steps, to the console,
TensorBoard, a JSONL file and (optionally) Weights & Biases.

Throughput, MFU and the data share are averaged over the steps since the last report, so a
slow step (a save, a compile) washes out. Throughput is per device, as torchtitan counts
it; ``tps * devices`` equals the record's ``global_tokens / step_s``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from titan_train.metrics.config import MetricsConfig, MetricsError
from titan_train.metrics.flops import peak_flops, peak_source
from titan_train.metrics.memory import device_memory
from titan_train.metrics.torchtitan_tags import torchtitan_run_folder, torchtitan_scalars

__all__ = ["MetricsLogger"]

logger = logging.getLogger(__name__)

_COLORS = {"step": "\033[36m", "loss": "\033[32m", "tps": "\033[34m", "mfu": "\033[35m"}
_RESET = "\033[0m"
_COLOR_TERMINAL = sys.stderr.isatty()
"""Whether the console line may use ANSI colors (logging writes to stderr)."""


def _eta_text(seconds: float) -> str:
    """``seconds`` as ``timedelta`` prints it, in days past its range (never overflows)."""
    if seconds < timedelta.max.days * 86400:
        return str(timedelta(seconds=round(seconds)))
    return f"{seconds / 86400:.3g} days"


def _empty_window() -> dict[str, float]:
    """Sums over the steps since the last report."""
    return {
        "steps": 0,
        "tokens": 0,
        "device_tokens": 0.0,
        "devices": 1,
        "seconds": 0.0,
        "data_seconds": 0.0,
    }


_REACHED = "the highest rate training reached"


class MetricsLogger:
    """Reports metrics every ``config.log_freq`` steps: every rank logs the line, rank 0
    writes the files (every rank with ``save_for_all_ranks``). ``flops_per_token`` 0: no
    TFLOPs/MFU; ``total_steps``: the ETA; ``heartbeat_s``: a progress line between reports
    on slow hardware."""

    def __init__(
        self,
        config: MetricsConfig | None = None,
        *,
        dump_folder: str | os.PathLike[str] = ".",
        rank: int = 0,
        flops_per_token: float = 0.0,
        device: torch.device | str | None = None,
        total_steps: int | None = None,
        heartbeat_s: float = 30.0,
    ) -> None:
        self.config = config if config is not None else MetricsConfig()
        self.rank = rank
        self.flops_per_token = flops_per_token
        self.device = torch.device(device if device is not None else "cpu")
        self.total_steps = total_steps
        self.peak_flops = None
        self._peak_source = ""
        if flops_per_token > 0:
            self.peak_flops = self.config.peak_flops or peak_flops(self.device)
            self._peak_source = (
                "metrics.peak_flops" if self.config.peak_flops else peak_source(self.device)
            )
            if self.peak_flops:
                logger.info(
                    "MFU is against a peak of %.4g TFLOP/s per device (%s)",
                    self.peak_flops / 1e12,
                    self._peak_source,
                )
        self.heartbeat_s = heartbeat_s
        self._last_line = time.monotonic()
        self.last_record: dict[str, Any] | None = None
        """The latest report's record (the run's summary reads its loss)."""
        self._window = _empty_window()
        writes = rank == 0 or self.config.save_for_all_ranks
        suffix = "" if rank == 0 else f"_rank{rank}"
        self._tensorboard = None
        self._jsonl = None
        self._wandb = None
        if writes and self.config.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            folder = os.path.join(dump_folder, self.config.save_tb_folder)
            if self.config.tensorboard_names == "torchtitan":
                folder = os.path.join(folder, torchtitan_run_folder())
            if self.config.save_for_all_ranks:
                folder = os.path.join(folder, f"rank_{rank}")
            self._tensorboard = SummaryWriter(log_dir=folder)
        if writes and self.config.enable_jsonl:
            root, ext = os.path.splitext(self.config.save_jsonl_file)
            path = os.path.join(dump_folder, root + suffix + ext)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        if writes and self.config.enable_wandb:
            try:
                import wandb
            except ImportError as e:
                raise MetricsError(
                    "metrics.enable_wandb=True needs the wandb package: "
                    "pip install 'titan-train[wandb]', or set metrics.enable_wandb=false."
                ) from e
            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "titan"),
                dir=os.fspath(dump_folder),
                name=f"rank{rank}" if self.config.save_for_all_ranks else None,
            )

    def should_log(self, step: int) -> bool:
        """Whether ``step`` is a reporting step: the first, every ``log_freq``-th, the last."""
        return step == 1 or step % self.config.log_freq == 0 or step == self.total_steps

    def log(
        self,
        *,
        step: int,
        loss: float | None,
        tokens: int,
        step_seconds: float,
        devices: int = 1,
        data_seconds: float = 0.0,
        grad_norm: float | None = None,
        lr: float | None = None,
        extra: Mapping[str, float] | None = None,
    ) -> dict[str, Any] | None:
        """Account one step; on reporting steps (``should_log``; ``loss`` is ``None`` on
        others, so the device is not waited for) write the record and return it.
        ``tokens``: the step's (``tokens_of_step``) over ``devices``; ``step_seconds``
        includes ``data_seconds``; ``extra``: more scalars."""
        window = self._window
        window["steps"] += 1
        window["tokens"] += tokens
        window["device_tokens"] += tokens / devices
        window["devices"] = devices
        window["seconds"] += step_seconds
        window["data_seconds"] += data_seconds
        if not self.should_log(step):
            if time.monotonic() - self._last_line >= self.heartbeat_s:
                self._heartbeat(step)
            return None
        if loss is None:
            raise ValueError(f"step {step} is a reporting step: MetricsLogger.log needs its loss.")

        record, memory_kind = self._record(step, loss, grad_norm, lr, extra)
        self._window = _empty_window()

        logger.info("%s", self._console_line(record, memory_kind))
        self._last_line = time.monotonic()
        self.last_record = record
        self._write(step, record)
        return record

    def _heartbeat(self, step: int) -> None:
        """A console line only (no files): the step reached and the pace since the report."""
        window = self._window
        total = f"/{self.total_steps}" if self.total_steps else ""
        following = step + self.config.log_freq - step % self.config.log_freq
        if self.total_steps:
            following = min(following, self.total_steps)
        logger.info(
            "step %5d%s  %.1f s/step  (full report at step %d)",
            step,
            total,
            window["seconds"] / max(window["steps"], 1),
            following,
        )
        self._last_line = time.monotonic()

    def _record(
        self,
        step: int,
        loss: float,
        grad_norm: float | None,
        lr: float | None,
        extra: Mapping[str, float] | None,
    ) -> tuple[dict[str, Any], str]:
        """The reporting step's record from the window, and the kind of memory it reports."""
        window = self._window
        seconds = max(window["seconds"], 1e-12)
        tps = window["device_tokens"] / seconds  # tokens/s per device
        memory, memory_kind = device_memory(self.device)
        record: dict[str, Any] = {"step": step, "loss": float(loss)}
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        if lr is not None:
            record["lr"] = float(lr)
        record["tps"] = tps
        if self.flops_per_token > 0:
            record["tflops"] = self.flops_per_token * tps / 1e12
            if self.peak_flops:
                self._raise_peak(self.flops_per_token * tps)
                record["mfu_pct"] = 100 * self.flops_per_token * tps / self.peak_flops
        record.update(memory)  # memory_gib; on accelerators allocated, active, retries, OOMs
        record["data_pct"] = 100 * window["data_seconds"] / seconds
        record["step_s"] = seconds / window["steps"]
        record["global_tokens"] = window["tokens"] / window["steps"]
        record["devices"] = window["devices"]
        if self.total_steps is not None:
            record["eta_s"] = max(self.total_steps - step, 0) * record["step_s"]
        record.update({k: float(v) for k, v in (extra or {}).items()})
        return record, memory_kind

    def _raise_peak(self, achieved: float) -> None:
        """Raise the peak to ``achieved`` FLOP/s when above it (MFU over 100% would be false);
        warned once, later at debug level."""
        if self.peak_flops is None or achieved <= self.peak_flops:
            return
        raised_before = self._peak_source == _REACHED
        (logger.debug if raised_before else logger.warning)(
            "training reached %.4g TFLOP/s per device, above the %.4g TFLOP/s peak MFU was "
            "against (%s): MFU now uses the reached rate as the peak. Set metrics.peak_flops "
            "to the device's real peak for a true MFU.",
            achieved / 1e12,
            self.peak_flops / 1e12,
            self._peak_source,
        )
        self.peak_flops = achieved
        self._peak_source = _REACHED

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Write scalars outside the training step (e.g. validation) to every backend."""
        values = {k: float(v) for k, v in values.items()}
        logger.info("step %d  %s", step, "  ".join(f"{k} {v:.4f}" for k, v in values.items()))
        self._write(step, {"step": step, **values})

    def _write(self, step: int, record: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in record.items() if k != "step"}
        if self._tensorboard is not None:
            if self.config.tensorboard_names == "torchtitan":
                scalars = torchtitan_scalars(scalars)
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({**record, "time": time.time()}) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def _console_line(self, r: Mapping[str, Any], memory_kind: str) -> str:
        def paint(key: str, text: str) -> str:
            # Colors only on a terminal: piped logs and CI output stay plain text.
            if self.config.disable_color_printing or key not in _COLORS or not _COLOR_TERMINAL:
                return text
            return f"{_COLORS[key]}{text}{_RESET}"

        parts = [paint("step", f"step {r['step']:>5}"), paint("loss", f"loss {r['loss']:8.4f}")]
        if "grad_norm" in r:
            parts.append(f"grad_norm {r['grad_norm']:7.4f}")
        if "lr" in r:
            parts.append(f"lr {r['lr']:.2e}")
        parts.append(paint("tps", f"tps {r['tps']:,.0f}"))
        if "tflops" in r:
            parts.append(f"tflops {r['tflops']:.3g}")
        if "mfu_pct" in r:
            parts.append(paint("mfu", f"mfu {r['mfu_pct']:.1f}%"))
        parts.append(f"memory {r['memory_gib']:.2f}GiB ({memory_kind})")
        if r.get("memory_alloc_retries"):  # fragmentation: the allocator emptied its cache
            parts.append(f"alloc_retries {int(r['memory_alloc_retries'])}")
        parts.append(f"data {r['data_pct']:.1f}%")
        if r.get("skipped_steps"):
            parts.append(f"skipped {int(r['skipped_steps'])}")
        mixture = [(k.split("/", 1)[1], v) for k, v in r.items() if k.startswith("tokens_seen/")]
        if mixture:  # a dataset mixture: the tokens taken from each source so far
            parts.append("tokens " + ", ".join(f"{name} {int(n):,}" for name, n in mixture))
        if "eta_s" in r:
            parts.append(f"eta {_eta_text(r['eta_s'])}")
        return "  ".join(parts)

    def close(self) -> None:
        """Flush and close every backend; safe to call twice."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
