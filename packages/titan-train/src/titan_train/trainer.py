"""The training loop: one linear story from a ``JobConfig`` to a trained, checkpointed model.

run(config)
  1. process group and device (titan-dims detects them: gloo on CPU, NCCL on CUDA)
  2. parallel layout (ParallelDims) and batch arithmetic, checked before any work
  3. tokenizer and a stateful, data-parallel-sharded dataloader
  4. model on the meta device -> parallelize (or split into pipeline stages) -> allocate
     -> init weights
  5. optimizers and LR schedules over the model parts
  6. checkpoint manager over model, optimizer, schedules, dataloader, train state; resume
  7. loop: batches -> forward/backward (gradient accumulation, or pipeline microbatches)
     -> clip -> step -> log -> validate -> checkpoint, under the profiler

With ``fault_tolerance.enable`` the run is one replica group of a torchft job (see
``titan_train.fault_tolerance``): data is sharded over all groups, gradients are averaged
across them before clipping, and the optimizer steps only on steps the manager commits.
"""

from __future__ import annotations

import contextlib
import functools
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

from titan_ckpt import (
    CheckpointConfig,
    CheckpointManager,
    check_folder_contents,
    check_folder_writable,
)
from titan_dims import ParallelDims, init_distributed, set_collective_timeout
from titan_models import context_parallel_batch
from titan_optim import build_lr_schedulers, build_optimizers
from titan_train.compat import check_supported
from titan_train.config import ConfigError, JobConfig
from titan_train.data import build_dataloader
from titan_train.fault_tolerance import ReplicaGroup, check_fault_tolerance
from titan_train.metrics import MetricsLogger, tokens_of_step
from titan_train.model_args import (
    build_model_args,
    check_resumed_model,
    model_metadata,
    state_dict_adapter,
)
from titan_train.nonfinite import NonFiniteGuard
from titan_train.profiling import Profiler
from titan_train.registry import load_model_spec
from titan_train.tokenizer import load_tokenizer
from titan_train.validation import Validator

__all__ = ["TrainState", "check_checkpoint_folder", "cross_entropy_loss", "run"]

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
        if "tokens_seen" in state:
            self.tokens_seen = int(state["tokens_seen"])
        elif "ntokens_seen" in state:  # torchtitan's name (it saves one rank's count)
            self.tokens_seen = int(state["ntokens_seen"])
        else:  # torchtitan before August 2025 kept no token count
            logger.warning("The checkpoint records no token count: counting tokens from 0")
            self.tokens_seen = 0


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch splits over data-parallel ranks and accumulation steps."""

    local_batch_size: int
    global_batch_size: int
    accumulation_steps: int


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``(batch, seq, vocab)`` logits, computed in fp32."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


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


def check_seq_lens(config: JobConfig, dims: ParallelDims) -> None:
    """Raise ``ConfigError`` unless ``training.seq_len`` (and ``validation.seq_len`` when
    validation is on) is a multiple of the layout's ``seq_len_divisor``."""
    divisor = dims.seq_len_divisor
    lengths = [("training", config.training.seq_len)]
    if config.validation.enable:
        lengths.append(("validation", config.validation.seq_len))
    for section, seq_len in lengths:
        if seq_len % divisor:
            below = seq_len // divisor * divisor
            allowed = " or ".join(str(n) for n in (below, below + divisor) if n > 0)
            raise ConfigError(
                f"{section}.seq_len={seq_len} must be divisible by {divisor} = "
                f"tensor_parallel_degree ({dims.tp}) x context_parallel_degree ({dims.cp}) x 2 "
                "(sequence parallel splits a sequence tp ways, load-balanced context parallel "
                f"into 2 x cp chunks); e.g. {allowed}."
            )


def run(config: JobConfig) -> TrainState:
    """Train as ``config`` says; returns the final train state. The process group it starts
    is destroyed on the way out, also when training fails."""
    check_supported(config.model.converters, config.parallelize.param_dtype)
    # 1. Process group and device.
    device = init_distributed(timeout=timedelta(seconds=config.comm.init_timeout_seconds))
    try:
        return _train(config, device)
    finally:
        # Free the model, optimizers and checkpointer first: FSDP state holds gloo work, and
        # gloo work destroyed during interpreter shutdown can abort the process.
        gc.collect()
        dist.destroy_process_group()


