"""``build(config, plan) -> TrainingRun``: every part of a training run, built and resumed.

First the checkpoint folder's writer lock (a second run on the folder stops before writing),
then the parts in the order they depend on, which keeps runs reproducible: data, the model
(meta, parallelized or split, allocated, initialized from ``training.seed``), optimizers and
LR schedules, the checkpointer (which resumes), metrics, the profiler.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_ckpt import CheckpointManager, FaultToleranceOptions, lock_checkpoint_folder
from titan_ckpt.lock import FolderLock
from titan_dims import ParallelDims
from titan_models import Pipeline, StepContext
from titan_models.documents import DocumentMasking
from titan_models.init import seeded_init
from titan_optim import LRSchedulersContainer, Optimizers, build_lr_schedulers, build_optimizers
from titan_train.config import JobConfig
from titan_train.config.model_args import (
    build_model_args,
    check_resumed_model,
    model_metadata,
    state_dict_adapter,
)
from titan_train.data import TextDataLoader, build_dataloader
from titan_train.data.dataloader import explain_load_error
from titan_train.data.mixture import build_mixture_dataloader
from titan_train.fault_tolerance import ReplicaGroup
from titan_train.metrics import MetricsLogger
from titan_train.preflight import Plan
from titan_train.tokenizer import Tokenizer, load_tokenizer
from titan_train.trainer.hf_start import run_vocab_size
from titan_train.trainer.nonfinite import NonFiniteGuard
from titan_train.trainer.profiling import Profiler
from titan_train.trainer.state import TrainState
from titan_train.trainer.step import Batch, LossFn, build_loss_fn, cross_entropy_sum, mean_loss
from titan_train.trainer.tied_state import tied_optimizer_state
from titan_train.trainer.validation import Validator

__all__ = ["TrainingRun", "build", "close"]

logger = logging.getLogger("titan_train")


@dataclass(frozen=True)
class TrainingRun:
    """The parts of one training run, as ``build`` made them (the fields are fixed; the
    parts keep their own state: ``train_state.step`` advances, the dataloader moves on)."""

    config: JobConfig
    plan: Plan
    """What preflight decided: world, layout, batch plan, model spec, step context."""
    model_parts: list[nn.Module]
    """The model, or this rank's pipeline stages, in stage order."""
    pipeline: Pipeline | None
    """The pipeline schedule over ``model_parts``; ``None`` without pipeline parallelism."""
    optimizers: Optimizers
    schedulers: LRSchedulersContainer
    dataloader: TextDataLoader
    batches: Iterator[Batch]
    """The training batches, an iterator over ``dataloader`` (resumed where it stood)."""
    checkpointer: CheckpointManager
    validator: Validator | None
    """``None`` unless ``validation.enable``."""
    metrics: MetricsLogger | None
    """``None`` for a seed-checkpoint run, which trains no step."""
    profiler: Profiler | None
    """``None`` for a seed-checkpoint run."""
    train_state: TrainState
    nonfinite: NonFiniteGuard
    replicas: ReplicaGroup | None
    """This process's torchft replica group; ``None`` without fault tolerance."""
    output_folder: str
    """Where metrics and traces go (per replica group with fault tolerance)."""
    loss_fn: LossFn = cross_entropy_sum
    """The summed loss of each batch's trained tokens (compiled with ``parallelize.compile``:
    ``build_loss_fn``); a pipeline's schedule takes its mean per token (``mean_loss``)."""
    documents: DocumentMasking | None = None
    """Document masking (``training.document_masking``), by the tokenizer's EOS; ``None``:
    off."""

    @property
    def step_context(self) -> StepContext:
        """How each step drives the parallel plan (``plan.step_context``)."""
        return self.plan.step_context

    @property
    def parallel_dims(self) -> ParallelDims:
        """The run's layout (``plan.parallel_dims``)."""
        return self.plan.parallel_dims

    @property
    def device(self) -> torch.device:
        """This rank's device (``plan.world.device``)."""
        return self.plan.world.device

    @property
    def max_norm(self) -> float:
        """The gradient-clipping norm (``training.max_norm``; 0: off)."""
        return self.config.training.max_norm

    @property
    def metrics_fn(self) -> Callable[[Sequence[nn.Module]], Mapping[str, float]] | None:
        """The model family's own metrics (``plan.spec.metrics_fn``)."""
        return self.plan.spec.metrics_fn

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        """The pipeline-parallel mesh (gradient norms span its stages); ``None`` without."""
        dims = self.plan.parallel_dims
        return dims.get_mesh("pp") if dims.pp_enabled else None


