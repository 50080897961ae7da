"""The settings of a parallelize plan that are not parallel degrees (those are
``titan_dims.ParallelDims``): activation checkpointing, compile, FSDP policies, loss parallel,
the context-parallel attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_models.errors import ModelConfigError, check_bool, check_choice, check_int

__all__ = [
    "AC_MODES",
    "CP_ATTENTIONS",
    "CP_ROTATE_METHODS",
    "DTYPES",
    "SCHEDULES",
    "ActivationCheckpointConfig",
    "ParallelizeConfig",
    "PipelineConfig",
]

AC_MODES = ("none", "full", "selective")
DTYPES = ("auto", "float32", "bfloat16")
"""Compute and reduction dtypes. No float16: its narrow range needs a gradient scaler, which
titan does not have (bf16 has fp32's range), so an fp16 run would underflow silently."""
_RESHARD = ("default", "always", "never")
CP_ATTENTIONS = ("auto", "titan", "titan_ring", "torch")
CP_ROTATE_METHODS = ("allgather", "alltoall")


@dataclass(kw_only=True)
class ActivationCheckpointConfig:
    """Which activations each block keeps for backward, and which it recomputes."""

    mode: str = "none"
    """``none`` keeps everything; ``full`` recomputes whole blocks; ``selective`` follows
    ``selective_option``."""
    selective_option: str = "2"
    """With mode ``selective``: a whole number N recomputes every N-th block fully; ``op``
    keeps the outputs of attention and of every other matmul in all blocks and recomputes
    the rest (cheap elementwise ops)."""

    def __post_init__(self) -> None:
        check_choice("activation_checkpoint.mode", self.mode, AC_MODES)
        option = self.selective_option
        if option != "op" and not (isinstance(option, str) and option.isdigit() and int(option)):
            raise ModelConfigError(
                f"activation_checkpoint.selective_option={option!r} is not allowed; use 'op' "
                "or a whole number N >= 1 as a string ('2': every second block)."
            )

    @property
    def every_n_blocks(self) -> int | None:
        """For block-level checkpointing, checkpoint every N-th block; ``None`` for op-level
        or no checkpointing."""
        if self.mode == "full":
            return 1
        if self.mode == "selective" and self.selective_option != "op":
            return int(self.selective_option)
        return None


@dataclass(kw_only=True)
class ParallelizeConfig:
    """How to parallelize a model beyond the degrees in ``ParallelDims``. The defaults work
    on any device: nothing compiled, no activation checkpointing, fp32 where bf16 is slow."""

    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    """Activation checkpointing of the transformer blocks."""
    compile: bool = False
    """``torch.compile`` each transformer block (fullgraph), after TP and AC, before FSDP."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend when ``compile`` is on."""
    param_dtype: str = "auto"
    """The compute dtype: ``auto`` is bfloat16 on accelerators and on CPUs with bf16
    instructions (AVX512-BF16 or AMX), float32 elsewhere (bf16 runs hundreds of times slower
    there). With FSDP/HSDP it is FSDP's parameter dtype; without (one device, DDP, TP, PP) the
    step runs under ``torch.autocast`` to it, except on a CPU without bf16 instructions,
    which stays fp32. Parameters, gradients and optimizer state stay
    fp32 either way."""
    reduce_dtype: str = "float32"
    """FSDP's dtype for gradient reduction."""
    reshard_after_forward: str = "default"
    """FSDP: ``always`` frees gathered parameters after each block's forward (least memory),
    ``never`` keeps them until backward (fewer all-gathers); ``default`` is ``always``
    except with pipeline parallel, where many microbatches reuse them."""
    cpu_offload: bool = False
    """FSDP: keep sharded parameters, gradients and optimizer state in CPU memory."""
    loss_parallel: bool = True
    """With tensor parallel, leave the logits sharded over the vocabulary (a DTensor), so the
    loss is computed under ``torch.distributed.tensor.parallel.loss_parallel()`` without
    gathering the full logits; ``False`` returns replicated plain logits."""
    cp_attention: str = "auto"
    """Context parallel's attention: ``titan`` all-gathers keys and values and runs on any
    device; ``titan_ring`` passes them around a ring instead (same results, K/V memory of
    2/cp of the sequence, cp sequential exchanges); ``torch`` is torch's
    ``context_parallel`` (ring attention on the flash/efficient SDPA kernels, CUDA only);
    ``auto`` is ``torch`` on CUDA and ``titan`` elsewhere. Whichever, run each training step
    inside ``context_parallel_batch``."""
    cp_rotate_method: str = "allgather"
    """With ``cp_attention`` torch: how key/value shards reach the other ranks, ``allgather``
    or ``alltoall`` (torch's ``set_rotate_method``)."""

    def __post_init__(self) -> None:
        if isinstance(self.activation_checkpoint, dict):
            self.activation_checkpoint = ActivationCheckpointConfig(**self.activation_checkpoint)
        if "float16" in (self.param_dtype, self.reduce_dtype):
            name = "param_dtype" if self.param_dtype == "float16" else "reduce_dtype"
            raise ModelConfigError(
                f"{name}='float16' is not allowed: fp16 needs a gradient scaler against "
                "underflow, which titan does not have; use 'bfloat16' (same speed on GPUs with "
                "bf16, fp32's range) or 'float32'."
            )
        check_choice("param_dtype", self.param_dtype, DTYPES)
        check_choice("reduce_dtype", self.reduce_dtype, DTYPES[1:])
        check_choice("reshard_after_forward", self.reshard_after_forward, _RESHARD)
        check_choice("cp_attention", self.cp_attention, CP_ATTENTIONS)
        check_choice("cp_rotate_method", self.cp_rotate_method, CP_ROTATE_METHODS)
        # Kept for Python callers (the README builds this directly): a string "false" would
        # otherwise switch the feature on.
        for name in ("compile", "cpu_offload", "loss_parallel"):
            check_bool(name, getattr(self, name))


SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "CSV",
)
"""Pipeline schedules by name. Interleaved ones run several stages per rank (looped
placement), ZBVZeroBubble runs two per rank in a V; ``CSV`` reads the action order of every
rank from ``PipelineConfig.schedule_csv``."""
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")