def _train(config: JobConfig, device: torch.device) -> TrainState:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _setup_logging(rank)

    # 2. Layout and batch arithmetic: every impossible combination fails here, before work.
    dims = ParallelDims.from_config(config.parallelism, world_size, device_type=device.type)
    batches = plan_batches(config, dims)
    spec = load_model_spec(config.model.name)
    if config.model.flavor not in spec.flavors:
        raise ConfigError(
            f"model.flavor={config.model.flavor!r} is not a flavor of {spec.name}; choose "
            f"from {', '.join(spec.flavors)}."
        )
    if dims.pp_enabled and spec.pipeline_fn is None:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree={dims.pp}: model {spec.name!r} cannot be "
            "pipelined (its spec has no pipeline_fn); use pipeline_parallel_degree=1."
        )
    check_seq_lens(config, dims)
    check_checkpoint_folder(config)
    ft_config = config.fault_tolerance
    check_fault_tolerance(
        ft_config, dims, create_seed_checkpoint=config.checkpoint.create_seed_checkpoint
    )
    replicas = (
        ReplicaGroup(ft_config, device=device, rank=rank, world_size=world_size)
        if ft_config.enable
        else None
    )
    try:
        return _build_and_train(config, device, dims, batches, spec, replicas)
    finally:
        if replicas is not None:
            replicas.close()


