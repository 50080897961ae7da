"""``preflight(config, world) -> Plan``: every check a config must pass before any work.

The rules decided from the config and the world alone (no process group, model or data), in
the order a user meets them; each failure is one ``ConfigError`` (or its package's config
error) naming the key, the value and a fix (exit 2). The context-parallel implementation is
resolved once here, into the plan's ``StepContext``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from titan_ckpt import (
    CheckpointConfig,
    CheckpointConfigError,
    check_folder_contents,
    check_folder_writable,
)
from titan_dims import ParallelDims
from titan_models import ModelConfigError, ModelSpec, StepContext, check_seq_len, step_context
from titan_models.parallel import check_document_masking
from titan_optim.build import group_parameters
from titan_train.compat import check_supported
from titan_train.config import ConfigError, JobConfig
from titan_train.config.model_args import build_model_args
from titan_train.config.registry import load_model_spec
from titan_train.data.chat import check_chat_template
from titan_train.data.chat_template import load_chat_template
from titan_train.fault_tolerance import check_fault_tolerance
from titan_train.fault_tolerance.semi_sync import check_semi_sync
from titan_train.tokenizer import load_tokenizer
from titan_train.trainer.hf_start import check_initial_hf_load
from titan_train.trainer.memory_fit import check_memory_fits

logger = logging.getLogger("titan_train")

__all__ = [
    "BatchPlan",
    "Plan",
    "World",
    "check_chat_data",
    "check_checkpoint_folder",
    "check_initial_load",
    "check_model_layout",
    "check_optimizer_in_backward",
    "check_seed_checkpoint",
    "check_seq_lens",
    "checkpoint_cost_warning",
    "checkpoint_settings",
    "plan_batches",
    "preflight",
]


@dataclass(frozen=True)
class World:
    """The processes a run trains on: this one's rank, how many, and its device."""

    rank: int
    world_size: int
    device: torch.device
    local_world_size: int = 1
    """The ranks on this host (they share its memory)."""
    started: bool = True
    """Whether the ranks' processes run already (False in the launcher, before it starts
    them)."""

    @classmethod
    def current(cls, device: torch.device) -> World:
        """This process in the initialized default process group."""
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            device=device,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
        )


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch splits over data-parallel ranks and accumulation steps."""

    local_batch_size: int
    global_batch_size: int
    accumulation_steps: int


@dataclass(frozen=True)
class Plan:
    """What preflight decided: everything ``build`` needs besides the config."""

    world: World
    parallel_dims: ParallelDims
    batches: BatchPlan
    spec: ModelSpec
    step_context: StepContext
    """How each step drives the parallel plan (CP implementation resolved here, once)."""
    checkpoint: CheckpointConfig
    """The ``[checkpoint]`` section with its folder resolved under ``job.dump_folder``."""
    pipeline_microbatches: int | None
    """The pipeline schedule's microbatches per step; ``None`` without pipelining."""


def preflight(config: JobConfig, world: World) -> Plan:
    """Check ``config`` for ``world`` before any work; return the run's ``Plan``."""
    check_seed_checkpoint(config, world)
    check_supported(config.model.converters, config.parallelize.param_dtype)
    dims = ParallelDims.from_config(
        config.parallelism, world.world_size, device_type=world.device.type
    )
    batches = plan_batches(config, dims)
    spec = check_model(config, dims)
    check_seq_lens(config, dims)
    check_model_layout(config, dims, spec, batches)
    if config.training.document_masking:
        check_document_masking(dims)
    warning = checkpoint_cost_warning(config, spec)
    if warning and world.rank == 0:
        logger.warning("%s", warning)
    microbatches = None
    if dims.pp_enabled:
        steps = batches.local_batch_size * batches.accumulation_steps
        microbatches = steps // config.pipeline.microbatch_size
        check_validation_microbatches(config, microbatches)
    check_initial_load(config)
    check_checkpoint_folder(config)
    check_initial_hf_load(config, spec, max_seq_len=_longest_seq_len(config))
    check_fault_tolerance(
        config.fault_tolerance,
        dims,
        create_seed_checkpoint=config.checkpoint.create_seed_checkpoint,
    )
    check_semi_sync(
        config.fault_tolerance, n_layers=_n_layers(config, spec), device_type=world.device.type
    )
    check_optimizer_in_backward(config, dims)
    check_chat_data(config, dims)
    check_memory_fits(
        config,
        _model_args(config, spec, config.training.seq_len).num_params(exclude_embedding=True),
        shards=dims.dp_shard * dims.cp * dims.tp * dims.pp,
        local_ranks=min(world.local_world_size, world.world_size),
        device=world.device,
        started=world.started,
    )
    check_muon_rules(config, spec)
    return Plan(
        world=world,
        parallel_dims=dims,
        batches=batches,
        spec=spec,
        step_context=step_context(dims, config.parallelize),
        checkpoint=checkpoint_settings(config),
        pipeline_microbatches=microbatches,
    )


