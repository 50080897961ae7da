"""The training loop: one linear story from a ``JobConfig`` to a trained, checkpointed model.

run(config)
  1. process group and device (titan-dims detects them: gloo on CPU, NCCL on CUDA)
  2. parallel layout (ParallelDims) and batch arithmetic, checked before any work
  3. tokenizer and a stateful, data-parallel-sharded dataloader
  4. model on the meta device -> parallelize -> allocate -> init weights
  5. optimizers and LR schedules over the model parts
  6. checkpoint manager over model, optimizer, schedules, dataloader, train state; resume
  7. loop: batches -> forward/backward (gradient accumulation) -> clip -> step -> log
     -> checkpoint
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_ckpt import CheckpointManager
from titan_dims import ParallelDims, init_distributed, set_collective_timeout
from titan_optim import build_lr_schedulers, build_optimizers
from titan_train.config import ConfigError, JobConfig
from titan_train.data import build_dataloader
from titan_train.metrics import MetricsLogger
from titan_train.registry import load_model_spec
from titan_train.tokenizer import load_tokenizer

__all__ = ["TrainState", "run"]

logger = logging.getLogger("titan_train")


@dataclass
class TrainState:
    """What the loop itself must remember across a restart."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch splits over data-parallel ranks and accumulation steps."""

    local_batch_size: int
    global_batch_size: int
    accumulation_steps: int


