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

from titan_train.__about__ import __version__
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
