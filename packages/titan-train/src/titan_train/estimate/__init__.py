"""``estimate_memory(config, world_size=..., rank=...)``: one rank's memory for a training run
of any layout and world size, measured in this process without allocating it.

The run is built as ``titan-train`` builds it (``preflight``'s checks and errors, then
``titan_train.trainer.build``'s model path, parallelized on a fake process group of
``world_size`` ranks seen from ``rank``), allocated as fake tensors, its optimizer state made
by one update on zero gradients, and one whole step run under torch's ``MemTracker``:
``parameters``, ``buffers``, ``gradients``, ``optimizer_state`` (kept between steps),
``activations`` (the most the forward's tensors held at once) and ``peak`` (all together).
Pipeline stages replay this rank's actions of the real schedule
(``titan_train.estimate.pipeline``): its runtime exchanges metadata with other ranks.

Fake tensors have no values: an MoE's routing is taken as balanced (equal tokens per expert
and per expert-parallel rank, what load balancing trains toward; the note says so). A model
sizing other tensors from tensor values keeps an exact resident state, ``step_simulated``
False. DDP runs as one replica (its reducer needs real
storage) plus the reducer's buckets. What runs out (``titan_train.estimate.host``):
``peak_resident`` on the CPU (``peak`` plus glibc's retention, gloo's buffers and the
runtime's heap) and ``peak_reserved`` on an accelerator (a model of the CUDA caching
allocator, untested on a GPU; add the CUDA context and NCCL's buffers).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _UpdateType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from titan_dims.simulate import fake_process_group
from titan_models.decoder import Decoder
from titan_models.moe import moe_layers
from titan_optim import build_optimizers
from titan_optim.clip import global_grad_norm
from titan_train.config import JobConfig
from titan_train.errors import ConfigError
from titan_train.estimate.host import (
    FSDP_FRAGMENTATION,
    GLOO_THREADS,
    RUNTIME_HEAP,
    GlooBlock,
    cuda_reserved_peak,
    glibc_high_water,
    gloo_buffers,
    two_steps,
)
from titan_train.estimate.pipeline import replay_pipeline_step
from titan_train.preflight import Plan, World, preflight
from titan_train.trainer.build import _build_model  # training's own model path, never another
from titan_train.trainer.step import batch_loss, cross_entropy_sum

__all__ = ["MemoryEstimate", "check_estimable", "estimate_memory"]

logger = logging.getLogger("titan_train")

_TOTAL = "Total"


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """One rank's memory for one training step of a run (bytes), and what it was built as."""

    model: str
    flavor: str
    world_size: int
    rank: int
    layout: dict[str, int]
    """The parallel degrees: dp_replicate, dp_shard, cp, tp, pp, ep."""
    activation_checkpoint: str
    local_batch_size: int
    seq_len: int
    param_dtype: str
    """The dtype FSDP computes in (mixed precision); parameters are kept in float32."""
    num_params: int
    """The whole model's parameters."""
    rank_params: int
    """Parameters this rank holds (its shards, its pipeline stages)."""
    pipeline_stages: list[int] | None
    """The pipeline stages this rank runs (of ``num_stages``); ``None`` without PP."""
    num_stages: int | None
    pipeline_microbatches: int | None
    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    activations: int
    peak: int
    host_overhead: int = 0
    """On the CPU, beyond ``peak``: glibc's retention over the first two steps (gloo's
    buffers included), ``fragmentation`` and the runtime's own heap
    (``titan_train.estimate.host``)."""
    fragmentation: int = 0
    """On the CPU, where this rank shards parameters with FSDP: a measured share of the
    replayed heap for the blocks the runtime's small allocations keep from reuse
    (``titan_train.estimate.host.FSDP_FRAGMENTATION``); part of ``host_overhead``."""
    peak_resident: int = 0
    """On the CPU, what runs out: ``peak`` plus ``host_overhead``, the growth from just
    before the model is built (shared libraries and torch's import not included)."""
    peak_reserved: int = 0
    """On an accelerator, what runs out: a model of the CUDA caching allocator's reserved
    peak (untested on a GPU; without the CUDA context and NCCL's buffers)."""
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    """What was live at the peak, by kind (torch's MemTracker categories)."""
    step_simulated: bool = True
    """Whether a whole training step ran (``False``: see ``note``)."""
    note: str | None = None
    """What the estimate could not simulate, and what its numbers then mean."""
    seconds: float = 0.0
    """How long the estimate took."""

    def to_json(self) -> dict[str, Any]:
        """A JSON object: these fields, bytes as integers."""
        return dataclasses.asdict(self)


