"""Profiling: ``torch.profiler`` traces of a few steps every ``profile_freq`` steps, and
accelerator memory snapshots.

Traces: ``<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json`` (Perfetto
or ``chrome://tracing``). Snapshots of the caching allocator's history, every
``profile_freq`` steps: ``<save_memory_snapshot_folder>/iteration_<step>/
rank<r>_memory_snapshot.pickle`` (https://pytorch.org/memory_viz). A step that runs out of
device memory dumps one more to ``iteration_<step>_exit/`` (``memory_snapshot_on_oom``),
with the history when ``enable_memory_snapshot`` is on, else the allocator's segments.
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass
from types import ModuleType

import torch

from titan_train.errors import ConfigError, check_int

__all__ = ["Profiler", "ProfilingConfig", "memory_history"]

logger = logging.getLogger("titan_train")


@dataclass(kw_only=True)
class ProfilingConfig:
    """torch.profiler traces and CUDA memory snapshots (torchtitan's ``[profiling]`` keys)."""

    enable_profiling: bool = False
    """Record torch.profiler traces."""
    save_traces_folder: str = "profile_traces"
    """Folder under ``job.dump_folder`` for the traces."""
    profile_freq: int = 10
    """Record a trace in every window of this many steps."""
    profiler_warmup: int = 3
    """Steps the profiler warms up (runs, discards) before recording."""
    profiler_active: int = 1
    """Steps recorded per trace."""
    enable_memory_snapshot: bool = False
    """Record the accelerator allocator's history and dump snapshots (ignored, with a
    warning, on CPU)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Folder under ``job.dump_folder`` for the memory snapshots."""
    memory_snapshot_on_oom: bool = True
    """On an accelerator, dump a memory snapshot when a step runs out of memory (titan's)."""

    def __post_init__(self) -> None:
        for key in ("profile_freq", "profiler_active"):
            check_int(f"profiling.{key}", getattr(self, key), minimum=1)
        check_int("profiling.profiler_warmup", self.profiler_warmup, minimum=0)
        if self.profiler_warmup + self.profiler_active > self.profile_freq:
            raise ConfigError(
                f"profiling.profiler_warmup={self.profiler_warmup} + profiler_active="
                f"{self.profiler_active} must fit in profile_freq="
                f"{self.profile_freq}; raise profile_freq or lower the others."
            )


class Profiler:
    """Traces and snapshots for the loop, from when it is built: ``step()`` after each step,
    ``close()`` at the end (or a ``with``). ``step``: the resume step, so windows stay
    aligned with step numbers."""

    def __init__(
        self,
        config: ProfilingConfig,
        *,
        dump_folder: str,
        rank: int,
        device: torch.device,
        step: int = 0,
    ) -> None:
        self.config = config
        self.rank = rank
        self.device = device
        self.traces_folder = os.path.join(dump_folder, config.save_traces_folder)
        self.memory_folder = os.path.join(dump_folder, config.save_memory_snapshot_folder)
        self._step = step
        self._start_step = step
        self._torch_profiler: torch.profiler.profile | None = None
        self._memory = memory_history(device)
        """The device's memory-history API (``torch.cuda.memory``...); ``None`` on CPU."""
        self._recording_memory = False
        self._start()

    def _start(self) -> None:
        config = self.config
        if config.enable_memory_snapshot:
            if self._memory is not None:
                self._memory._record_memory_history(max_entries=100_000)
                self._recording_memory = True
            else:
                logger.warning(
                    "profiling.enable_memory_snapshot needs an accelerator whose allocator "
                    "records history, e.g. CUDA (this run is on %s); no memory snapshots "
                    "are recorded.",
                    self.device.type,
                )
        if config.enable_profiling:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch_profiler = torch.profiler.profile(
                activities=activities,
                schedule=self._action,
                on_trace_ready=self._write_trace,
                record_shapes=True,
            )
            self._torch_profiler.start()

    def _action(self, profiler_step: int) -> torch.profiler.ProfilerAction:
        # The profiler counts from 0 (training step start + 1): windows are on training
        # steps so they end on multiples of profile_freq after a resume too.
        config = self.config
        position = (self._start_step + profiler_step) % config.profile_freq  # 0 .. freq-1
        last = config.profile_freq - 1
        if position == last:
            return torch.profiler.ProfilerAction.RECORD_AND_SAVE
        if position >= last - config.profiler_active + 1:
            return torch.profiler.ProfilerAction.RECORD
        if position >= last - config.profiler_active - config.profiler_warmup + 1:
            return torch.profiler.ProfilerAction.WARMUP
        return torch.profiler.ProfilerAction.NONE

    def step(self) -> None:
        """Account one finished training step; writes a trace or snapshot when one is due."""
        self._step += 1
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        if self._recording_memory and self._step % self.config.profile_freq == 0:
            self._dump_snapshot(f"iteration_{self._step}")

    def snapshot_on_oom(self, step: int) -> str | None:
        """Dump a memory snapshot after step ``step`` ran out of device memory; the path, or
        ``None`` when off or on CPU. A failed dump is logged, never raised over the OOM."""
        if not self.config.memory_snapshot_on_oom or self._memory is None:
            return None
        try:
            path = self._dump_snapshot(f"iteration_{step}_exit")
        except Exception:  # the run is failing already: say so, keep the real error
            logger.exception("Could not dump the memory snapshot of the out-of-memory step")
            return None
        logger.error("Out of device memory in step %d; memory snapshot: %s", step, path)
        return path

    def _dump_snapshot(self, name: str) -> str:
        folder = os.path.join(self.memory_folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        with open(path, "wb") as f:
            pickle.dump(self._memory._snapshot(), f)
        return path

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        # Called from step() right after a window's last active step, and from close()
        # when training ends inside a window: that partial window is not written.
        if self._step % self.config.profile_freq:
            return
        folder = os.path.join(self.traces_folder, f"iteration_{self._step}")
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"rank{self.rank}_trace.json"))
        logger.info("Wrote the profiler trace of step %d to %s", self._step, folder)

    def close(self) -> None:
        """Stop recording; safe to call twice."""
        if self._torch_profiler is not None:
            self._torch_profiler.stop()
            self._torch_profiler = None
        if self._recording_memory:
            self._memory._record_memory_history(enabled=None)
            self._recording_memory = False

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def memory_history(device: torch.device) -> ModuleType | None:
    """``device``'s torch memory module (``torch.cuda.memory``...) when it records allocator
    history; ``None`` on CPU and devices without."""
    if device.type in ("cpu", "meta"):
        return None
    try:
        module = getattr(torch.get_device_module(device.type), "memory", None)
    except RuntimeError:  # a device type without a torch module
        return None
    needed = ("_record_memory_history", "_snapshot")
    return module if module is not None and all(hasattr(module, n) for n in needed) else None
