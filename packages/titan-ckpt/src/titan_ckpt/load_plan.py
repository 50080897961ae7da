"""Deciding what ``CheckpointManager.load`` reads, on rank 0, before anything is read.

The newest resumable step of the run's folder (ours committed, or torchtitan's; or
``load_step``), else ``initial_load_path``, else a fresh start. The step is checked against its
manifest and the model (every FQN, same shapes) before any rank reads a tensor; with several
ranks each hashes its share of the files (``verify_shared``), so a damaged step leaves the
model and optimizer as they were.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from titan_ckpt.config import DATALOADER, CheckpointConfig
from titan_ckpt.errors import CheckpointConfigError, CheckpointIntegrityError
from titan_ckpt.formats.checksums import require_algorithms
from titan_ckpt.layout import (
    Manifest,
    file_problems,
    integrity_error,
    read_manifest,
    scan_steps,
    step_of,
    verify_step,
)
from titan_ckpt.preflight import foreign_steps_error, resolve_start
from titan_ckpt.states import ModelState
from titan_ckpt.storage import Storage
from titan_ckpt.torchtitan import TorchtitanCompat, is_torchtitan_checkpoint, read_state_keys

__all__ = ["LoadPlan", "Loaded", "plan_load", "shares", "verify_shared"]

logger = logging.getLogger("titan_ckpt")


@dataclass(frozen=True)
class Loaded:
    """What ``CheckpointManager.load`` restored: falsy when it restored nothing (a fresh
    start), so ``if manager.load():`` reads as before."""

    path: str | None = None
    """The step directory (or Hugging Face folder) read; None: nothing was loaded."""
    step: int | None = None
    """Its step: the step to continue after (None: not known, e.g. a Hugging Face folder)."""
    states: tuple[str, ...] = ()
    """What was restored: ``model``, then the names of the states."""
    kind: str | None = None
    """"resume" (the run's own folder), "initial" (initial_load_path) or "hf"."""
    metadata: Mapping[str, Any] | None = field(default=None, compare=False)
    """The metadata the step's writer recorded (``CheckpointManager(metadata=...)``)."""

    def __bool__(self) -> bool:
        return self.path is not None


@dataclass(frozen=True)
class LoadPlan:
    """A checkpoint to load, agreed by every rank."""

    kind: str
    """"resume" (the run's folder), "initial" (initial_load_path) or "hf" (a HF folder)."""
    directory: str
    """The step directory or Hugging Face folder."""
    manifest: Manifest | None
    """Its commit marker, if it has one."""
    source: str = "titan"
    """Who wrote it: "titan" (a commit marker), "torchtitan", or "dcp" (anything else)."""
    keys: frozenset[str] | None = None
    """Its DCP metadata keys, when it is not titan's."""

    def entries(
        self, cfg: CheckpointConfig, states: Mapping[str, Any], data_parallel_degree: int
    ) -> dict[str, Any]:
        """What DCP loads for ``states`` (the shared checkpoint's), by name: none for a
        model-only load; titan's states as they are, a torchtitan checkpoint's through
        ``TorchtitanCompat``. ``CheckpointConfigError`` for a state the step lacks, or a
        dataloader saved at another data-parallel degree that cannot reshard."""
        names = self._names(cfg, states, data_parallel_degree)
        if self.source == "torchtitan" and self.keys is not None:
            return TorchtitanCompat(self.keys, self.directory).states_for_load(names, states)
        if self.source == "dcp" and self.keys is not None:
            missing = [n for n in names if not any(k.startswith(f"{n}.") for k in self.keys)]
            if missing:
                raise CheckpointConfigError(
                    f"{self.directory} holds no {missing} state (it is neither titan's nor "
                    "torchtitan's checkpoint); set checkpoint.initial_load_model_only=true to "
                    f"take only the model, or add {missing} to checkpoint.exclude_from_loading."
                )
        return {n: states[n] for n in names}

    def _names(
        self, cfg: CheckpointConfig, states: Mapping[str, Any], data_parallel_degree: int
    ) -> list[str]:
        manifest = self.manifest
        if self.kind == "initial" and cfg.initial_load_model_only:
            return []
        if manifest is not None and manifest.model_only:
            if self.kind == "resume" and manifest.step != 0:
                logger.warning(
                    "%s is a model-only checkpoint (a final export): resuming the model only; "
                    "optimizer and other states start fresh",
                    self.directory,
                )
            return []
        names = [n for n in sorted(states) if n not in cfg.exclude_from_loading]
        if manifest is None:
            return names
        missing = [n for n in names if n not in manifest.states]
        if missing:
            raise CheckpointConfigError(
                f"{self.directory} holds no {missing} state (it has {manifest.states}); add "
                f"{missing} to checkpoint.exclude_from_loading to start them fresh."
            )
        # The dataloader is sharded over data-parallel ranks, not over all ranks: a TP=2 world
        # of 2 and a single process both read one data stream. Older markers lack the degree.
        saved_dp = manifest.data_parallel_degree or manifest.world_size
        if (
            DATALOADER in names
            and saved_dp != data_parallel_degree
            and not getattr(states[DATALOADER], "supports_resharding", False)
        ):
            raise CheckpointConfigError(
                f"{self.directory} was written with data-parallel degree {saved_dp}, this run has "
                f"{data_parallel_degree}, and the dataloader "
                f"({type(states[DATALOADER]).__name__}) does not declare "
                "supports_resharding. Add 'dataloader' to checkpoint.exclude_from_loading to "
                "restart the data stream, or resume at the original data-parallel degree."
            )
        return names


def plan_load(
    storage: Storage, config: CheckpointConfig, model: ModelState, *, step: int, checksums: bool
) -> LoadPlan | None:
    """What to load: a plan, or None for a fresh start; ``CheckpointConfigError`` (or an
    integrity error) for a folder or step that cannot be loaded. Runs on rank 0; the manager
    hands its plan, or its error, to every rank."""
    scan = scan_steps(storage, config.folder)
    if scan.foreign:
        raise foreign_steps_error(storage, config.folder, scan.foreign)
    start = resolve_start(storage, config, scan, step=step)
    if start is None:
        return None
    kind, directory = start
    if kind == "hf":
        return LoadPlan("hf", directory, None)
    if kind == "resume":
        step = step_of(directory.rstrip("/").rsplit("/", 1)[-1])
        newer = [s for s in scan.committed if s > step]
        if newer:
            logger.warning(
                "Resuming from step %d while newer committed steps %s exist; saving "
                "those steps again will replace them",
                step,
                newer,
            )
    return _checked(storage, model, kind, directory, checksums, config.trust_pickles)


def _checked(
    storage: Storage,
    model: ModelState,
    kind: str,
    directory: str,
    checksums: bool,
    trust_pickles: bool,
) -> LoadPlan:
    manifest = read_manifest(storage, directory)
    if manifest is not None:
        verify_step(storage, directory, manifest, checksums=checksums)
        _check_model_matches(storage, model, directory, trust_pickles)
        return LoadPlan(kind, directory, manifest)
    keys = read_state_keys(storage, directory) or set()
    source = "torchtitan" if is_torchtitan_checkpoint(keys) else "dcp"
    if kind == "resume" and source != "torchtitan":
        raise CheckpointIntegrityError(f"{directory} lost its commit marker")
    if source == "torchtitan":
        logger.info("%s is a torchtitan checkpoint (no titan manifest to verify)", directory)
    else:
        logger.warning("%s has no titan commit marker; loading it unverified", directory)
    _check_model_matches(storage, model, directory, trust_pickles)
    return LoadPlan(kind, directory, None, source, frozenset(keys))


def _check_model_matches(
    storage: Storage, model: ModelState, directory: str, trust_pickles: bool
) -> None:
    """Refuse a checkpoint of a different model (missing keys, other shapes) up front; the
    metadata is unpickled under the allowlist unless ``trust_pickles``."""
    reader = storage.dcp_reader(directory, trust_pickles=trust_pickles)
    saved = reader.read_metadata().state_dict_metadata
    missing, shapes = [], []
    for fqn, tensor in model.state_dict().items():
        meta = saved.get(fqn)
        if meta is None:
            missing.append(fqn)
        elif hasattr(meta, "size") and tuple(meta.size) != tuple(tensor.shape):
            shapes.append(f"{fqn} {tuple(meta.size)} in the checkpoint, {tuple(tensor.shape)}")
    if missing or shapes:
        detail = []
        if missing:
            detail.append(f"missing model keys {missing[:5]} (of {len(missing)})")
        if shapes:
            detail.append("shape mismatches: " + "; ".join(shapes[:5]))
        raise CheckpointConfigError(
            f"{directory} does not hold this model: {', '.join(detail)}. Check that the "
            "model configuration matches the one that wrote the checkpoint."
        )


def shares(files: Mapping[str, dict], world: int) -> list[dict[str, dict]]:
    """``files`` (a manifest's entries) split among ``world`` ranks with balanced bytes: from
    the largest file to the smallest, each to the rank holding the fewest bytes so far (the
    lowest such rank); the same split on every rank."""
    loads, out = [0] * world, [{} for _ in range(world)]
    for rel, info in sorted(files.items(), key=lambda kv: (-kv[1]["size"], kv[0])):
        owner = loads.index(min(loads))
        loads[owner] += info["size"]
        out[owner][rel] = info
    return out


def verify_shared(
    storage: Storage, directory: str, manifest: Manifest, group: dist.ProcessGroup | None
) -> None:
    """Check every file's checksum against ``manifest``, the files split among the ranks of
    ``group`` (a collective); every rank raises the same ``CheckpointIntegrityError`` naming
    each damaged file, or the same ``CheckpointConfigError`` when a rank cannot compute an
    algorithm the manifest uses (``require_algorithms``; nothing read then). Sizes were
    checked on rank 0 in ``plan_load``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    try:
        require_algorithms(manifest.files.values(), directory)
    except CheckpointConfigError as error:
        refused: str | None = str(error)
    else:
        refused = None
    # Every rank learns of a refusal before any reads (a rank raising alone would leave the
    # others waiting in the gather below).
    refusals: list[Any] = [None] * world
    dist.all_gather_object(refusals, refused, group=group)
    first = next((r for r in refusals if r is not None), None)
    if first is not None:
        raise CheckpointConfigError(first)
    found = file_problems(storage, directory, shares(manifest.files, world)[rank], checksums=True)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, found, group=group)
    problems = sorted(p for part in everyone for p in part)
    if problems:
        raise integrity_error(directory, problems)
