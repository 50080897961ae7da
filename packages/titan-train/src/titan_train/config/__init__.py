"""``JobConfig``: every setting of a training run, as TOML sections.

Each section is the config dataclass of the package that builds what it configures
(``parallelism`` is ``titan_dims.ParallelismConfig``...); the sections owned here describe
the job, the model, the training loop and communication. Names follow torchtitan's, and its
keys that live elsewhere here are translated, ignored or refused on load (``compat``).

Precedence: the command line > the ``--job.config_file`` TOML (which may ``extends`` a base)
> these defaults, which train the Llama 3 debug model on the embedded corpus.
"""

from __future__ import annotations

import dataclasses
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import tyro

from titan_ckpt import CheckpointConfig
from titan_dims import ParallelismConfig
from titan_models import ParallelizeConfig, PipelineConfig
from titan_optim import LRSchedulerConfig, OptimizerConfig
from titan_train import compat
from titan_train.compat import argv as compat_argv
from titan_train.compat import batch as compat_batch
from titan_train.config.loader import load_config, pop_options, to_dict
from titan_train.data import DataSource
from titan_train.data.config import SHARD_LAYOUTS, DatasetEntry, check_mixture
from titan_train.errors import ConfigError, check_duration, check_int, check_number
from titan_train.fault_tolerance import FaultToleranceConfig
from titan_train.metrics import MetricsConfig
from titan_train.trainer.profiling import ProfilingConfig
from titan_train.trainer.validation import ValidationConfig

__all__ = [
    "CheckpointSection",
    "CommConfig",
    "ConfigError",
    "JobConfig",
    "JobSection",
    "ModelSection",
    "TrainingConfig",
    "parse_job_config",
]


@dataclass(kw_only=True)
class JobSection:
    """The run itself: where its outputs go."""

    config_file: str | None = None
    """A TOML file to read first (it may name a base file with ``extends = "base.toml"``)."""
    dump_folder: str = "./outputs"
    """Folder for this run's checkpoints, TensorBoard files and metrics log."""
    description: str = "Llama 3 debug model on the embedded corpus"
    """A line describing the run, printed at start."""


@dataclass(kw_only=True)
class ModelSection:
    """Which model to train."""

    name: str = "llama3"
    """A model registered under the ``titan.models`` entry-point group (``titan-train
    list-models``)."""
    flavor: str = "debugmodel"
    """One of the model's flavors (sizes), e.g. debugmodel, 1B, 8B, 70B."""
    tokenizer_path: str | None = None
    """A tiktoken BPE file (Llama 3 ``tokenizer.model`` format) or a Hugging Face
    ``tokenizer.json``; empty means the small tokenizer shipped with titan-train."""
    rope_scaling: Literal["flavor", "none", "llama3"] = "flavor"
    """RoPE frequency scaling: the flavor's default, none (plain RoPE, as torchtitan's Llama 3
    of July 2025), or llama3 (Llama 3.1 scaling: the flavor's factors, else the defaults).
    Recorded with every checkpoint and written to the HF config.json."""
    load_balance_coeff: float | None = None
    """Mixture-of-experts models: the rate of the expert-bias balancing update (DeepSeek-V3's
    auxiliary-loss-free balancing); 0 turns the bias off; empty keeps the flavor's (1e-3 for
    DeepSeek-V3; off for Qwen3, whose published routing has no bias). A titan key."""
    aux_loss_alpha: float | None = None
    """Mixture-of-experts models: the weight of the sequence-wise auxiliary balance loss; 0
    turns it off; empty keeps the flavor's (0). A titan key."""
    converters: list[str] | None = None
    """torchtitan's model converters (float8, mx). titan has none: training stops at the start
    when any is named; the key exists so that torchtitan's files load and show what they ask."""
    args: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
    """The model's own arguments over the flavor's, for a size of your own: a ``[model.args]``
    table (``dim = 512``, ``n_layers = 4``...) or ``--model.args.KEY VALUE``; any field of the
    family's args dataclass (``titan-train list-models`` names the families) but
    ``rope_scaling`` (``model.rope_scaling``). ``vocab_size`` replaces the tokenizer's count
    (at least it); ``max_seq_len``, the RoPE table's length, at least the longest sequence.
    Checked before any work. A titan key."""

    def __post_init__(self) -> None:
        if not isinstance(self.args, Mapping) or not all(isinstance(k, str) for k in self.args):
            raise ConfigError(
                f"model.args={self.args!r} is not allowed; give a table of the model's "
                "arguments, e.g. [model.args] with dim = 512, or --model.args.dim 512."
            )
        self.args = dict(self.args)