def build(config: JobConfig, plan: Plan) -> TrainingRun:
    """Build and resume every part of the run ``plan`` describes (a seed-checkpoint run gets
    no metrics or profiler); call ``close(run)`` when done, also on failure."""
    ft = config.fault_tolerance
    # Every rank raises the refusal of another run's hold; the checkpointer releases it.
    lock = lock_checkpoint_folder(plan.checkpoint, torchft=ft.enable, ft_replica_id=ft.replica_id)
    replicas = None
    try:
        if ft.enable:
            world = plan.world
            replicas = ReplicaGroup(
                ft, device=world.device, rank=world.rank, world_size=world.world_size
            )
        return _build(config, plan, replicas, lock)
    except BaseException:
        if replicas is not None:
            replicas.close()
        lock.release()
        raise


def _build(
    config: JobConfig, plan: Plan, replicas: ReplicaGroup | None, lock: FolderLock
) -> TrainingRun:
    # Long on purpose: one straight sequence in the order the parts depend on (which keeps
    # runs reproducible); split up, the parts would only be passed between the pieces.
    dims, world = plan.parallel_dims, plan.world
    dump_file = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if dump_file and world.device.type != "cpu":
        # torch writes the flight recorder's dump there on a timeout, into a folder that
        # must exist then.
        os.makedirs(os.path.dirname(dump_file) or ".", exist_ok=True)
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    dp_rank = dims.dp_rank(world.rank)
    # With torchft, data is sharded over the data-parallel ranks of every replica group.
    data_rank, data_degree = (
        (dp_rank, dims.dp_degree)
        if replicas is None
        else replicas.data_parallel(dp_rank, dims.dp_degree)
    )
    data = config.training.data_config(
        seq_len=config.training.seq_len,
        local_batch_size=config.training.local_batch_size,
        infinite=True,
        num_shards=config.training.data_shards,
        prefetch=config.training.data_prefetch,
        shard_layout=config.training.data_shard_layout,
    )
    if config.training.datasets:  # a weighted mixture of sources
        dataloader: TextDataLoader = build_mixture_dataloader(
            config.training.datasets,
            tokenizer,
            seed=config.training.seed,
            data=data,
            dp_rank=data_rank,
            dp_degree=data_degree,
        )
    else:
        dataloader = build_dataloader(data, tokenizer, dp_rank=data_rank, dp_degree=data_degree)
    loss_fn = build_loss_fn(config.parallelize, loss_parallel=plan.step_context.loss_parallel)
    documents = document_masking(config, tokenizer)
    validator = _build_validator(config, plan, tokenizer, dp_rank, loss_fn, documents)
    args, model_parts, pipeline = _build_model(
        config, plan, run_vocab_size(config, tokenizer.vocab_size), validator is not None, loss_fn
    )

    optimizers: Any = build_optimizers(
        model_parts, config.optimizer, pipeline_parallel=dims.pp_enabled
    )
    optimizers.warn_on_skip = False  # the NonFiniteGuard reports each skipped step
    post_step = _register_post_step(plan, model_parts, optimizers)
    _scale_auxiliary_losses(plan, model_parts)
    schedulers = build_lr_schedulers(
        optimizers, config.lr_scheduler, training_steps=config.training.steps
    )
    if replicas is not None:
        optimizers = replicas.wrap_optimizers(optimizers)
        _sum_over_replica_groups(optimizers, post_step)

    train_state = TrainState()
    # The model as built (name, flavor, real args), recorded with every checkpoint.
    metadata = model_metadata(
        plan.spec, config.model.flavor, args, tokenizer_path=config.model.tokenizer_path
    )
    checkpointer = CheckpointManager(
        plan.checkpoint,
        model_parts=model_parts,
        states={
            # A tied weight's copy on the last pipeline stage saves as the one weight.
            "optimizer": tied_optimizer_state(optimizers, pipeline),
            "lr_scheduler": schedulers,
            "dataloader": dataloader,  # each step records its dp_degree (resharding guard)
            "train_state": train_state,
        },
        state_dict_adapter=state_dict_adapter(plan.spec, config.model.flavor, args),
        metadata=metadata,
        folder_lock=lock,
        ft=None
        if replicas is None
        else FaultToleranceOptions(
            replicas.manager,
            replicas.replica_id,
            dataloader_checkpoints=config.checkpoint.enable_ft_dataloader_checkpoints,
        ),
    )
    try:
        checkpointer.load()
    except Exception as e:  # a dataloader state of another shard layout: say how to resume
        explained = explain_load_error(e, dataloader.num_shards, dataloader.shard_layout)
        if explained is None:
            raise
        raise explained from None
    check_resumed_model(checkpointer.loaded_metadata, metadata, source=checkpointer.loaded_source)
    return _with_reporting(
        config,
        TrainingRun(
            config=config,
            plan=plan,
            model_parts=model_parts,
            pipeline=pipeline,
            optimizers=optimizers,
            schedulers=schedulers,
            dataloader=dataloader,
            batches=iter(dataloader),
            checkpointer=checkpointer,
            validator=validator,
            metrics=None,
            profiler=None,
            train_state=train_state,
            nonfinite=NonFiniteGuard(config.training.skip_nonfinite_steps),
            replicas=replicas,
            # Each replica group reports its own numbers, in its own folder.
            output_folder=config.job.dump_folder
            if replicas is None
            else os.path.join(config.job.dump_folder, f"ft-replica-{replicas.replica_id}"),
            loss_fn=loss_fn,
            documents=documents,
        ),
        flops_per_token=args.flops_per_token(config.training.seq_len),
    )


