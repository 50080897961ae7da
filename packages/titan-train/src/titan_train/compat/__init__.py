"""torchtitan's configuration keys in titan: where each one lives here, as a table.

torchtitan (July 2025 ``config_manager.py``, later ``job_config.py`` names, 2026's
``Trainer.Config`` flags) keeps some settings in other sections, spells some differently,
and has some titan lacks. ``KEYS`` gives every key a user may set one action: ``move`` to
its titan key (converted where spelled differently: ``selective_ac_option = 2`` becomes
``"2"``); ``noop`` (changes nothing titan computes: accepted, named once in the log with
why); ``refuse`` (a feature titan lacks: an ``inert`` value is a no-op, any other stops
loading saying what to use instead); ``batch`` (2026's token-counted batches, turned into
sequences once ``training.seq_len`` is known, ``compat.batch``). A TOML file using any key
of the table is torchtitan's, with ``TORCHTITAN_DEFAULTS`` where it sets nothing; on the
command line (``compat.argv``) the keys override the file but never make it torchtitan's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from titan_optim import OptimizerConfig
from titan_train.errors import ConfigError

__all__ = [
    "KEYS",
    "TORCHTITAN_DEFAULTS",
    "Key",
    "Translation",
    "check_supported",
    "flatten",
    "lookup",
    "translate",
    "unflatten",
]

logger = logging.getLogger("titan_train")


@dataclass(frozen=True, kw_only=True)
class Key:
    """What titan does with one torchtitan key (see the module docstring)."""

    action: Literal["move", "noop", "refuse", "batch"]
    kind: type = str
    """The type of torchtitan's value (``bool``, ``int``, ``float``, ``str``, ``list``):
    how a command-line value is read."""
    to: str = ""
    """``move``: the titan key, as ``section.key``."""
    index: int | None = None
    """``move``: the position in the titan key's list (``beta1`` is ``betas[0]``)."""
    negate: bool = False
    """``move``: the titan key means the opposite (``disable_loss_parallel``)."""
    convert: Callable[[Any], Any] | None = None
    """``move``: turns torchtitan's value into titan's."""
    why: str = ""
    """``noop``: why it changes nothing here; ``refuse``: why, and what to use instead."""
    inert: tuple[Any, ...] = ()
    """``refuse``: the values that ask for nothing, accepted as no-ops."""


def _move(to: str, kind: type = str, **kw: Any) -> Key:
    return Key(action="move", to=to, kind=kind, **kw)


def _noop(why: str, kind: type = bool) -> Key:
    return Key(action="noop", kind=kind, why=why)


def _refuse(why: str, kind: type = bool, inert: tuple[Any, ...] = (False,)) -> Key:
    return Key(action="refuse", kind=kind, why=why, inert=inert)


def _batch(kind: type = int) -> Key:
    return Key(action="batch", kind=kind)


def _ac_option(value: Any) -> Any:
    # torchtitan reads the option as a string; TOML files also write it as a bare number.
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


_QUANTIZED = (
    "it takes effect only through model.converters, and training with any converter is "
    "refused: titan has no float8/MX training"
)
_PERF_ONLY = "changes speed, not results, in torchtitan; titan has no such scheduling"
_ONE_GROUP = (
    "titan's optimizer settings apply to every parameter; per-parameter lr and weight decay "
    "are optimizer.param_group_rules (globs over parameter names), one optimizer for all"
)
_UNSHUFFLED = "it seeds torchtitan's data shuffling; titan reads data in order"
_PROFILE_WINDOW = (
    "it shapes torchtitan's profiler schedule; titan traces profiler_active steps (after "
    "profiler_warmup) every profile_freq steps and snapshots memory on the same steps"
)
_ENTRY_POINTS = (
    "titan finds models through the titan.models entry-point group: pip install the package "
    "that registers yours, then --model.name"
)