@dataclass(kw_only=True)
class TrainingConfig(DataSource):
    """The training loop: data (``dataset``, ``dataset_path``, ``text_column``: a
    ``titan_train.data.DataSource``), batch sizes, steps, clipping, seeding."""

    local_batch_size: int = 8
    """Sequences per rank per forward/backward."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks; -1 means local_batch_size
    x the data-parallel degree. Larger values accumulate gradients."""
    seq_len: int = 512
    """Tokens per sequence."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this (0 turns clipping off)."""
    steps: int = 30
    """Optimizer steps to train for."""
    seed: int = 0
    """Seed of the weight initialization (equal on every rank)."""
    deterministic: bool = False
    """Use deterministic algorithms (slower; for bit-for-bit reproducibility checks)."""
    gc_freq: int = 50
    """Run Python's garbage collector every this many steps, and never in between."""
    data_shards: int = 64
    """Virtual data shards: document i goes to shard i mod data_shards, each shard is packed
    on its own, and global window g comes from shard g mod data_shards. The batches depend
    on it, not on the data-parallel degree; each rank reads and tokenizes 1/gcd(dp,
    data_shards) of the documents, and a checkpoint resumes at any dp. 1 is one stream
    every rank reads whole (the stream before data shards; resumes checkpoints written then). Not a
    torchtitan key."""
    data_shard_layout: Literal["interleaved", "contiguous"] = "interleaved"
    """How documents are dealt to the data shards: "interleaved" (document i to shard i mod
    data_shards: every file holds every rank's documents, so each rank reads all of the
    files' bytes) or "contiguous" (shard s is the s-th of data_shards contiguous runs of
    the corpus, by bytes for JSON lines and text, by rows for parquet, by whole files for
    what datasets streams: each rank reads only its shards' part of the files). Another
    stream: a checkpoint resumes only with the layout it was saved with. Not a torchtitan
    key."""
    memory_check: bool = True
    """Refuse, before anything is allocated, a run whose model state (fp32 weights, gradients
    and optimizer moments over the ranks that shard them) with each process's start-up memory
    cannot fit in what this host or device has free (``titan_train.trainer.memory_fit``: a floor;
    activations come on top). ``--training.no_memory_check`` starts it anyway. Not a
    torchtitan key."""
    data_prefetch: int = 2
    """Batches a background thread tokenizes ahead of the step (0: none). Not a torchtitan
    key."""
    datasets: list[DatasetEntry] = field(default_factory=list)
    """A weighted mixture instead of the one ``dataset``: ``[[training.datasets]]`` tables,
    each with the keys of a dataset (``dataset``, ``dataset_path``, ``text_column``...), a
    ``weight`` and an optional ``name``. Each training window comes from one source, drawn
    from a seeded stream (``training.seed``); see the README's "Dataset mixtures". TOML
    only (the command line can change an entry the file gives: --training.datasets.0.weight).
    Not a torchtitan key."""
    reuse_host_memory: bool = True
    """The ``titan-train`` command training on the CPU: keep freed host memory for reuse
    instead of returning it to the system each step (glibc's mmap and trim thresholds raised),
    and start with glibc's small-block caches off (``GLIBC_TUNABLES``
    ``glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0``, unless your environment sets
    them: the command starts itself again, in place, to apply it), so freed small objects
    do not keep freed tensor blocks apart (``titan_train.trainer.host_memory``). Saves the
    page faults of remapping every activation each step, and 2-28% of the host memory. A
    process-wide setting, so ``titan_train.run()`` called from your own program leaves your
    allocator alone (call ``titan_train.trainer.host_memory.reuse_host_memory()`` for it).
    No effect on accelerators or without glibc. Not a torchtitan key."""
    document_masking: bool = False
    """Packed windows whose attention never crosses a document boundary (block-causal): a
    document ends after each EOS token of the tokenizer. Not with context parallel. Not a
    torchtitan key."""
    document_positions: Literal["restart", "continue"] = "restart"
    """With document_masking: RoPE positions "restart" at 0 in each document, or "continue"
    across the window. Not a torchtitan key."""
    skip_nonfinite_steps: int = 10
    """Consecutive steps with an inf/nan gradient norm whose update is skipped (weights left
    as they were, one warning each) before the run stops with an error; 0 stops at the
    first. Skipped steps are counted in the metrics (skipped_steps). Needs max_norm > 0, as
    the norm is clipping's. Not a torchtitan key (torchtitan applies such updates)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("local_batch_size", "seq_len", "steps", "gc_freq", "data_shards"):
            check_int(f"training.{key}", getattr(self, key), minimum=1)
        check_int("training.data_prefetch", self.data_prefetch, minimum=0, hint="0: no prefetch")
        if self.data_shard_layout not in SHARD_LAYOUTS:
            raise ConfigError(
                f"training.data_shard_layout={self.data_shard_layout!r} is not allowed; use "
                f"one of {', '.join(map(repr, SHARD_LAYOUTS))} (see --help)."
            )
        if self.document_positions not in ("restart", "continue"):
            raise ConfigError(
                f"training.document_positions={self.document_positions!r} is not allowed; use "
                "'restart' or 'continue'."
            )
        check_int(
            "training.global_batch_size",
            self.global_batch_size,
            minimum=1,
            sentinel=(-1, "local_batch_size x the data-parallel degree"),
        )
        check_int(
            "training.skip_nonfinite_steps",
            self.skip_nonfinite_steps,
            minimum=0,
            hint="0 stops at the first inf/nan gradient norm",
        )
        check_number("training.max_norm", self.max_norm, low=0, hint="0 turns clipping off")
        check_mixture(self, self.datasets)


@dataclass(kw_only=True)
class CommConfig:
    """Collective-communication timeouts and the NCCL flight recorder."""

    init_timeout_seconds: int = 300
    """Timeout of the first collectives (start-up, first step, compilation)."""
    train_timeout_seconds: int = 100
    """Timeout of every collective after the first step: a hung rank fails the job after this."""
    trace_buf_size: int = 20000
    """NCCL flight recorder: how many collectives each rank remembers, dumped when one times
    out (torch's TORCH_FR_BUFFER_SIZE); 0 turns it off. Accelerator backends only."""
    save_traces_folder: str = "comm_traces"
    """Where under job.dump_folder the flight recorder's dumps go."""
    save_traces_file_prefix: str = "rank_"
    """Each dump's file name: this prefix, then the rank."""

    def __post_init__(self) -> None:
        for key in ("init_timeout_seconds", "train_timeout_seconds"):
            check_duration(f"comm.{key}", getattr(self, key), unit_s=1, hint="seconds")
        check_int("comm.trace_buf_size", self.trace_buf_size, minimum=0, hint="0 turns it off")


@dataclass(kw_only=True)
class CheckpointSection(CheckpointConfig):
    """``titan_ckpt.CheckpointConfig`` (when and what the checkpoint manager saves and loads),
    plus the trainer's own checkpoint policy: a save on SIGTERM, torchft's per-replica
    dataloader saves, and a seed-checkpoint run."""

    save_on_sigterm: bool = True
    """On SIGTERM (a scheduler's stop), save the last completed step before exiting with
    status 143; a second SIGTERM exits at once. Off: stop without a save. Not a torchtitan
    key (torchtitan dies at the signal)."""
    enable_ft_dataloader_checkpoints: bool = True
    """With fault_tolerance.enable: each replica group also saves its own dataloader state
    (in ft-replica-<id>/), so no group replays data after a restart."""
    create_seed_checkpoint: bool = False
    """This run only writes the initial model as step-0 (model only, one process, no
    torchrun) and stops; start runs of any layout from it with initial_load_path."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.create_seed_checkpoint and (not self.enable or self.load_only):
            raise ConfigError(
                "checkpoint.create_seed_checkpoint=true needs checkpoint.enable=true and "
                "checkpoint.load_only=false: the seed is written as the checkpoint step-0."
            )


@dataclass(kw_only=True)
class JobConfig:
    """A titan training run. Every option is ``--section.key value`` on the command line."""

    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    parallelize: ParallelizeConfig = field(default_factory=ParallelizeConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(
        default_factory=lambda: LRSchedulerConfig(warmup_steps=5)
    )
    checkpoint: CheckpointSection = field(
        default_factory=lambda: CheckpointSection(
            enable=True, interval=10, last_save_model_only=False
        )
    )
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    comm: CommConfig = field(default_factory=CommConfig)

    def to_dict(self) -> dict[str, Any]:
        """The merged config as TOML-ready values (what ``titan-train config --print`` shows)."""
        return to_dict(self)


def parse_job_config(argv: Sequence[str] | None = None, *, prog: str = "titan-train") -> JobConfig:
    """The ``JobConfig`` of a command line (TOML file, or torchtitan's ``--module M --config
    F``, then ``--section.key`` overrides); torchtitan's keys, in the file or on the command
    line, are translated (``compat``); ``--model.args.KEY VALUE`` sets ``model.args``."""
    argv, preset = compat_argv.pop_preset(sys.argv[1:] if argv is None else argv)
    argv, model_args = split_model_args(argv)
    argv, torchtitan_cli = compat_argv.split_argv(argv)
    named = None
    notes: list[str] = []
    if preset is not None:
        from titan_train.compat import head as torchtitan_head

        flat, notes = torchtitan_head.preset_values(*preset)
        named = (
            f"torchtitan's {preset[0]}.{preset[1]} ({torchtitan_head.HEAD_COMMIT[:9]})",
            compat.unflatten(flat),
        )
    translations: list[compat.Translation] = []

    def translate(values: dict[str, Any], source: str) -> dict[str, Any]:
        translation = compat.translate(
            values,
            torchtitan_cli,
            source=source,
            defaults={} if preset else compat.TORCHTITAN_DEFAULTS,
        )
        if preset is None:
            translation.log(source)
        else:  # the table's keys are titan's doing; the user's own flags are logged
            translation.log(source, only=compat.flatten(torchtitan_cli))
            compat.logger.info(
                "%s as titan settings (titan-train config import writes them as TOML); not "
                "carried: %s",
                source,
                "; ".join(notes) or "nothing",
            )
        translations.append(translation)
        return translation.values

    config = load_config(
        JobConfig, argv, prog=prog, description=JobConfig.__doc__, translate=translate, preset=named
    )
    config = compat_batch.resolve_batch(
        config, translations[0].batch, cli=argv, follow_validation=preset is not None
    )
    if model_args:
        model = dataclasses.replace(config.model, args={**config.model.args, **model_args})
        config = dataclasses.replace(config, model=model)
    return config


def split_model_args(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Take ``--model.args.KEY VALUE`` (or ``=VALUE``) out of ``argv``: ``(the rest, {KEY:
    value})``. A value is read as TOML (``512``, ``1e-5``, ``true``, ``[1, 2]``), else as a
    string; ``none`` is None (for a field that may be unset, e.g. ``n_kv_heads``)."""
    wanted = lambda key: key.startswith("model.args.")  # noqa: E731
    rest, options = pop_options(argv, wanted, "--model.args.n_layers 4")
    return rest, {key.removeprefix("model.args."): _cli_value(value) for key, value in options}


def _cli_value(text: str) -> Any:
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
