"""The training run as four pieces: ``preflight`` -> ``build`` -> ``train_step`` -> the loop.

``run(config)``: process group and device (gloo on CPU, NCCL on CUDA); ``preflight`` (every
check) -> ``Plan``; ``build`` -> ``TrainingRun``; ``train``: steps, reports, validation and
checkpoints under the profiler until the last step, or a SIGTERM (save, stop). Fault
tolerance changes nothing here: torchft works at build time and in the optimizer container;
semi-sync training wraps the loop.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from titan_ckpt import MODEL_RECORD, storage_for
from titan_ckpt.layout import read_manifest, scan_steps
from titan_dims import detect_device_type, init_distributed, set_collective_timeout
from titan_train.config import JobConfig
from titan_train.errors import ConfigError
from titan_train.fault_tolerance.semi_sync import semi_sync_training
from titan_train.launch import destroy_group
from titan_train.preflight import Plan, World, preflight
from titan_train.trainer.build import TrainingRun, build, close
from titan_train.trainer.preemption import PREEMPTED_EXIT, PreemptedError, stop_on_sigterm
from titan_train.trainer.state import TrainState
from titan_train.trainer.step import next_batches, report_step, train_step

__all__ = [
    "TrainState",
    "check_resume",
    "run",
    "summary",
    "train",
    "write_seed_checkpoint",
]

logger = logging.getLogger("titan_train")


def run(config: JobConfig) -> TrainState:
    """Train as ``config`` says; the final train state. The process group is destroyed on the
    way out, after a failure on gloo only (NCCL's shutdown can block on waiting peers)."""
    os.environ.update(flight_recorder_env(config, detect_device_type()))
    device = init_distributed(
        timeout=timedelta(seconds=config.comm.init_timeout_seconds),
        # CPU-offloaded parameters and gradients meet collectives on the host (the gradient
        # norm, the HF export's gathers): an accelerator's backend alone has none for them.
        cpu_collectives=config.parallelize.cpu_offload,
    )
    try:
        state = _run_in_group(config, device)
    except BaseException:
        # NCCL's shutdown can block on peers waiting in a collective until the watchdog
        # fires, hiding the error: process exit takes it down. gloo's does not block.
        if dist.get_backend() == "gloo":
            destroy_group()
        raise
    destroy_group()
    return state


def _run_in_group(config: JobConfig, device: torch.device) -> TrainState:
    world = World.current(device)
    _setup_logging(world.rank)
    plan = preflight(config, world)
    finished = check_resume(config, plan)
    if finished is not None:
        # Nothing to do: no lock, no model, no metrics files (an empty TensorBoard file per
        # restart would pile up).
        logger.info(
            "Already finished at step %d (training.steps %d): nothing to do; raise "
            "--training.steps to continue.",
            finished,
            config.training.steps,
        )
        return TrainState(step=finished)
    started = time.monotonic()
    training_run = build(config, plan)
    first_step = training_run.train_state.step
    try:
        if config.checkpoint.create_seed_checkpoint:
            write_seed_checkpoint(training_run)
        else:
            train(training_run)
    finally:
        close(training_run)
    dist.barrier()
    if not config.checkpoint.create_seed_checkpoint:
        logger.info("%s", summary(training_run, first_step, time.monotonic() - started))
    return training_run.train_state


def check_resume(config: JobConfig, plan: Plan) -> int | None:
    """Before building: ``ConfigError`` when the resume step records another model or flavor;
    its number when it is ``training.steps`` or past (nothing to do), else ``None``."""
    cfg = plan.checkpoint
    if not cfg.enable or config.checkpoint.create_seed_checkpoint or config.fault_tolerance.enable:
        return None
    storage = storage_for(cfg.folder)
    if cfg.load_step >= 0:
        step = cfg.load_step
    else:
        committed = scan_steps(storage, cfg.folder, log=False).committed
        if not committed:
            return None
        step = max(committed)
    directory = storage.join(cfg.folder, f"step-{step}")
    manifest = read_manifest(storage, directory) if storage.exists(directory) else None
    record = manifest.metadata.get(MODEL_RECORD) if manifest is not None else None
    if isinstance(record, dict) and "model" not in cfg.exclude_from_loading:
        written = (record.get("name"), record.get("flavor"))
        now = (plan.spec.name, config.model.flavor)  # as the run records it (model_metadata)
        if written != now:
            raise ConfigError(
                f"The checkpoint {directory} was written by {written[0]} {written[1]}; this run "
                f"is {now[0]} {now[1]}. Resume with --model.name "
                f"{written[0]} --model.flavor {written[1]}, or give this run another "
                "--job.dump_folder (or --checkpoint.folder)."
            )
    return step if step >= config.training.steps else None


def summary(run: TrainingRun, first_step: int, seconds: float) -> str:
    """The end-of-run line: steps done, final loss, wall time, where the outputs are."""
    step = run.train_state.step
    parts = [f"Done: steps {first_step + 1}-{step} of {run.config.training.steps}"]
    if step <= first_step:
        parts = [f"Done: no step trained (at step {step})"]
    record = run.metrics.last_record if run.metrics is not None else None
    if record is not None and record.get("step") == step:
        parts.append(f"final loss {record['loss']:.4f}")
    parts.append(f"in {timedelta(seconds=round(seconds))}")
    metrics = run.config.metrics
    where = []
    if run.config.checkpoint.enable:
        where.append(f"checkpoints {run.plan.checkpoint.folder}")
    if metrics.enable_jsonl:
        where.append(f"metrics {os.path.join(run.output_folder, metrics.save_jsonl_file)}")
    if metrics.enable_tensorboard:
        where.append(f"TensorBoard {os.path.join(run.output_folder, metrics.save_tb_folder)}")
    return "; ".join([", ".join(parts), *where])


def train(run: TrainingRun) -> None:
    """Train ``run`` to ``training.steps`` (collecting garbage every ``training.gc_freq``
    steps); ``PreemptedError`` after the step the ranks stop at on SIGTERM."""
    training = run.config.training
    fast_from = fail_fast_step(run.config)
    gc.disable()
    try:
        # Semi-synchronous fault tolerance (LocalSGD, DiLoCo) syncs the replica groups from
        # the optimizer's step hooks while inside; otherwise a no-op.
        with (
            semi_sync_training(
                run.config.fault_tolerance, run.replicas, run.model_parts, run.optimizers
            ),
            stop_on_sigterm(run.plan.world.world_size) as sigterm,
        ):
            while run.train_state.step < training.steps:
                started = time.perf_counter()
                if (run.train_state.step + 1) % training.gc_freq == 0:
                    gc.collect(1)
                batches, data_seconds = next_batches(
                    run.batches, run.plan.batches.accumulation_steps, run.plan.world.device
                )
                result = train_step(run, batches)
                report_step(run, result, started=started, data_seconds=data_seconds)
                validate(run, result.step)
                last = result.step == training.steps
                if not last and sigterm.agreed():
                    _stop_after(run, result.step, fast_from)
                if last and result.step >= fast_from:
                    # The final save (and HF export: rank 0 writes shards while the others wait
                    # in the next gather) may take minutes: the start-up timeout again.
                    _set_timeout(run, run.config.comm.init_timeout_seconds)
                run.checkpointer.save(result.step, last_step=last)
                run.profiler.step()
                if result.step == fast_from and not last:
                    _start_fail_fast(run, sigterm.group)
    except torch.OutOfMemoryError:
        # Where the memory went, while the allocator still holds it (profiling's
        # memory_snapshot_on_oom); the error then ends the run as before.
        run.profiler.snapshot_on_oom(run.train_state.step)
        raise
    finally:
        gc.enable()


def _stop_after(run: TrainingRun, step: int, fast_from: int) -> NoReturn:
    """Stop after ``step``: log, save it when ``checkpoint.save_on_sigterm``, raise."""
    cfg = run.config.checkpoint
    # A plain titan_ckpt.CheckpointConfig (a JobConfig built in code) has no trainer policy:
    # the default, saving, holds; this is no moment to fail on an attribute.
    on_sigterm = getattr(cfg, "save_on_sigterm", True)
    saving = cfg.enable and on_sigterm and not cfg.load_only
    logger.info(
        "SIGTERM: stopping after step %d, %s; exit status %d",
        step,
        "saving it" if saving else "without a save",
        PREEMPTED_EXIT,
    )
    if saving:
        if step >= fast_from:  # a save may take minutes: the start-up timeout again
            _set_timeout(run, run.config.comm.init_timeout_seconds)
        run.checkpointer.save(step, force=True)
        run.checkpointer.wait()  # written and committed, also in an async mode
    raise PreemptedError(step, saved=saving)


def validate(run: TrainingRun, step: int) -> None:
    """Validate after ``step`` when the validation schedule says so, and record the loss."""
    validator = run.validator
    if validator is not None and validator.should_validate(step, run.config.training.steps):
        loss = validator.validate(run.model_parts, run.pipeline)
        run.metrics.log_scalars(step, {"validation/loss": loss})


def write_seed_checkpoint(run: TrainingRun) -> None:
    """Save the freshly initialized run as step 0 (a family drawing from torch's generators
    starts alike in every layout from this file)."""
    run.checkpointer.save(0, force=True, model_only=True)
    run.checkpointer.close()
    logger.info(
        "Wrote the seed checkpoint (step 0) to %s; start runs from it with "
        "--checkpoint.initial_load_path",
        run.plan.checkpoint.folder,
    )


def flight_recorder_env(config: JobConfig, device_type: str) -> dict[str, str]:
    """Variables making NCCL's flight recorder keep ``comm.trace_buf_size`` collectives and
    dump them under ``comm.save_traces_folder`` on a timeout; the user's win; none on CPU."""
    comm = config.comm
    if device_type == "cpu" or comm.trace_buf_size == 0:
        return {}
    folder = os.path.join(config.job.dump_folder, comm.save_traces_folder)
    wanted = {
        "TORCH_FR_BUFFER_SIZE": str(comm.trace_buf_size),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": os.path.join(folder, comm.save_traces_file_prefix),
    }
    return {name: value for name, value in wanted.items() if name not in os.environ}


def fail_fast_step(config: JobConfig) -> int:
    """The step after which collectives get ``comm.train_timeout_seconds``: the first (or
    the first validation's, whose eval forward compiles again)."""
    if not config.validation.enable:
        return 1
    return max(1, min(config.validation.freq, config.training.steps))


def _start_fail_fast(run: TrainingRun, sigterm_group: dist.ProcessGroup | None) -> None:
    # Start-up is over: a hung rank should now fail fast, once every rank is past start-up
    # (else a rank finishing its first step times its peers out): a barrier, queued work done.
    dist.barrier()
    if run.plan.world.device.type != "cpu":
        torch.accelerator.synchronize()
    # The ranks' SIGTERM agreement after each step too: a peer hung between steps is met there.
    _set_timeout(run, run.config.comm.train_timeout_seconds, sigterm_group)


def _set_timeout(run: TrainingRun, seconds: int, group: dist.ProcessGroup | None = None) -> None:
    dims = run.plan.parallel_dims
    groups: list = [dims.world_mesh] if dims.layout.names else []
    if group is not None:
        groups.append(group)
    set_collective_timeout(timedelta(seconds=seconds), groups)


def _setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