@dataclass(kw_only=True)
class PipelineConfig:
    """How a model is split into pipeline stages and scheduled (the degree is
    ``ParallelDims.pp``)."""

    schedule: str = "1F1B"
    """GPipe, 1F1B (one stage per rank); Interleaved1F1B, InterleavedZeroBubble (several,
    looped), ZBVZeroBubble (two, V-shaped); CSV (the order in schedule_csv)."""
    schedule_csv: str | None = None
    """With schedule CSV: a file with one row of actions per rank, as torch's
    ``_PipelineScheduleRuntime`` reads it (e.g. written by ``_dump_csv``)."""
    microbatch_size: int = 1
    """Sequences per microbatch; the local batch size must be a multiple of it."""
    layers_per_stage: int | None = None
    """Transformer blocks per stage; the stage count is n_layers / layers_per_stage. Default:
    one stage per rank (two for the multi-stage schedules), layers split evenly."""
    split_points: list[str] = field(default_factory=list)
    """Explicit stage boundaries as the first block of each stage after the first, e.g.
    ``["layers.4", "layers.8"]`` for three stages (torchtitan's spelling)."""

    def __post_init__(self) -> None:
        check_choice("pipeline.schedule", self.schedule, SCHEDULES)
        if (self.schedule == "CSV") != (self.schedule_csv is not None):
            raise ModelConfigError(
                f"pipeline.schedule={self.schedule!r} with schedule_csv={self.schedule_csv!r}: "
                "schedule_csv must be given exactly when schedule is 'CSV'."
            )
        check_int("pipeline.microbatch_size", self.microbatch_size, minimum=1)
        if self.layers_per_stage is not None and self.split_points:
            raise ModelConfigError(
                "Give pipeline.layers_per_stage or pipeline.split_points, not both "
                f"(got {self.layers_per_stage} and {self.split_points})."
            )
        if self.layers_per_stage is not None:
            check_int("pipeline.layers_per_stage", self.layers_per_stage, minimum=1)
        for point in self.split_points:
            if not (isinstance(point, str) and point.startswith("layers.") and point[7:].isdigit()):
                raise ModelConfigError(
                    f"pipeline.split_points entry {point!r} must name a block, like 'layers.4'."
                )

    @property
    def multi_stage(self) -> bool:
        """Whether the schedule runs more than one stage per rank."""
        return self.schedule not in SINGLE_STAGE_SCHEDULES
