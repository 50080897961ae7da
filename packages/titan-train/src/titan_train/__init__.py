"""titan-train: pretrain a titan model from a ``JobConfig``, or write your own loop.

    from titan_train import JobConfig, run
    run(JobConfig())                      # what ``titan-train`` does, in one call

The run is four public pieces, so a loop of your own reuses the rest:

    plan = preflight(config, World.current(device))   # every check, before any work
    training_run = build(config, plan)                 # the parts, resumed: a TrainingRun
    result = train_step(training_run, batches)         # one optimizer step: a StepResult
    close(training_run)

``run`` and ``train`` raise ``PreemptedError`` when SIGTERM stopped the run (after saving
the step, see ``titan_train.trainer.preemption``); ``titan-train`` then exits with
``PREEMPTED_EXIT``.

``generate(model, prompts, SamplingConfig(...))`` samples from a model (what ``titan-train
generate`` runs).
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING

from titan_train.__about__ import __version__

if TYPE_CHECKING:
    from titan_train.config import ConfigError, JobConfig, parse_job_config
    from titan_train.generate import SamplingConfig, generate
    from titan_train.preflight import BatchPlan, Plan, World, preflight
    from titan_train.trainer.build import TrainingRun, build, close
    from titan_train.trainer.loop import run, train, validate, write_seed_checkpoint
    from titan_train.trainer.preemption import PREEMPTED_EXIT, PreemptedError
    from titan_train.trainer.state import TrainState
    from titan_train.trainer.step import (
        StepResult,
        batch_loss,
        cross_entropy_loss,
        next_batches,
        report_step,
        train_step,
    )

__all__ = [
    "PREEMPTED_EXIT",
    "BatchPlan",
    "ConfigError",
    "JobConfig",
    "Plan",
    "PreemptedError",
    "SamplingConfig",
    "StepResult",
    "TrainState",
    "TrainingRun",
    "World",
    "__version__",
    "batch_loss",
    "build",
    "close",
    "cross_entropy_loss",
    "generate",
    "next_batches",
    "parse_job_config",
    "preflight",
    "report_step",
    "run",
    "train",
    "train_step",
    "validate",
    "write_seed_checkpoint",
]

# Each name is imported on first use, so the ``titan-train`` command starts without torch (it
# may start itself again at once: ``titan_train.trainer.host_memory``).
_HOMES = {
    "ConfigError": "config", "JobConfig": "config", "parse_job_config": "config",
    "SamplingConfig": "generate", "generate": "generate",
    "BatchPlan": "preflight", "Plan": "preflight", "World": "preflight",
    "preflight": "preflight",
    "TrainingRun": "trainer.build", "build": "trainer.build", "close": "trainer.build",
    "run": "trainer.loop", "train": "trainer.loop", "validate": "trainer.loop",
    "write_seed_checkpoint": "trainer.loop",
    "PREEMPTED_EXIT": "trainer.preemption", "PreemptedError": "trainer.preemption",
    "TrainState": "trainer.state",
    "StepResult": "trainer.step", "batch_loss": "trainer.step",
    "cross_entropy_loss": "trainer.step", "next_batches": "trainer.step",
    "report_step": "trainer.step", "train_step": "trainer.step",
}  # fmt: skip


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"titan_train.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """``titan_train.generate`` and ``titan_train.preflight`` are functions, named as their
    modules are: importing such a module makes it an attribute of this package, which would
    hide the function. Those module attributes are not set (the modules stay in
    ``sys.modules``), so the names keep meaning the functions, as they did when this package
    imported everything at once."""

    def __setattr__(self, name: str, value: object) -> None:
        if not (name in ("generate", "preflight") and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