def check_muon_rules(config: JobConfig, spec: ModelSpec) -> None:
    """With Muon rules, split the meta model's parameters as the optimizers will, so one
    Muon cannot orthogonalise is refused (``OptimizerConfigError``) before any work."""
    optimizer = config.optimizer
    if optimizer.name != "Muon" or all(r.optimizer != "Muon" for r in optimizer.param_group_rules):
        return
    with torch.device("meta"):
        group_parameters(
            spec.model_cls(_model_args(config, spec, config.training.seq_len)), optimizer
        )


def check_seed_checkpoint(config: JobConfig, world: World) -> None:
    """Refuse ``checkpoint.create_seed_checkpoint`` over several processes: the seed is the
    whole unsharded model, written by one (as torchtitan requires)."""
    if config.checkpoint.create_seed_checkpoint and world.world_size > 1:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint=true writes the seed from one process, but "
            f"this run has {world.world_size}; run it alone (no --nproc-per-node, no torchrun)."
        )


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


def check_model(config: JobConfig, dims: ParallelDims) -> ModelSpec:
    """The registered spec of ``model.name``, its flavor, args and pipelining checked."""
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
    if config.model.args:  # [model.args]: keys, types and the family's own rules
        _model_args(config, spec)
    return spec


def check_seq_lens(config: JobConfig, dims: ParallelDims) -> None:
    """The sequence lengths against the layout (``titan_models.check_seq_len``)."""
    lengths = {"training.seq_len": config.training.seq_len}
    if config.validation.enable:
        lengths["validation.seq_len"] = config.validation.seq_len
    for name, seq_len in lengths.items():
        try:
            check_seq_len(seq_len, dims, name=name)
        except ModelConfigError as error:
            raise ConfigError(str(error)) from None


def check_model_layout(
    config: JobConfig, dims: ParallelDims, spec: ModelSpec, batches: BatchPlan
) -> None:
    """The flavor against the layout: the spec's ``check_fn``, on the args the run builds."""
    if spec.check_fn is None:
        return
    spec.check_fn(
        _model_args(config, spec),
        dims,
        config.parallelize,
        seq_len=config.training.seq_len,
        pipeline_config=config.pipeline if dims.pp_enabled else None,
        # Gradient accumulation runs as more microbatches of one schedule step.
        local_batch_size=batches.local_batch_size * batches.accumulation_steps,
    )


def checkpoint_cost_warning(config: JobConfig, spec: ModelSpec) -> str | None:
    """A warning for a ``checkpoint.interval`` under 100 (the default 10 is sized for the CPU
    demo) with a model of 1B+ parameters: each save writes 12 bytes a parameter."""
    checkpoint = config.checkpoint
    if not checkpoint.enable or checkpoint.interval >= 100:
        return None
    params = _model_args(config, spec, config.training.seq_len).num_params()
    if params < 1e9:
        return None
    return (
        f"checkpoint.interval={checkpoint.interval} saves a {params / 1e9:.1f}B-parameter "
        f"model (~{12 * params / 1e9:,.0f} GB with its optimizer state) every "
        f"{checkpoint.interval} steps; torchtitan saves every 500. Set checkpoint.interval "
        "to what your storage and step time allow."
    )


def _n_layers(config: JobConfig, spec: ModelSpec) -> int:
    """The model's blocks, as the run will build it (0 for a model without ``n_layers``)."""
    if config.fault_tolerance.semi_sync_method is None:
        return 0  # only the semi-sync fragments need it
    return int(getattr(_model_args(config, spec), "n_layers", 0))


def _longest_seq_len(config: JobConfig) -> int:
    """The longest sequence the run feeds its model (training or validation)."""
    return max(
        config.training.seq_len, config.validation.seq_len if config.validation.enable else 0
    )


def _model_args(config: JobConfig, spec: ModelSpec, seq_len: int | None = None) -> Any:
    """The model's args as the run builds them (its longest sequence unless ``seq_len``)."""
    longest = _longest_seq_len(config) if seq_len is None else seq_len
    return build_model_args(spec, config.model, vocab_size=None, max_seq_len=longest)