def _build_and_train(
    config: JobConfig,
    device: torch.device,
    dims: ParallelDims,
    batches: BatchPlan,
    spec: Any,
    replicas: ReplicaGroup | None,
) -> TrainState:
    rank = dist.get_rank()
    training, comm = config.training, config.comm

    # 3. Tokenizer, training data and validation (which checks its batch against the
    # pipeline's microbatches here, before any work).
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    dp_rank = dims.dp_rank(rank)
    # With torchft, data is sharded over the data-parallel ranks of every replica group.
    data_rank, data_degree = (
        (dp_rank, dims.dp_degree)
        if replicas is None
        else replicas.data_parallel(dp_rank, dims.dp_degree)
    )
    dataloader = build_dataloader(
        config.training,
        tokenizer,
        dp_rank=data_rank,
        dp_degree=data_degree,
    )

    loss_context = _loss_context(dims, config)
    # Opens context parallel (whichever attention parallelize.cp_attention chose) around a
    # forward and backward, yielding this rank's share of the batch; a no-op without CP.
    sequence_context = functools.partial(
        context_parallel_batch, parallel_dims=dims, config=config.parallelize
    )
    validator = None
    if config.validation.enable:
        validator = Validator(
            config.validation,
            tokenizer,
            dims=dims,
            dp_rank=dp_rank,
            device=device,
            loss_fn=cross_entropy_loss,
            loss_context=loss_context,
            sequence_context=sequence_context,
            pipeline_microbatches=(
                batches.local_batch_size
                * batches.accumulation_steps
                // config.pipeline.microbatch_size
                if dims.pp_enabled
                else None
            ),
        )

    # 4. Model: meta -> parallelize -> allocate -> init. Same seed everywhere, so every
    # rank initializes its shards of the same full model.
    longest = max(training.seq_len, config.validation.seq_len if validator else 0)
    args = build_model_args(
        spec, config.model, vocab_size=tokenizer.vocab_size, max_seq_len=longest
    )
    torch.manual_seed(training.seed)
    if training.deterministic:
        torch.use_deterministic_algorithms(True)
    with torch.device("meta"):
        model = spec.model_cls(args)
    pipeline = None
    if dims.pp_enabled:
        # Gradient accumulation runs as more microbatches of one schedule step: the
        # schedule divides gradients by its microbatch count, which then spans the whole
        # step's batch.
        pipeline = spec.pipeline_fn(
            model,
            dims,
            config.pipeline,
            config.parallelize,
            local_batch_size=batches.local_batch_size * batches.accumulation_steps,
            loss_fn=cross_entropy_loss,
            device=device,
            seq_len=training.seq_len,
        )
        model_parts = pipeline.model_parts
    else:
        model_parts = [
            spec.parallelize_fn(model, dims, config.parallelize, seq_len=training.seq_len)
        ]
    for part in model_parts:
        part.to_empty(device=device)
        part.init_weights(buffer_device=device)
        part.train()
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
    optimizers = build_optimizers(model_parts, config.optimizer, pipeline_parallel=dims.pp_enabled)
    optimizers.warn_on_skip = False  # the NonFiniteGuard below reports each skipped step
    schedulers = build_lr_schedulers(optimizers, config.lr_scheduler, training_steps=training.steps)
    if replicas is not None:
        optimizers = replicas.wrap_optimizers(optimizers)

    # 6. Checkpointing and resume.
    train_state = TrainState()
    checkpoint_config = checkpoint_settings(config)
    # The model as built (name, flavor, real args), recorded with every checkpoint.
    metadata = model_metadata(spec, config.model.flavor, args)
    checkpointer = CheckpointManager(
        checkpoint_config,
        model_parts=model_parts,
        states={
            "optimizer": optimizers,
            "lr_scheduler": schedulers,
            "dataloader": dataloader,
            "train_state": train_state,
        },
        state_dict_adapter=state_dict_adapter(spec, config.model.flavor, args),
        metadata=metadata,
        ft_manager=None if replicas is None else replicas.manager,
        ft_replica_id=None if replicas is None else replicas.replica_id,
        data_parallel_degree=data_degree,
    )
    checkpointer.load()
    check_resumed_model(checkpointer.loaded_metadata, metadata)
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
    # Each replica group reports its own numbers, in its own folder.
    output_folder = (
        config.job.dump_folder
        if replicas is None
        else os.path.join(config.job.dump_folder, f"ft-replica-{replicas.replica_id}")
    )
    metrics = MetricsLogger(
        config.metrics,
        dump_folder=output_folder,
        rank=rank,
        flops_per_token=flops_per_token,
        device=device,
        total_steps=training.steps,
    )

    # 7. The loop.
    loss_group = dims.get_mesh("dp_cp").get_group() if dims.dp_cp_enabled else None
    pp_group = dims.get_mesh("pp") if dims.pp_enabled else None
    batch_iter = iter(dataloader)
    profiler = Profiler(
        config.profiling,
        dump_folder=output_folder,
        rank=rank,
        device=device,
        step=train_state.step,
    )
    nonfinite = NonFiniteGuard(training.skip_nonfinite_steps)
    gc.disable()
    try:
        while train_state.step < training.steps:
            train_state.step += 1
            step_started = time.perf_counter()
            if train_state.step % training.gc_freq == 0:
                gc.collect(1)
            # Clearing gradients at the start of the step also starts torchft's quorum
            # for it, which then runs during the forward pass.
            optimizers.zero_grad()
            micro_batches, data_seconds = _next_batches(
                batch_iter, batches.accumulation_steps, device
            )
            tokens = sum(labels.numel() for _, labels in micro_batches)
            if pipeline is None:
                loss = _forward_backward(
                    model_parts[0], micro_batches, loss_context, sequence_context
                )
            else:
                loss = _pipeline_forward_backward(
                    pipeline, micro_batches, loss_context, sequence_context, pp_group
                )
            replica_groups = 1
            if replicas is not None:
                replicas.average_gradients(model_parts)
                replica_groups = replicas.participants()
            step_tokens = tokens_of_step(tokens, dims, replica_groups)
            train_state.tokens_seen += step_tokens.global_tokens
            grad_norm = None
            if training.max_norm > 0:
                grad_norm = optimizers.clip_grad_norm_(training.max_norm, pp_group=pp_group)
                # Past the limit this raises: before the step's update and its checkpoint.
                nonfinite.observe(train_state.step, float(grad_norm))
            checkpointer.maybe_wait_for_staging()
            optimizers.step()
            lr = schedulers.get_last_lr()[0]  # the lr this step trained with
            schedulers.step()

            if loss_group is not None:
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=loss_group)
            metrics.log(
                step=train_state.step,
                loss=loss.item(),
                grad_norm=None if grad_norm is None else float(grad_norm),
                lr=lr,
                tokens=step_tokens.global_tokens,
                devices=step_tokens.devices,
                step_seconds=time.perf_counter() - step_started,
                data_seconds=data_seconds,
                extra=None if grad_norm is None else {"skipped_steps": nonfinite.skipped},
            )
            if validator is not None and validator.should_validate(
                train_state.step, training.steps
            ):
                validation_loss = validator.validate(model_parts, pipeline)
                metrics.log_scalars(train_state.step, {"validation/loss": validation_loss})
            checkpointer.save(train_state.step, last_step=train_state.step == training.steps)
            profiler.step()
            if train_state.step == 1:
                # Start-up is over: from now on a hung rank should fail fast.
                set_collective_timeout(
                    timedelta(seconds=comm.train_timeout_seconds),
                    [dims.world_mesh] if dims.layout.names else None,
                )
    finally:
        gc.enable()
        profiler.close()
        checkpointer.close()
        metrics.close()
    dist.barrier()
    return train_state


