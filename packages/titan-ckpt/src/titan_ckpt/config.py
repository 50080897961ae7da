"""``CheckpointConfig``: when and what the CheckpointManager saves and loads.

Field names follow torchtitan's ``[checkpoint]`` section so its TOML files carry over;
``verify_checksums`` and ``checksum`` are ours. ``CheckpointConfig()`` saves (``enable`` true).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from titan_ckpt.errors import CheckpointConfigError, check_bool, check_choice, check_int
from titan_ckpt.formats.checksums import CHECKSUMS, resolve_checksum

__all__ = ["ASYNC_MODES", "EXPORT_DTYPES", "CheckpointConfig", "CheckpointConfigError"]

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Names under which the manager stores the states it is given; the model's own keys sit at the
# top level beside them (see CheckpointManager), so no model FQN may use one of these names.
MODEL = "model"
DATALOADER = "dataloader"


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoint policy of a run: folder, interval, retention, async mode, first and last save."""

    enable: bool = True
    """Save checkpoints and resume from them; off, save() and load() do nothing."""
    folder: str = "checkpoint"
    """Where step-<N>/ directories go: a local path or an fsspec URL (scheme://...)."""
    interval: int = 500
    """Save every this many steps."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """disabled: save blocks; async: a background thread writes; async_with_pinned_mem: a
    background process writes from a staged copy (pinned memory where an accelerator exists)."""
    keep_latest_k: int = 10
    """Keep this many newest committed steps and delete older ones; 0 keeps all; 1 is refused."""
    load_step: int = -1
    """Step to resume from; -1 takes the newest committed step."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """States not to restore on resume, e.g. dataloader,lr_scheduler (a TOML list or a comma
    list); never model."""
    initial_load_path: str | None = None
    """Checkpoint to start from when the folder holds none: a step directory, a checkpoint
    folder (its newest committed step), or a Hugging Face folder with initial_load_in_hf."""
    initial_load_model_only: bool = True
    """Take only the model from initial_load_path, not optimizer and other training state."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face safetensors folder, read through the state-dict
    adapter; needs initial_load_model_only."""
    last_save_model_only: bool = True
    """The save of the last step holds the model alone (a final export, not a resume point)."""
    last_save_in_hf: bool = False
    """Also write the last save as Hugging Face safetensors (step-<N>/hf/) through the
    state-dict adapter; needs last_save_model_only."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the model tensors in a model-only last save."""
    hf_max_shard_size: int = 5 << 30
    """Largest safetensors file (bytes) of the last_save_in_hf export: beyond it the export is
    split into model-0000k-of-0000n.safetensors files plus model.safetensors.index.json, as
    Hugging Face shards checkpoints (not a torchtitan key)."""
    enable_first_step_checkpoint: bool = False
    """Also save after step 1, to prove checkpointing works on new storage early."""
    load_only: bool = False
    """Load checkpoints but never save any (evaluation, debugging)."""
    verify_checksums: bool = False
    """Check every file's checksum against the manifest on load; sizes are always checked."""
    checksum: Literal["auto", "xxh3_128", "sha256"] = "auto"
    """The checksum a save records for every file in the manifest: xxh3_128 (fast, needs
    the xxhash package), sha256 (a cryptographic digest), or auto (xxh3_128 where xxhash is
    installed, else sha256). Loads verify whatever each step recorded."""
    trust_pickles: bool = False
    """Unpickle checkpoint metadata and records without the allowlist (which admits only DCP's
    types, torch sizes, dtypes and tensors, and plain containers): for checkpoints you made
    yourself with custom objects. Never for checkpoints of unknown origin: their pickles can
    run code."""

    def __post_init__(self) -> None:
        self._check_types()
        self._check_values()
        self._check_load_settings()
        self._check_save_settings()

    def _check_types(self) -> None:
        for name in (
            "enable",
            "initial_load_model_only",
            "initial_load_in_hf",
            "last_save_model_only",
            "last_save_in_hf",
            "enable_first_step_checkpoint",
            "load_only",
            "verify_checksums",
            "trust_pickles",
        ):
            check_bool(f"checkpoint.{name}", getattr(self, name))

    def _check_values(self) -> None:
        check_int("checkpoint.interval", self.interval, minimum=1)
        check_int("checkpoint.keep_latest_k", self.keep_latest_k, minimum=0)
        if self.keep_latest_k == 1:
            raise CheckpointConfigError(
                "checkpoint.keep_latest_k=1 is not allowed: while the newest step is still being "
                "written, the one before it is the only complete checkpoint, so at least 2 must "
                "be kept. Use 0 (keep all) or >= 2."
            )
        check_int(
            "checkpoint.load_step",
            self.load_step,
            minimum=0,
            sentinel=(-1, "the newest committed step"),
        )
        check_int("checkpoint.hf_max_shard_size", self.hf_max_shard_size, minimum=1)
        if not isinstance(self.folder, str) or not self.folder:
            raise CheckpointConfigError(
                f"checkpoint.folder={self.folder!r} must be a non-empty path or fsspec URL."
            )
        check_choice("checkpoint.async_mode", self.async_mode, ASYNC_MODES)
        check_choice("checkpoint.export_dtype", self.export_dtype, EXPORT_DTYPES)
        check_choice("checkpoint.checksum", self.checksum, CHECKSUMS)
        resolve_checksum(self.checksum)  # xxh3_128 only with xxhash installed

    def _check_load_settings(self) -> None:
        if isinstance(self.exclude_from_loading, str):
            # A comma-separated CLI value, as torchtitan accepts it.
            self.exclude_from_loading = [
                s.strip() for s in self.exclude_from_loading.split(",") if s.strip()
            ]
        if not all(isinstance(s, str) for s in self.exclude_from_loading):
            raise CheckpointConfigError(
                f"checkpoint.exclude_from_loading={self.exclude_from_loading!r} must be a list of "
                "state names."
            )
        if MODEL in self.exclude_from_loading:
            raise CheckpointConfigError(
                f"checkpoint.exclude_from_loading={self.exclude_from_loading!r} names 'model': "
                "a resume always restores the model. To start from fresh weights, point "
                "checkpoint.folder at an empty folder instead."
            )
        if self.initial_load_path is not None and (
            not isinstance(self.initial_load_path, str) or not self.initial_load_path
        ):
            raise CheckpointConfigError(
                f"checkpoint.initial_load_path={self.initial_load_path!r} must be a non-empty "
                "path, or unset."
            )
        if self.initial_load_in_hf and not self.initial_load_model_only:
            raise CheckpointConfigError(
                "checkpoint.initial_load_in_hf=true needs checkpoint.initial_load_model_only=true: "
                "a Hugging Face folder holds model weights only."
            )
        if self.initial_load_in_hf and self.initial_load_path is None:
            raise CheckpointConfigError(
                "checkpoint.initial_load_in_hf=true needs checkpoint.initial_load_path, the "
                "Hugging Face folder to read."
            )

    def _check_save_settings(self) -> None:
        if self.last_save_in_hf and not self.last_save_model_only:
            raise CheckpointConfigError(
                "checkpoint.last_save_in_hf=true needs checkpoint.last_save_model_only=true: "
                "safetensors hold tensors only, not optimizer or training state."
            )

    @property
    def export_torch_dtype(self) -> torch.dtype:
        """``export_dtype`` as a ``torch.dtype``."""
        return EXPORT_DTYPES[self.export_dtype]