_NO_CONFIG_FILE = _refuse(
    "titan writes no config file during a run: save `titan-train config --print ...` output "
    "instead",
    str,
    inert=(None, ""),
)

KEYS: Mapping[str, Key] = {
    # [job]
    "job.print_args": _noop("titan-train config --print shows the merged config"),
    "job.print_config": _noop("titan-train config --print shows the merged config"),
    "job.use_for_integration_test": _noop("it marks torchtitan's own test suite"),
    "job.save_config_file": _NO_CONFIG_FILE,
    "job.custom_config_module": _refuse(_ENTRY_POINTS, str, inert=("",)),
    # [model]
    "model.hf_assets_path": _move("model.tokenizer_path"),
    "model.print_after_conversion": _noop("titan has no model converters"),
    # [optimizer]
    "optimizer.beta1": _move("optimizer.betas", float, index=0),
    "optimizer.beta2": _move("optimizer.betas", float, index=1),
    # [lr_scheduler]: torchtitan's lr_min is already a factor of the peak lr.
    "lr_scheduler.lr_min": _move("lr_scheduler.min_lr_factor", float),
    "lr_scheduler.total_steps": _refuse(
        "titan's schedule always spans training.steps; set training.steps instead",
        int,
        inert=(None,),
    ),
    # [training]
    "training.compile": _move("parallelize.compile", bool),
    "training.enable_cpu_offload": _move("parallelize.cpu_offload", bool),
    "training.mixed_precision_param": _move("parallelize.param_dtype"),
    "training.mixed_precision_reduce": _move("parallelize.reduce_dtype"),
    "training.gc_debug": _refuse(
        "titan has no garbage-collector debug mode; training.gc_freq = 1 collects every step"
    ),
    "training.dtype": _refuse(
        "titan keeps float32 parameters and optimizer state; lower the compute precision "
        "with parallelize.param_dtype",
        str,
        inert=("float32",),
    ),
    "training.dataloader.*": _noop("worker processes and pinning change speed, not data", int),
    # [parallelism]
    "parallelism.fsdp_reshard_after_forward": _move("parallelize.reshard_after_forward"),
    "parallelism.disable_loss_parallel": _move("parallelize.loss_parallel", bool, negate=True),
    "parallelism.context_parallel_rotate_method": _move("parallelize.cp_rotate_method"),
    "parallelism.pipeline_parallel_schedule": _move("pipeline.schedule"),
    "parallelism.pipeline_parallel_schedule_csv": _move(
        "pipeline.schedule_csv", convert=lambda v: v or None
    ),
    "parallelism.pipeline_parallel_microbatch_size": _move("pipeline.microbatch_size", int),
    "parallelism.pipeline_parallel_layers_per_stage": _move("pipeline.layers_per_stage", int),
    "parallelism.pipeline_parallel_split_points": _move("pipeline.split_points", list),
    "parallelism.enable_async_tensor_parallel": _noop(
        "async tensor parallel overlaps TP communication with compute and changes no numbers; "
        "titan runs the TP collectives synchronously"
    ),
    "parallelism.enable_compiled_autograd": _refuse(
        "titan does not compile the backward pass; parallelize.compile compiles each block"
    ),
    "parallelism.pipeline_parallel_first_stage_less_layers": _noop(_PERF_ONLY, int),
    "parallelism.pipeline_parallel_last_stage_less_layers": _noop(_PERF_ONLY, int),
    "parallelism.pipeline_parallel_expert_parallel_overlap": _noop(_PERF_ONLY),
    "parallelism.context_parallel_load_balancer": _noop(_PERF_ONLY, str),
    "parallelism.module_fqns_per_model_part": _refuse(
        "titan splits stages at block boundaries: use pipeline.split_points or "
        "pipeline.layers_per_stage",
        list,
        inert=(None,),
    ),
    "parallelism.expert_tensor_parallel_degree": _refuse(
        "titan has no expert tensor parallelism", int, inert=(1,)
    ),
    "parallelism.expert_parallel_comm_backend": _refuse(
        "titan has no DeepEP all-to-all", str, inert=("standard",)
    ),
    # [checkpoint]
    "checkpoint.enable_checkpoint": _move("checkpoint.enable", bool),
    "checkpoint.initial_load_model_weights_only": _move("checkpoint.initial_load_model_only", bool),
    "checkpoint.last_save_model_weights_only": _move("checkpoint.last_save_model_only", bool),
    "checkpoint.initial_load_in_hf_quantized": _refuse(
        "titan reads unquantized Hugging Face safetensors only"
    ),
    # [activation_checkpoint]
    "activation_checkpoint.mode": _move("parallelize.activation_checkpoint.mode"),
    "activation_checkpoint.selective_ac_option": _move(
        "parallelize.activation_checkpoint.selective_option", convert=_ac_option
    ),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": _noop(
        "it names MoE router matmuls; titan's Llama 3 has no experts", list
    ),
    "activation_checkpoint.preserve_rng_state": _noop(
        "titan's blocks draw no random numbers (no dropout), so there is no RNG state to keep"
    ),
    "activation_checkpoint.memory_budget": _noop(
        "it applies only with mode memory_budget, which titan does not have", float
    ),
    "activation_checkpoint.early_stop": _refuse("titan has no early-stop recomputation"),
    "activation_checkpoint.visualize_memory_budget_pareto": _refuse(
        "titan has no memory-budget activation checkpointing"
    ),
    "activation_checkpoint.determinism_check": _refuse(
        "titan has no recomputation determinism check", str, inert=("default",)
    ),
    "activation_checkpoint.debug": _refuse("titan has no activation-checkpoint debug mode"),
    # [compile]
    "compile.enable": _move("parallelize.compile", bool),
    "compile.backend": _move("parallelize.compile_backend"),
    "compile.components": _noop(
        "titan compiles each transformer block and the loss when compile is on", list
    ),
    # [float8], [mx], [quantize]
    "float8.*": _noop(_QUANTIZED, str),
    "mx.*": _noop(_QUANTIZED, str),
    "quantize.*": _noop(_QUANTIZED, str),
    # [comm]
    "comm.mode": _refuse(
        "titan has no fake or local-tensor communication backend", str, inert=("default",)
    ),
    # [memory_estimation]
    "memory_estimation.enabled": _refuse("titan has no FSDP memory estimator"),
    "memory_estimation.enable": _refuse("titan has no FSDP memory estimator"),
    "memory_estimation.disable_fake_mode": _noop("titan has no FSDP memory estimator"),
    # [experimental]
    "experimental.custom_import": _refuse(_ENTRY_POINTS, str, inert=("",)),
    "experimental.custom_args_module": _refuse(
        "titan's JobConfig is not extended at run time: build your own from titan's "
        "sections in Python",
        str,
        inert=("",),
    ),
    # [validation]
    "validation.enabled": _move("validation.enable", bool),
    "validation.dataloader.*": _noop("worker processes and pinning change speed, not data", int),
    # [debug]: the later home of seed and deterministic.
    "debug.seed": _move("training.seed", int),
    "debug.deterministic": _move("training.deterministic", bool),
    "debug.deterministic_warn_only": _refuse(
        "titan's training.deterministic always raises on a nondeterministic op"
    ),
    "debug.moe_force_load_balance": _refuse(
        "titan has no forced MoE load balancing (its Llama 3 has no experts)"
    ),
    # torchtitan 2026: the flags of Trainer.Config (--module/--config runs).
    "hf_assets_path": _move("model.tokenizer_path"),
    "dump_folder": _move("job.dump_folder"),
    "training.max_context_length": _move("training.seq_len", int),
    "training.num_tokens_per_microbatch_per_dp_rank": _batch(),
    "training.num_tokens_per_train_step": _batch(),
    "parallelism.num_pp_microbatches": _batch(),
    "training.disable_cuda_graphs": _noop(
        "CUDA graphs change speed, not results; titan captures none"
    ),
    "parallelism.enable_fsdp_symm_mem": _noop(_PERF_ONLY),
    "parallelism.enable_sequence_parallel": _noop(
        "sequence parallelism saves memory, not results; titan's tensor parallel always uses it"
    ),
    "parallelism.spmd_backend": _noop(
        "it picks how torchtitan tracks sharding; titan's is DTensor", str
    ),
    "parallelism.context_parallel_ptrr_mask_key": _noop(_PERF_ONLY, str),
    "compile.enable_async_tensor_parallel": _noop(
        "async tensor parallel overlaps TP communication with compute and changes no numbers"
    ),
    "optimizer.param_groups.0.optimizer_name": _move("optimizer.name"),
    "optimizer.param_groups.0.optimizer_kwargs.lr": _move("optimizer.lr", float),
    "optimizer.param_groups.0.optimizer_kwargs.betas": _move(
        "optimizer.betas", list, convert=lambda v: [float(x) for x in v]
    ),
    "optimizer.param_groups.0.optimizer_kwargs.eps": _move("optimizer.eps", float),
    "optimizer.param_groups.0.optimizer_kwargs.weight_decay": _move(
        "optimizer.weight_decay", float
    ),
    "optimizer.param_groups.0.pattern": _refuse(_ONE_GROUP, str, inert=(".*",)),
    "optimizer.param_groups.*": _refuse(_ONE_GROUP, str, inert=()),
    "loss.num_chunks": _noop("chunking the loss saves memory and gives the same loss", int),
    "loss.loss_fn.global_vocab_size": _noop("titan's loss spans the model's vocabulary", int),
    "validator.enable": _move("validation.enable", bool),
    "validator.freq": _move("validation.freq", int),
    "validator.steps": _move("validation.steps", int),
    "validator.dataloader.seed": _noop(_UNSHUFFLED, int),
    "dataloader.seed": _noop(_UNSHUFFLED, int),
    "profiler.enable_profiling": _move("profiling.enable_profiling", bool),
    "profiler.save_traces_folder": _move("profiling.save_traces_folder"),
    "profiler.profile_freq": _move("profiling.profile_freq", int),
    "profiler.profiler_active": _move("profiling.profiler_active", int),
    "profiler.profiler_warmup": _move("profiling.profiler_warmup", int),
    "profiler.enable_memory_snapshot": _move("profiling.enable_memory_snapshot", bool),
    "profiler.save_memory_snapshot_folder": _move("profiling.save_memory_snapshot_folder"),
    "profiler.profiler_repeat": _noop(_PROFILE_WINDOW, int),
    "profiler.profiler_skip_first": _noop(_PROFILE_WINDOW, int),
    "profiler.profiler_skip_first_wait": _noop(_PROFILE_WINDOW, int),
    "profiler.memory_snapshot_freq": _noop(_PROFILE_WINDOW, int),
    "profiler.memory_snapshot_max_entries": _noop(_PROFILE_WINDOW, int),
    "debug.print_config": _noop("titan-train config --print shows the merged config"),
    "debug.enable_structured_logging": _noop("titan writes no structured trace log"),
    "debug.save_config_file": _NO_CONFIG_FILE,
    "debug.spmd_typechecking": _refuse("titan has no SPMD type checking"),
    "debug.detect_anomaly": _refuse(
        "titan has no autograd anomaly mode; training.skip_nonfinite_steps stops a run at the "
        "first inf/nan gradient norm when set to 0"
    ),
    "debug.batch_invariant": _refuse(
        "titan has no batch-invariant kernels (torchtitan refuses them in pretraining too)"
    ),
    "override.imports": _refuse(
        "titan swaps no components at run time: a model of your own registers under the "
        "titan.models entry-point group",
        list,
        inert=([], ""),
    ),
}
"""Every torchtitan key that is not also a titan key with the same meaning, by
``section.key`` (``section.*``: every key of that table)."""