Batch = tuple[torch.Tensor, torch.Tensor]


def checkpoint_settings(config: JobConfig) -> CheckpointConfig:
    """The ``[checkpoint]`` section with its folder under ``job.dump_folder`` (a URL as is)."""
    folder = config.checkpoint.folder
    if "://" not in folder:
        folder = os.path.join(config.job.dump_folder, folder)
    return replace(config.checkpoint, folder=folder)


def _next_batches(batch_iter: Any, count: int, device: torch.device) -> tuple[list[Batch], float]:
    """The next ``count`` (inputs, labels) batches on ``device``, and seconds spent waiting."""
    started = time.perf_counter()
    out = []
    for _ in range(count):
        inputs, labels = next(batch_iter)
        out.append((inputs.to(device), labels.to(device)))
    return out, time.perf_counter() - started


def _forward_backward(
    model: torch.nn.Module,
    micro_batches: list[Batch],
    loss_context: Any,
    sequence_context: Any,
) -> torch.Tensor:
    """Forward and backward of each micro-batch, gradients accumulated as the mean over
    them; returns the mean loss (a plain tensor)."""
    loss_sum = torch.zeros((), device=micro_batches[0][1].device)
    for whole_inputs, whole_labels in micro_batches:
        with sequence_context(whole_inputs, whole_labels) as (inputs, labels), loss_context():
            loss = cross_entropy_loss(model(inputs), labels)
            (loss / len(micro_batches)).backward()
        loss = loss.detach()
        # Under loss parallel the loss is a replicated DTensor; log its plain value.
        loss_sum += loss.full_tensor() if isinstance(loss, DTensor) else loss
    return loss_sum / len(micro_batches)


def _pipeline_forward_backward(
    pipeline: Any,
    micro_batches: list[Batch],
    loss_context: Any,
    sequence_context: Any,
    pp_group: Any,
) -> torch.Tensor:
    """One schedule step over all micro-batches (concatenated: the schedule splits them
    into its microbatches); returns the mean loss on every pipeline rank."""
    whole_inputs = torch.cat([inputs for inputs, _ in micro_batches])
    whole_labels = torch.cat([labels for _, labels in micro_batches])
    with sequence_context(whole_inputs, whole_labels) as (inputs, labels), loss_context():
        loss = pipeline.step(inputs, labels)
    # Only the last stage's rank has the loss: the others add zeros.
    loss = torch.zeros((), device=labels.device) if loss is None else loss.detach().clone()
    dist.all_reduce(loss, group=pp_group.get_group())
    return loss


def check_checkpoint_folder(config: JobConfig) -> None:
    """Raise ``CheckpointConfigError`` before any work unless the checkpoint folder can take
    this run's saves (``titan_ckpt.check_folder_writable``: writable, its filesystem
    installed) and holds no step directory titan cannot use nor one of torchtitan's that this
    run would save over (``titan_ckpt.check_folder_contents``): nothing titan did not write
    is ever touched."""
    settings = checkpoint_settings(config)
    storage = check_folder_writable(settings)
    check_folder_contents(settings, final_step=config.training.steps, storage=storage)


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