def check_estimable(config: JobConfig) -> None:
    """Raise ``ConfigError`` for what an estimate cannot simulate, before any work."""
    refusals = {
        "fault_tolerance.enable=true": config.fault_tolerance.enable,
        "parallelize.cpu_offload=true": config.parallelize.cpu_offload,
        "optimizer.early_step_in_backward=true": config.optimizer.early_step_in_backward,
    }
    named = [name for name, on in refusals.items() if on]
    if named:
        raise ConfigError(
            f"titan-train estimate cannot simulate {', '.join(named)} (a torchft replica "
            "group needs its lighthouse; offloaded and in-backward state live outside the "
            "step it replays); estimate without it (set it to false): the layout's memory "
            "is the same on the device."
        )


def _one_replica(config: JobConfig, plan: Plan) -> tuple[JobConfig, int, int, int]:
    """For DDP (replicas, no sharding), whose reducer needs real storage: one replica's
    config, world size and rank, and the number of replicas; else unchanged, with 1."""
    dims, world = plan.parallel_dims, plan.world
    if dims.dp_replicate <= 1 or dims.fsdp_enabled:
        return config, world.world_size, world.rank, 1
    coordinates = dims.layout.coordinates(world.rank)
    sizes = dict(zip(dims.layout.dim_names, dims.layout.dim_sizes, strict=True))
    rank = 0
    for name in dims.layout.dim_names:  # the rank in the layout without dp_replicate
        if name != "dp_replicate":
            rank = rank * sizes[name] + coordinates[name]
    training, parallelism = config.training, config.parallelism
    global_batch = training.global_batch_size
    if global_batch > 0:
        global_batch //= dims.dp_replicate
    config = dataclasses.replace(
        config,
        parallelism=dataclasses.replace(parallelism, data_parallel_replicate_degree=1),
        training=dataclasses.replace(training, global_batch_size=global_batch),
    )
    return config, world.world_size // dims.dp_replicate, rank, dims.dp_replicate