TORCHTITAN_DEFAULTS: Mapping[str, Any] = {
    "checkpoint.enable": False,
    "checkpoint.interval": 500,
    "checkpoint.last_save_model_only": True,
    "lr_scheduler.warmup_steps": 200,
    "training.steps": 10000,
    "training.seq_len": 2048,
    "metrics.enable_tensorboard": False,
    "metrics.tensorboard_names": "torchtitan",
    "parallelize.activation_checkpoint.mode": "selective",
    "parallelize.param_dtype": "bfloat16",
    "validation.seq_len": 2048,
    "fault_tolerance.process_group": "gloo",
}
"""torchtitan's defaults (July 2025) where titan-train's differ, by titan key, for a file
read as torchtitan's. Not carried over: paths of torchtitan's repository (dump folder,
tokenizer, datasets) and ``training.seed`` (torchtitan: unset, titan: 0)."""


def check_supported(model_converters: Sequence[str] | None, param_dtype: str) -> None:
    """Raise ``ConfigError`` for torchtitan's model converters (float8/MX), after loading, as
    torchtitan refuses them when the model is built, not when the file is read."""
    if not model_converters:
        return
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    raise ConfigError(
        f"model.converters = {list(model_converters)!r} asks for torchtitan's float8/MX "
        f"training (torchao's Float8Linear, MXLinear); titan has none, on this device "
        f"({device}) or any other. Remove model.converters (or pass --model.converters=) to "
        f"train in the precision of parallelize.param_dtype ({param_dtype})."
    )