def check_validation_microbatches(config: JobConfig, microbatches: int) -> None:
    """The validation batch must split into the pipeline schedule's microbatches."""
    local = config.validation.local_batch_size
    if config.validation.enable and local % microbatches:
        raise ConfigError(
            f"validation.local_batch_size={local} must be a multiple of the pipeline's "
            f"{microbatches} microbatches (training.local_batch_size x accumulation steps / "
            f"pipeline.microbatch_size) under pipeline parallelism; e.g. {microbatches}."
        )


def check_optimizer_in_backward(config: JobConfig, dims: ParallelDims) -> None:
    """``optimizer.early_step_in_backward`` steps each parameter in backward: no clipping
    (no global norm), FSDP, pipelining or torchft (all act on gradients after backward)."""
    if not config.optimizer.early_step_in_backward:
        return
    conflicts = []
    if config.training.max_norm > 0:
        conflicts.append(f"gradient clipping (training.max_norm={config.training.max_norm}: set 0)")
    if dims.fsdp_enabled:
        conflicts.append(
            f"FSDP (data_parallel_shard_degree x context_parallel_degree = "
            f"{dims.dp_shard * dims.cp}: set both to 1)"
        )
    if dims.pp_enabled:
        conflicts.append(f"pipeline parallelism (pipeline_parallel_degree={dims.pp}: set 1)")
    if config.fault_tolerance.enable:
        conflicts.append("fault tolerance (fault_tolerance.enable: set false)")
    if conflicts:
        raise ConfigError(
            "optimizer.early_step_in_backward=true steps each parameter during backward and "
            f"cannot be combined with {'; '.join(conflicts)}; or set "
            "optimizer.early_step_in_backward=false."
        )


def check_chat_data(config: JobConfig, dims: ParallelDims) -> None:
    """Chat data: not under pipeline parallelism (its schedule averages microbatch means), and a
    template that renders and marks assistant turns (loads the tokenizer, reads no data)."""
    sections = [config.training]
    if config.validation.enable:
        sections.append(config.validation)
    chat = [source for source in sections if source.dataset_format == "chat"]
    if not chat:
        return
    if dims.pp_enabled:
        raise ConfigError(
            f"{chat[0].section}.dataset_format='chat' cannot be trained with pipeline "
            f"parallelism (pipeline_parallel_degree={dims.pp}): its schedule averages "
            "microbatch means, not the loss per trained token; set "
            "parallelism.pipeline_parallel_degree=1."
        )
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    for source in chat:
        key = f"{source.section}.chat_template"
        template = load_chat_template(source.chat_template, tokenizer, key=key)
        check_chat_template(template, source.train_on, key)


def checkpoint_settings(config: JobConfig) -> CheckpointConfig:
    """The ``[checkpoint]`` section with its folder under ``job.dump_folder`` (a URL as is)."""
    folder = config.checkpoint.folder
    if "://" not in folder:
        folder = os.path.join(config.job.dump_folder, folder)
    return replace(config.checkpoint, folder=folder)


def check_initial_load(config: JobConfig) -> None:
    """Refuse ``checkpoint.initial_load_path`` with checkpointing off, which would silently
    train from random weights (as torchtitan does)."""
    checkpoint = config.checkpoint
    if checkpoint.initial_load_path and not checkpoint.enable:
        raise ConfigError(
            f"checkpoint.initial_load_path={checkpoint.initial_load_path!r} is set but "
            "checkpoint.enable is false, so nothing would be loaded and training would start "
            "from random weights. Set --checkpoint.enable (checkpoint.enable_checkpoint = true "
            "in a torchtitan file) to start from it, or leave initial_load_path empty."
        )


def check_checkpoint_folder(config: JobConfig) -> None:
    """The checkpoint folder takes this run's saves (``titan_ckpt.check_folder_writable``)
    and holds no step this run would misuse or overwrite (``check_folder_contents``)."""
    settings = checkpoint_settings(config)
    storage = check_folder_writable(settings)
    seed = config.checkpoint.create_seed_checkpoint  # saves step 0 alone, no training step
    final_step = None if seed else config.training.steps
    scan = check_folder_contents(settings, final_step=final_step, storage=storage)
    if seed and storage is not None and scan is not None and 0 in scan.torchtitan:
        raise CheckpointConfigError(
            f"checkpoint.create_seed_checkpoint=true would write step 0 over torchtitan's "
            f"checkpoint {storage.join(settings.folder, 'step-0')}; titan never overwrites a "
            "checkpoint it did not write. Move it away, or use another checkpoint.folder."
        )