def plan_batches(config: JobConfig, dims: ParallelDims) -> BatchPlan:
    """Check the batch sizes against the data-parallel degree; raise ``ConfigError``."""
    local = config.training.local_batch_size
    per_micro_step = local * dims.dp_degree
    wanted = config.training.global_batch_size
    global_batch = per_micro_step if wanted == -1 else wanted
    if global_batch % per_micro_step:
        raise ConfigError(
            f"training.global_batch_size={wanted} must be a multiple of local_batch_size "
            f"({local}) x data-parallel degree ({dims.dp_degree}) = {per_micro_step}; e.g. "
            f"{max(1, global_batch // per_micro_step) * per_micro_step}, or -1 for no "
            "accumulation."
        )
    return BatchPlan(local, global_batch, global_batch // per_micro_step)


def run(config: JobConfig) -> TrainState:
    """Train as ``config`` says; returns the final train state. The process group it starts
    is destroyed on the way out, also when training fails."""
    # 1. Process group and device.
    device = init_distributed(timeout=timedelta(seconds=config.comm.init_timeout_seconds))
    try:
        return _train(config, device)
    finally:
        dist.destroy_process_group()


def _train(config: JobConfig, device: torch.device) -> TrainState:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _setup_logging(rank)
    training, comm = config.training, config.comm

    # 2. Layout and batch arithmetic: every impossible combination fails here, before work.
    dims = ParallelDims.from_config(config.parallelism, world_size, device_type=device.type)
    if dims.pp_enabled:
        raise ConfigError(
            "parallelism.pipeline_parallel_degree > 1 is not supported by the titan-train loop "
            "yet (titan-models' pipeline_llama is); use data, tensor or context parallelism."
        )
    batches = plan_batches(config, dims)
    spec = load_model_spec(config.model.name)
    if config.model.flavor not in spec.flavors:
        raise ConfigError(
            f"model.flavor={config.model.flavor!r} is not a flavor of {spec.name}; choose "
            f"from {', '.join(spec.flavors)}."
        )

    # 3. Tokenizer and data.
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    dp_rank = dims.dp_rank(rank)
    dataloader = build_dataloader(
        config.training,
        tokenizer,
        dp_rank=dp_rank,
        dp_degree=dims.dp_degree,
    )

    # 4. Model: meta -> parallelize -> allocate -> init. Same seed everywhere, so every
    # rank initializes its shards of the same full model.
    args = spec.args_fn(
        config.model.flavor, vocab_size=tokenizer.vocab_size, max_seq_len=training.seq_len
    )
    torch.manual_seed(training.seed)
    if training.deterministic:
        torch.use_deterministic_algorithms(True)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model = spec.parallelize_fn(model, dims, config.parallelize, seq_len=training.seq_len)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    model.train()
    flops_per_token = args.flops_per_token(training.seq_len)
    logger.info(
        "%s %s: %s parameters, %s; %d x %d tokens per step (%d accumulation steps)",
        spec.name,
        config.model.flavor,
        f"{args.num_params():,}",
        dims,
        batches.global_batch_size,
        training.seq_len,
        batches.accumulation_steps,
    )

    # 5. Optimizers and schedules.
    optimizers = build_optimizers([model], config.optimizer)
    schedulers = build_lr_schedulers(optimizers, config.lr_scheduler, training_steps=training.steps)

    # 6. Checkpointing and resume.
    train_state = TrainState()
    checkpoint_config = replace(
        config.checkpoint,
        folder=os.path.join(config.job.dump_folder, config.checkpoint.folder),
    )
    checkpointer = CheckpointManager(
        checkpoint_config,
        model_parts=[model],
        states={
            "optimizer": optimizers,
            "lr_scheduler": schedulers,
            "dataloader": dataloader,
            "train_state": train_state,
        },
        state_dict_adapter=spec.state_dict_adapter(flavor=config.model.flavor),
    )
    checkpointer.load()
    if config.checkpoint.create_seed_checkpoint:
        # Sharded random init differs between layouts (each rank draws its own shards on
        # CPU); a seed checkpoint written by one process gives every layout the same start.
        checkpointer.save(0)
        checkpointer.close()
        logger.info(
            "Wrote the seed checkpoint (step 0) to %s; start runs from it with "
            "--checkpoint.initial_load_path",
            checkpoint_config.folder,
        )
        return train_state
    metrics = MetricsLogger(
        config.metrics,
        dump_folder=config.job.dump_folder,
        rank=rank,
        flops_per_token=flops_per_token,
        device=device,
        total_steps=training.steps,
    )

    # 7. The loop.
    loss_group = dims.get_mesh("dp_cp").get_group() if dims.dp_cp_enabled else None
    loss_context = _loss_context(dims, config)
    batch_iter = iter(dataloader)
    gc.disable()
    try:
        while train_state.step < training.steps:
            train_state.step += 1
            step_started = time.perf_counter()
            if train_state.step % training.gc_freq == 0:
                gc.collect(1)
            data_seconds = 0.0
            loss_sum = torch.zeros((), device=device)
            for _ in range(batches.accumulation_steps):
                fetched = time.perf_counter()
                inputs, labels = next(batch_iter)
                inputs, labels = inputs.to(device), labels.to(device)
                data_seconds += time.perf_counter() - fetched
                with loss_context():
                    logits = model(inputs)
                    loss = torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1).float(), labels.flatten()
                    )
                    (loss / batches.accumulation_steps).backward()
                loss = loss.detach()
                # Under loss parallel the loss is a replicated DTensor; log its plain value.
                loss_sum += loss.full_tensor() if isinstance(loss, DTensor) else loss
                train_state.tokens_seen += labels.numel() * dims.dp_degree
            grad_norm = (
                optimizers.clip_grad_norm_(training.max_norm) if training.max_norm > 0 else None
            )
            checkpointer.maybe_wait_for_staging()
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()

            loss_value = loss_sum / batches.accumulation_steps
            if loss_group is not None:
                dist.all_reduce(loss_value, op=dist.ReduceOp.AVG, group=loss_group)
            metrics.log(
                step=train_state.step,
                loss=loss_value.item(),
                grad_norm=None if grad_norm is None else float(grad_norm),
                lr=schedulers.get_last_lr()[0],
                tokens=labels.numel() * batches.accumulation_steps,
                step_seconds=time.perf_counter() - step_started,
                data_seconds=data_seconds,
            )
            checkpointer.save(train_state.step, last_step=train_state.step == training.steps)
            if train_state.step == 1:
                # Start-up is over: from now on a hung rank should fail fast.
                set_collective_timeout(
                    timedelta(seconds=comm.train_timeout_seconds),
                    [dims.world_mesh] if dims.layout.names else None,
                )
    finally:
        gc.enable()
        checkpointer.close()
        metrics.close()
    dist.barrier()
    return train_state


def _loss_context(dims: ParallelDims, config: JobConfig):
    # With tensor parallel the logits stay sharded over the vocabulary; the loss must then
    # be computed inside loss_parallel(), which reduces it across the TP ranks.
    if dims.tp_enabled and config.parallelize.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel
    return contextlib.nullcontext


def _setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