def _register_post_step(plan: Plan, model_parts: list[nn.Module], optimizers: Any) -> Any:
    """``ModelSpec.post_step_fn`` (e.g. the experts' bias update) as a post-hook of the inner
    container, so it runs only for committed, unskipped steps; the hook or ``None``."""
    if plan.spec.post_step_fn is None:
        return None
    hook = plan.spec.post_step_fn(model_parts, plan.parallel_dims)
    if hook is not None:
        optimizers.register_step_post_hook(lambda _container: hook())
    return hook


def _sum_over_replica_groups(optimizers: Any, post_step: Any) -> None:
    """Under torchft, sum the after-step hook's buffers (MoE token counts) over the replica
    groups before each commit, so every group nudges its expert biases alike."""
    buffers = getattr(post_step, "replica_summed_buffers", None)
    if buffers is not None and hasattr(optimizers, "sum_over_replica_groups"):
        optimizers.sum_over_replica_groups(buffers)


def _scale_auxiliary_losses(plan: Plan, model_parts: list[nn.Module]) -> None:
    """Give modules with their own backward loss term (MoE balance loss) the trainer's
    ``aux_loss_grad_scale``: 1 / accumulation steps (1 under a pipeline, which scales)."""
    steps = 1 if plan.pipeline_microbatches is not None else plan.batches.accumulation_steps
    for part in model_parts:
        for module in part.modules():
            if hasattr(module, "aux_loss_grad_scale"):
                module.aux_loss_grad_scale = 1.0 / steps


def _with_reporting(config: JobConfig, run: TrainingRun, *, flops_per_token: float) -> TrainingRun:
    """``run`` with its metrics logger and profiler; a seed-checkpoint run gets none."""
    if config.checkpoint.create_seed_checkpoint:
        return run
    world = run.plan.world
    metrics = MetricsLogger(
        config.metrics,
        dump_folder=run.output_folder,
        rank=world.rank,
        flops_per_token=flops_per_token,
        device=world.device,
        total_steps=config.training.steps,
    )
    profiler = Profiler(
        config.profiling,
        dump_folder=run.output_folder,
        rank=world.rank,
        device=world.device,
        step=run.train_state.step,
    )
    return dataclasses.replace(run, metrics=metrics, profiler=profiler)


def document_masking(config: JobConfig, tokenizer: Tokenizer) -> DocumentMasking | None:
    """The run's document masking: documents end at ``tokenizer.eos_id``; ``None`` when
    ``training.document_masking`` is off."""
    training = config.training
    if not training.document_masking:
        return None
    return DocumentMasking(
        tokenizer.eos_id, restart_positions=training.document_positions == "restart"
    )


def _build_validator(
    config: JobConfig,
    plan: Plan,
    tokenizer: Tokenizer,
    dp_rank: int,
    loss_fn: LossFn,
    documents: DocumentMasking | None = None,
) -> Validator | None:
    if not config.validation.enable:
        return None
    return Validator(
        config.validation,
        tokenizer,
        dims=plan.parallel_dims,
        dp_rank=dp_rank,
        device=plan.world.device,
        step_context=plan.step_context,
        loss_fn=loss_fn,
        documents=documents,
    )