def lookup(path: str) -> Key | None:
    """The table entry of a torchtitan ``section.key`` (or of its whole table), if any."""
    if path in KEYS:
        return KEYS[path]
    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        key = KEYS.get(".".join(parts[:end]) + ".*")
        if key is not None:
            return key
    return None


@dataclass
class Translation:
    """A config dict in titan's keys, and what the translation did."""

    values: dict[str, Any]
    """Nested titan sections, ready for the config loader."""
    moved: dict[str, str]
    """torchtitan key -> titan key."""
    ignored: dict[str, str]
    """torchtitan key accepted as a no-op -> why it changes nothing."""
    defaults: dict[str, Any]
    """torchtitan defaults applied (titan key -> value)."""
    evidence: list[str]
    """The torchtitan keys of the file that make it torchtitan's; empty for a titan file."""
    batch: dict[str, Any] = field(default_factory=dict)
    """torchtitan's token-counted batch keys (action ``batch``) -> value, the command line's
    over the file's: for ``torchtitan_head.resolve_batch`` once the config is loaded."""

    def log(self, source: str, *, only: Collection[str] | None = None) -> None:
        """Say once, in the log, what was translated, ignored and defaulted; ``only``: just the
        moved and ignored keys it names (the command line's, after a named configuration)."""
        if only is not None:
            keep = set(only)
            moved = {k: v for k, v in self.moved.items() if k in keep}
            ignored = {k: v for k, v in self.ignored.items() if k in keep}
            dataclasses.replace(self, evidence=[], moved=moved, ignored=ignored).log(source)
            return
        if self.evidence:
            applied = ", ".join(f"{k} = {_show(v)}" for k, v in self.defaults.items())
            more = ", ..." if len(self.evidence) > 3 else ""
            logger.info(
                "%s is read as a torchtitan config (it uses %s%s): where it sets nothing, "
                "torchtitan's defaults apply%s",
                source,
                ", ".join(self.evidence[:3]),
                more,
                f": {applied}" if applied else " (it sets every one that differs from titan's)",
            )
        if self.moved:
            names = ", ".join(
                f"{a} is {b}" + (" (negated)" if lookup(a).negate else "")  # type: ignore[union-attr]
                for a, b in self.moved.items()
            )
            logger.info("torchtitan keys under their titan names: %s", names)
        if self.ignored:
            by_reason: dict[str, list[str]] = {}
            for name, why in self.ignored.items():
                by_reason.setdefault(why, []).append(name)
            names = "; ".join(f"{', '.join(keys)} ({why})" for why, keys in by_reason.items())
            logger.info("torchtitan keys with no effect in titan, ignored: %s", names)