def estimate_memory(
    config: JobConfig,
    *,
    world_size: int,
    rank: int = 0,
    vocab_size: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> MemoryEstimate:
    """Estimate the memory of ``rank`` in a ``world_size``-rank run of ``config``; raises
    ``preflight``'s and ``check_estimable``'s errors before any model is built.
    ``vocab_size`` overrides the tokenizer's (128256: Llama 3's, without its file);
    ``progress`` is told each phase as it starts."""
    say = progress or (lambda text: None)
    started = time.perf_counter()
    if world_size < 1:
        raise ConfigError(f"--world-size={world_size} is not allowed; it must be >= 1.")
    check_estimable(config)
    # Checkpoints, compilation and profiling do not change a step's memory on the device
    # (compile lowers it a little): the estimate is of the eager step.
    config = dataclasses.replace(
        config,
        checkpoint=dataclasses.replace(config.checkpoint, enable=False, initial_load_path=None),
        parallelize=dataclasses.replace(config.parallelize, compile=False),
        # Estimating a run that cannot fit on this host is the point: no refusal here.
        training=dataclasses.replace(config.training, memory_check=False),
    )
    world = World(rank=rank, world_size=world_size, device=torch.device("cpu"))
    say(f"checking the configuration for rank {rank} of {world_size}")
    with fake_process_group(world_size, rank), _quiet_logs():
        plan = preflight(config, world)  # the real run's checks, on its own layout
    layout = _degrees(plan)
    inner, inner_world, inner_rank, replicas = _one_replica(config, plan)
    with fake_process_group(inner_world, inner_rank), _quiet_logs():
        if replicas > 1:
            config = inner
            plan = preflight(config, World(inner_rank, inner_world, torch.device("cpu")))
        vocab = vocab_size if vocab_size is not None else _tokenizer_vocab(config)
        say(f"building {plan.spec.name} {config.model.flavor} on the meta device")
        args, parts, pipeline = _build_model(
            config, plan, vocab, False, cross_entropy_sum, materialize=False
        )
        say("simulating one training step on fake tensors")
        with FakeTensorMode(allow_non_fake_inputs=True):
            measured = _measure(config, plan, parts, pipeline, vocab, dim=int(args.dim))
    heap, reserved = measured.pop("heap"), measured.pop("reserved")
    if replicas > 1:
        # DDP's reducer copies every gradient into flat buckets it keeps allocated, on top of
        # the gradients themselves (gradient_as_bucket_view is off): count them at the peak.
        buckets = measured["gradients"]
        measured["peak"] += buckets
        # Allocated once, before the first step, and kept.
        heap = None if heap is None else heap + buckets
        reserved += -(-buckets // (2 << 20)) * (2 << 20)
        measured["peak_breakdown"] = {
            **measured["peak_breakdown"],
            "DDP buckets": buckets,
            _TOTAL: measured["peak_breakdown"].get(_TOTAL, 0) + buckets,
        }
        ddp = f"DDP over {replicas} replicas: one simulated, plus the reducer's gradient buckets."
        measured["note"] = f"{measured['note']} {ddp}" if measured.get("note") else ddp
    fragmentation = 0
    if heap is None:  # not glibc: the runtime's heap alone
        heap = measured["peak"]
        note = "The host allocator's retention was not modelled (not glibc)."
        measured["note"] = f"{measured['note']} {note}" if measured.get("note") else note
    elif layout["dp_shard"] > 1:
        fragmentation = int(heap * FSDP_FRAGMENTATION)
    host_overhead = max(heap - measured["peak"], 0) + RUNTIME_HEAP + fragmentation
    return MemoryEstimate(
        host_overhead=host_overhead,
        fragmentation=fragmentation,
        peak_resident=measured["peak"] + host_overhead,
        peak_reserved=max(reserved, measured["peak"]),
        model=plan.spec.name,
        flavor=config.model.flavor,
        world_size=world_size,
        rank=rank,
        layout=layout,
        activation_checkpoint=config.parallelize.activation_checkpoint.mode,
        local_batch_size=plan.batches.local_batch_size,
        seq_len=config.training.seq_len,
        param_dtype=str(measured.pop("param_dtype")),
        num_params=int(args.num_params()),
        pipeline_stages=None if pipeline is None else list(pipeline.stage_ids),
        num_stages=None if pipeline is None else pipeline.schedule._num_stages,
        pipeline_microbatches=plan.pipeline_microbatches,
        seconds=round(time.perf_counter() - started, 3),
        **measured,
    )


def _degrees(plan: Plan) -> dict[str, int]:
    dims = plan.parallel_dims
    names = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
    return {name: int(getattr(dims, name)) for name in names}


def _tokenizer_vocab(config: JobConfig) -> int:
    from titan_train.tokenizer import load_tokenizer
    from titan_train.trainer.hf_start import run_vocab_size

    return run_vocab_size(config, load_tokenizer(config.model.tokenizer_path).vocab_size)


@contextmanager
def _quiet_logs() -> Iterator[None]:
    """The build's INFO lines describe a run that does not happen, and DTensor's advice is about
    torch's collectives: keep our warnings and DTensor's errors."""
    levels = {logger: logging.WARNING, _REDISTRIBUTE_LOGGER: logging.ERROR}
    saved = {log: log.level for log in levels}
    for log, level in levels.items():
        log.setLevel(level)
    try:
        yield
    finally:
        for log, level in saved.items():
            log.setLevel(level)


_REDISTRIBUTE_LOGGER = logging.getLogger("torch.distributed.tensor._redistribute")


class _Tracker(MemTracker):
    """torch's MemTracker, keeping the activations' maximum, blind to DTensor's sharding
    propagation (its ops on fake *global* shapes would count as this rank's memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.max_activations = 0
        self._propagating = 0
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._saved_lock: Any = None
        self.events: list[tuple[int, int]] = []
        """Every tracked storage's allocation ``(key, bytes)``, resize and free ``(key, 0)``,
        in order (``titan_train.estimate.host`` replays them on a heap)."""
        self._keys = 0
        self._gloo_calls: dict[str, int] = {}  # collectives per process group so far

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):  # type: ignore[no-untyped-def]
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if u_type == _UpdateType.ADD:
            self._keys += 1
            winfo.trace_key = self._keys
            self.events.append((self._keys, winfo.mem_consumed))
        elif u_type in (_UpdateType.DEL, _UpdateType.SIZE):
            key = getattr(winfo, "trace_key", None)
            if key is not None:
                self.events.append((key, 0 if u_type == _UpdateType.DEL else winfo.mem_consumed))

    def __enter__(self) -> _Tracker:
        # DTensor enters ``ShardingPropagator._fake_mode_lock`` (a replaceable context
        # manager, a no-op by default) around exactly the propagation's ops.
        self._saved_lock = ShardingPropagator._fake_mode_lock
        ShardingPropagator._fake_mode_lock = _Counting(self)
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        ShardingPropagator._fake_mode_lock = self._saved_lock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self._propagating:
            return func(*args, **(kwargs or {}))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        group, in_worker, in_caller = gloo_buffers(func, args)
        if in_worker or in_caller:
            # gloo's own blocks, allocated and freed within the call (host.gloo_buffers):
            # the worker's from one of its group's threads in turn, the caller's from ours.
            calls = self._gloo_calls.setdefault(group, 0)
            self._gloo_calls[group] = calls + 1
            groups = list(self._gloo_calls).index(group)
            worker = 1 + groups * GLOO_THREADS + calls % GLOO_THREADS
            for thread, nbytes in ((worker, in_worker), (0, in_caller)):
                if nbytes:
                    self._keys += 1
                    key = GlooBlock(thread, self._keys)
                    self.events += [(key, nbytes), (key, 0)]
        return out

    # The plain tracker's per-module snapshots are slow on an 80-block model and refuse a
    # module's second forward (microbatches): keep only a module's parameters and grad
    # hooks on its first run, and AC's recomputation region (a forward during backward).

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if module not in self._seen:
            self._seen.add(module)
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
        elif self._mod_tracker.is_bw and self._ac_mod is None:
            self._ac_mod = weakref.ref(module)
            self._in_ac = True

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        if self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod = None
            self._in_ac = False

    def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
        pass

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        pass

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snap in self._curr_mem_snap.items():
            self.max_activations = max(self.max_activations, snap.get(_MemRefType.ACT, 0))
            if self._peak_mem.get(device, 0) < snap[_TOTAL]:
                self._peak_mem[device] = snap[_TOTAL]
                self._peak_mem_snap[device] = dict(snap)


class _Counting:
    """A context manager counting, on the tracker, that DTensor propagation is under way."""

    def __init__(self, tracker: _Tracker) -> None:
        self._tracker = tracker

    def __enter__(self) -> None:
        self._tracker._propagating += 1

    def __exit__(self, *args: Any) -> None:
        self._tracker._propagating -= 1


def _measure(
    config: JobConfig,
    plan: Plan,
    parts: list[nn.Module],
    pipeline: Any,
    vocab: int,
    *,
    dim: int,
) -> dict[str, Any]:
    """Allocate ``parts`` (fake), build the optimizers and run two steps under the tracker."""
    cpu = torch.device("cpu")
    for part in parts:
        part.to_empty(device=cpu)  # fake storages; the weights' values do not change memory
        part.train()
    dims = plan.parallel_dims
    optimizers: Any = build_optimizers(parts, config.optimizer, pipeline_parallel=dims.pp_enabled)
    tracker = _Tracker()
    tracker.track_external(*parts)
    batch = plan.batches.local_batch_size
    steps = plan.batches.accumulation_steps
    seq_len = config.training.seq_len
    with tracker:
        # The build's buffer init after the storages, as the build runs it: the RoPE table's
        # float64 temporaries leave holes among the resident blocks (the weights' init on
        # fake sharded tensors would need their values).
        for part in parts:
            if isinstance(part, Decoder):
                part.init_buffers(cpu)
        marks = [len(tracker.events)]  # where the recording's phases start (host.two_steps)
        # The optimizer state exists from the first step on: one update on zero gradients
        # makes it cheaply, then one whole step is measured.
        for param in (p for part in parts for p in part.parameters()):
            param.grad = torch.zeros_like(param)
        marks.append(len(tracker.events))
        optimizers.step()
        marks.append(len(tracker.events))
        optimizers.zero_grad()
        marks.append(len(tracker.events))
        tracker.max_activations = 0  # the zero gradients were made outside any module
        tokens = torch.randint(0, vocab, (batch * steps, seq_len), device=cpu)
        step_note = None
        primed_peak = dict(next(iter(tracker.get_tracker_snapshot("peak").values()), {}))
        try:
            _step(config, plan, parts, pipeline, tokens, steps=steps, dim=dim)
        except DataDependentOutputException as error:
            # A model sizing buffers from token values (MoE) cannot run on fake tensors: the
            # resident state is still exact, the step's activations unknown.
            step_note = (
                f"{plan.spec.name} decides tensor sizes from tensor values ({error.func}), "
                "which fake tensors have not: parameters, gradients and optimizer state are "
                "exact; activations and the step's peak were not simulated (the peak shown "
                "is the optimizer update's)"
            )
            tracker.max_activations = 0  # a partial forward's: not a number to report
            # The forward stopped with FSDP's parameters gathered: shard them again, so the
            # rank's state below is the one a run keeps between steps.
            for part in parts:
                for module in part.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()
            tracker._peak_mem_snap = {cpu: primed_peak}
            tracker._peak_mem = {cpu: primed_peak.get(_TOTAL, 0)}
            for param in (p for part in parts for p in part.parameters()):
                param.grad = torch.zeros_like(param)  # what the backward would have left
        # The gradients of the last step are still there, as between steps of a real run.
        resident = _resident(parts, optimizers)
    events = tracker.events
    step_events = events[marks[3] :] if step_note is None else []
    order = two_steps(events[: marks[0]], events[marks[1] : marks[2]], step_events)
    peak_snap = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    if step_note is None and any(moe_layers(part) for part in parts):
        step_note = (
            "The experts' routing was taken as balanced (equal tokens per expert and per "
            "expert-parallel rank); a skewed routing holds more at once."
        )
        simulated = True
    else:
        simulated = step_note is None
    return {
        **resident,
        "activations": tracker.max_activations,
        "step_simulated": simulated,
        "note": step_note,
        "peak": int(peak_snap.get(_TOTAL, 0)),
        "peak_breakdown": {getattr(k, "value", str(k)): int(v) for k, v in peak_snap.items()},
        "param_dtype": _compute_dtype(parts),
        "heap": glibc_high_water(order),
        "reserved": cuda_reserved_peak(order),
    }


def _step(
    config: JobConfig,
    plan: Plan,
    parts: list[nn.Module],
    pipeline: Any,
    tokens: torch.Tensor,
    *,
    steps: int,
    dim: int,
) -> None:
    """One step's forwards and backwards over ``tokens`` (``steps`` accumulation steps) and
    the clip's norm, as ``titan_train.trainer.step`` runs them."""
    if pipeline is not None:
        dtype = getattr(torch, _compute_dtype(parts))
        replay_pipeline_step(pipeline, plan, tokens, tokens.clone(), dim=dim, dtype=dtype)
    else:
        for micro in tokens.chunk(steps):
            context = plan.step_context
            # The step scales each summed loss by dp x cp / the trained tokens (counted
            # with one all-reduce, left out here): every token of these.
            batch_loss(parts, None, context, micro, micro.clone(), scale=1.0 / tokens.numel())
    if config.training.max_norm > 0:
        _grad_norm(parts, plan.parallel_dims)


def _grad_norm(parts: list[nn.Module], dims: Any) -> None:
    """The clip's global norm as a real step computes it (its finiteness check and in-place
    scaling left out); a function so that the gradients' list does not outlive ``zero_grad``."""
    pp_mesh = dims.get_mesh("pp") if dims.pp_enabled else None
    grads = [p.grad for part in parts for p in part.parameters() if p.grad is not None]
    global_grad_norm(grads, pp_group=pp_mesh)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def _resident(parts: list[nn.Module], optimizers: Any) -> dict[str, int]:
    """What this rank keeps between steps: its parameter shards, buffers, gradients and
    optimizer state (each storage once)."""
    params = [p for part in parts for p in part.parameters()]
    state = [
        value
        for optimizer in optimizers.optimizers
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    return {
        "rank_params": sum(_local(p).numel() for p in params),
        "parameters": sum(_nbytes(p) for p in params),
        "buffers": sum(_nbytes(b) for part in parts for b in part.buffers()),
        "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state": sum(_nbytes(v) for v in state),
    }


def _compute_dtype(parts: list[nn.Module]) -> str:
    """The dtype the blocks compute in: FSDP's mixed-precision parameter dtype, if set."""
    for part in parts:
        for module in part.modules():
            state = getattr(module, "_get_fsdp_state", None)
            if state is None:
                continue
            try:
                policy = state()._mp_policy
            except (AttributeError, AssertionError):
                continue
            if policy.param_dtype is not None:
                return str(policy.param_dtype).removeprefix("torch.")
    params = next(iter(parts[0].parameters()), None)
    return "float32" if params is None else str(params.dtype).removeprefix("torch.")