def _build_model(
    config: JobConfig,
    plan: Plan,
    vocab_size: int,
    validating: bool,
    loss_fn: LossFn,
    *,
    materialize: bool = True,
) -> tuple[Any, list[nn.Module], Pipeline | None]:
    """Model args, the parts (meta, parallelized or split, allocated, initialized by seed and
    name) and the pipeline; ``materialize=False`` leaves them on meta (``estimate``)."""
    training, spec, dims, device = config.training, plan.spec, plan.parallel_dims, plan.world.device
    longest = max(training.seq_len, config.validation.seq_len if validating else 0)
    args = build_model_args(spec, config.model, vocab_size=vocab_size, max_seq_len=longest)
    seed_model_init(training.seed, dims, device)
    if training.deterministic:
        use_deterministic_algorithms()
    with torch.device("meta"):
        model = spec.model_cls(args)
    pipeline = None
    if dims.pp_enabled:
        assert spec.pipeline_fn is not None  # preflight refused a family without one
        # Gradient accumulation runs as more microbatches of one schedule step: the
        # schedule divides gradients by its microbatch count, which then spans the step.
        batches = plan.batches
        pipeline = spec.pipeline_fn(
            model,
            dims,
            config.pipeline,
            config.parallelize,
            local_batch_size=batches.local_batch_size * batches.accumulation_steps,
            # The schedule averages its microbatches' losses: each gives its mean per token.
            loss_fn=mean_loss(loss_fn),
            device=device,
            seq_len=training.seq_len,
        )
        model_parts = pipeline.model_parts
    else:
        model_parts = [
            spec.parallelize_fn(model, dims, config.parallelize, seq_len=training.seq_len)
        ]
    if not materialize:
        return args, model_parts, pipeline
    params_on, buffers_on = materialization_devices(config, device)
    for part in model_parts:
        part.to_empty(device=params_on)
        with seeded_init(part, training.seed):  # by seed and name: any layout, same weights
            part.init_weights(buffer_device=buffers_on)
        part.train()
    if pipeline is not None:
        pipeline.sync_tied_weights()  # each end drew by its own name: the first's for both
    logger.info(
        "%s %s: %s parameters, %s; %d x %d tokens per step (%d accumulation steps)",
        spec.name,
        config.model.flavor,
        f"{args.num_params():,}",
        dims,
        plan.batches.global_batch_size,
        training.seq_len,
        plan.batches.accumulation_steps,
    )
    return args, model_parts, pipeline


def seed_model_init(seed: int, dims: ParallelDims, device: torch.device) -> None:
    """Seed torch's (and DTensor's) generators with ``seed + pp rank`` for a third-party model
    whose ``init_weights`` draws from them, so stages do not draw identical blocks."""
    pp_rank = dims.get_mesh("pp").get_local_rank() if dims.pp_enabled else 0
    torch.manual_seed(seed + pp_rank)
    if device.type == "cpu" or not dims.layout.names:
        return  # DTensor's random ops use the plain generator on CPU
    from torch.distributed.tensor._random import manual_seed as seed_dtensor_rng

    stage_dims = tuple(name for name in dims.layout.dim_names if name != "pp")
    if stage_dims:
        seed_dtensor_rng(seed + pp_rank, dims.get_mesh(stage_dims))


def materialization_devices(
    config: JobConfig, device: torch.device
) -> tuple[torch.device, torch.device]:
    """Where parameters and buffers are allocated: the run's device, but all on the host for a
    seed checkpoint (as torchtitan) and parameters on the host under CPU offload."""
    host = torch.device("cpu")
    if config.checkpoint.create_seed_checkpoint:
        return host, host
    if config.parallelize.cpu_offload:
        return host, device
    return device, device


def use_deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True)``, with ``CUBLAS_WORKSPACE_CONFIG`` (the
    user's kept) and cuDNN's benchmarking and nondeterministic kernels off."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def close(run: TrainingRun) -> None:
    """Close what holds files, threads or servers (waiting for an async save); safe after a
    failure."""
    try:
        run.dataloader.close()
        if run.profiler is not None:
            run.profiler.close()
        run.checkpointer.close()
        if run.metrics is not None:
            run.metrics.close()
    finally:
        if run.replicas is not None:
            run.replicas.close()