def translate(
    file_values: Mapping[str, Any],
    cli_values: Mapping[str, Any] | None = None,
    *,
    source: str = "the command line",
    defaults: Mapping[str, Any] = TORCHTITAN_DEFAULTS,
) -> Translation:
    """A TOML dict and torchtitan command-line keys (``cli_values`` win) in titan's keys; a file
    using any key of ``KEYS`` gets ``defaults`` where neither sets the key."""
    moved: dict[str, str] = {}
    ignored: dict[str, str] = {}
    batch: dict[str, Any] = {}
    from_file = _translate_flat(flatten(file_values), source, moved, ignored, batch)
    from_cli = _translate_flat(
        flatten(cli_values or {}), "the command line", moved, ignored, batch, base=from_file
    )
    flat = {**from_file, **from_cli}
    evidence = [path for path in flatten(file_values) if lookup(path) is not None]
    applied = {k: v for k, v in defaults.items() if evidence and k not in flat}
    return Translation(
        values=unflatten({**applied, **flat}),
        moved=moved,
        ignored=ignored,
        defaults=applied,
        evidence=evidence,
        batch=batch,
    )


def _translate_flat(
    flat: Mapping[str, Any],
    source: str,
    moved: dict[str, str],
    ignored: dict[str, str],
    batch: dict[str, Any],
    *,
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for path, value in flat.items():
        key = lookup(path)
        if key is None and value == {} and any(k.startswith(f"{path}.") for k in KEYS):
            continue  # an empty torchtitan-only table, e.g. [float8] with every key commented
        if key is None:
            _put(out, origin, path, value, path, source)
        elif key.action == "noop" or (key.action == "refuse" and value in key.inert):
            ignored[path] = key.why if key.action == "noop" else f"{_show(value)} asks for nothing"
        elif key.action == "refuse":
            raise ConfigError(
                f"{source}: torchtitan's {path} = {_show(value)} cannot be honoured: {key.why}."
            )
        elif key.action == "batch":
            batch[path] = value
        else:
            value = _moved_value(key, value, out, base)
            _put(out, origin, key.to, value, path, source)
            moved[path] = key.to
    return out


def _moved_value(
    key: Key, value: Any, out: Mapping[str, Any], base: Mapping[str, Any] | None
) -> Any:
    if key.convert is not None:
        value = key.convert(value)
    if key.negate and isinstance(value, bool):
        value = not value
    if key.index is None:
        return value
    # One element of a titan list (beta1 -> betas[0]): the other elements as set so far.
    current = out.get(key.to, (base or {}).get(key.to, OptimizerConfig().betas))
    items = list(current)
    items[key.index] = value
    return items


def _put(
    out: dict[str, Any], origin: dict[str, str], path: str, value: Any, came_from: str, source: str
) -> None:
    seen = origin.get(path)
    if seen is not None and out[path] != value and not _same_list(seen, came_from):
        # e.g. model.tokenizer_path and model.hf_assets_path both given, disagreeing.
        raise ConfigError(
            f"{source}: {seen} = {_show(out[path])} and {came_from} = {_show(value)} both set "
            f"titan's {path}; keep one of them."
        )
    out[path] = value
    origin[path] = came_from


def _same_list(a: str, b: str) -> bool:
    """Whether keys ``a`` and ``b`` set different elements of one titan list (beta1, beta2)."""
    key_a, key_b = lookup(a), lookup(b)
    return bool(key_a and key_b and key_a.index is not None and key_b.index is not None)


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}`` (an empty table stays a leaf)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` as ``{"a": {"b": 1}}``."""
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        node = nested
        *parents, last = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)
