"""``CheckpointManager``: save and resume a training run with DCP, atomically and verifiably.

A step is one DCP state dict: the model's tensors by FQN at the top level (torchtitan's
layout) beside one entry per other state. Invariants:
- A step is loadable only once ``titan-commit.json`` exists; rank 0 writes it after DCP
  finished on every rank, with the manifest the writers hashed (no byte read back). Loads
  are planned on rank 0 and broadcast: every rank loads the same step or raises the same error.
- At most one save is in flight; a save, a load and ``close()`` finish the previous one.
- Retention deletes committed steps only, in a background thread on rank 0.
- Only directories titan created are deleted or written into (``titan-owner.json`` goes in
  first; ``layout.classify_step``). A torchtitan checkpoint is resumed from.
- One writer per folder: a saving manager holds the folder's lock from construction to
  ``close()`` and never replaces a step another writer committed after it started.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.logger as dcp_logger
from torch import nn

from titan_ckpt.adapter import StateDictAdapter
from titan_ckpt.asyncmode import AsyncSaver, check_main_guard
from titan_ckpt.config import DATALOADER, MODEL, CheckpointConfig
from titan_ckpt.errors import CheckpointConfigError
from titan_ckpt.formats.checksums import resolve_checksum
from titan_ckpt.formats.dcp import unwrap_read_errors
from titan_ckpt.formats.hashing import set_checksum, written_files
from titan_ckpt.ft import FaultTolerance, FaultToleranceOptions
from titan_ckpt.hf import load_hf, require_safetensors, save_hf
from titan_ckpt.layout import (
    Manifest,
    Purger,
    commit_step,
    json_metadata,
    step_dir,
    step_of,
)
from titan_ckpt.load_plan import Loaded, plan_load, verify_shared
from titan_ckpt.lock import FolderLock, claim_step, lock_checkpoint_folder
from titan_ckpt.preflight import check_folder_writable, open_storage, saves_step
from titan_ckpt.space import WRITE_ERRORS, SaveWatch, state_bytes
from titan_ckpt.states import ModelState, as_states
from titan_ckpt.storage import RecordingStorage, Storage

__all__ = ["CheckpointManager"]

logger = logging.getLogger("titan_ckpt")
T = TypeVar("T")
HF_SUBDIR = "hf"


@contextlib.contextmanager
def quiet_dcp(distributed: bool) -> Iterator[None]:
    """Around a DCP call: no warning DCP gives every call of a process without
    ``torch.distributed`` (our intent), and no debug events (two per state entry, each
    looking up its caller: a few ms of every save) while only torch's NullHandler hears them."""
    events = getattr(dcp_logger, "_dcp_logger", None)
    mute = (
        isinstance(events, logging.Logger)
        and not events.disabled
        and not events.propagate
        and all(type(handler) is logging.NullHandler for handler in events.handlers)
    )
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if mute:
            events.disabled = True
        try:
            yield
        finally:
            if mute:
                events.disabled = False


def gc_paused(method: Callable[..., T]) -> Callable[..., T]:
    """``method`` run with the cyclic garbage collector paused: a save or load makes enough
    small objects to set off a full collection over the trainer's heap about every other
    load (+0.10 s on a 0.28 s load of 444 MiB on 2 ranks); torchtitan pauses it too."""

    @functools.wraps(method)
    def paused(*args: Any, **kwargs: Any) -> T:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return paused


class CheckpointManager:
    """Saves ``model_parts`` and named ``Stateful`` states every ``interval`` steps; resumes.

    Args:
        config: the checkpoint policy.
        model_parts: the model, or its pipeline stages (each keeps its original FQNs).
        states: other state by name: a module, an optimizer (saved by FQN as an
            ``OptimizerState``), or anything with ``state_dict()`` and ``load_state_dict()``;
            ``None`` values are skipped. A ``dataloader`` may carry ``dp_degree`` (default:
            the world size); a resume at another degree loads it only if it has
            ``supports_resharding = True``.
        state_dict_adapter: Hugging Face conversion, for ``last_save_in_hf`` and
            ``initial_load_in_hf``.
        storage: where checkpoints live; default from ``config.folder``.
        process_group: the ranks that checkpoint together (async modes make their own gloo
            group so background collectives never interleave with training's).
        metadata: JSON facts recorded in every manifest, e.g. ``{"model": {"name", "flavor",
            "args"}}``, which ``titan-ckpt convert`` uses.
        folder_lock: the folder's lock taken earlier (``lock_checkpoint_folder``), released on
            ``close()``; default: a saving manager takes it here.
        ft: a torchft replica group (``FaultToleranceOptions``, see ``titan_ckpt.ft``).

    A failed save raises ``CheckpointWriteError`` (``DiskFullError`` when space ran out) on
    every rank, naming the path, the bytes needed and free; its partial step is removed. An
    async save's failure is raised by the next ``wait``, ``save`` or ``close``.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        model_parts: nn.Module | Sequence[nn.Module],
        states: Mapping[str, Any] | None = None,
        state_dict_adapter: StateDictAdapter | None = None,
        storage: Storage | None = None,
        process_group: dist.ProcessGroup | None = None,
        metadata: Mapping[str, Any] | None = None,
        folder_lock: FolderLock | None = None,
        ft: FaultToleranceOptions | None = None,
    ) -> None:
        self.config = config
        self._lock = folder_lock
        self._began = time.time()  # a step committed later, not by us: another writer's
        self._committed: set[str] = set()
        self.metadata = json_metadata(metadata)
        self.model = ModelState(model_parts)
        self.states = as_states(states or {}, self.model.model_parts)
        self.adapter = state_dict_adapter
        self.storage = storage if storage is not None else open_storage(config.folder)
        self.checksum = resolve_checksum(config.checksum)
        """The algorithm of this manager's manifests (``config.checksum`` resolved)."""
        self.folder = config.folder
        self.last_loaded_step: int | None = None
        self.loaded_metadata: dict[str, Any] | None = None
        """The metadata recorded with the step ``load`` restored (None: none loaded)."""
        self.loaded_source: str | None = None
        """Who wrote what ``load`` restored: "titan", "torchtitan", "dcp" or "hf"."""
        self._purger: Purger | None = None
        self._ft_purger: Purger | None = None
        self._async: AsyncSaver | None = None
        self._distributed = dist.is_available() and dist.is_initialized()
        self._rank = 0
        self.pg = process_group
        self._validate()
        self.ft: FaultTolerance | None = None
        if ft is not None:
            self.ft = FaultTolerance(
                ft, model=self.model, states=self.states, before_heal=self.maybe_wait_for_staging
            )
        if not config.enable:
            return
        try:
            self._start(process_group)
        except BaseException:
            self.close()
            raise
        logger.info("Checkpointing to %s (async_mode=%s)", self.folder, config.async_mode)

    def _start(self, process_group: dist.ProcessGroup | None) -> None:
        if self._distributed and self.config.async_mode != "disabled":
            # Collective over the default group: every rank constructs a manager.
            ranks = dist.get_process_group_ranks(process_group) if process_group else None
            self.pg = dist.new_group(ranks=ranks, backend="gloo")
        # "Rank 0" below is rank 0 of the checkpointing group: it plans loads and commits.
        self._rank = dist.get_rank(self.pg) if self._distributed else 0
        if self._lock is None:  # before any work; every rank raises a refusal
            ft, replica = self.ft is not None, getattr(self.ft, "replica_id", None)
            self._lock = lock_checkpoint_folder(
                self.config, storage=self.storage, group=self.pg, torchft=ft, ft_replica_id=replica
            )
        if self.config.async_mode != "disabled":
            self._async = AsyncSaver(
                self.config.async_mode,
                model=self.model,
                states=self.states,
                distributed=self._distributed,
                committer=self._rank == 0,
                commit=lambda directory, manifest, written: self._commit(
                    directory, manifest, self._purger, written=written
                ),
            )
        self._watch = SaveWatch(
            self.storage, self.folder, rank=self._rank, distributed=self._distributed, group=self.pg
        )
        if self._rank == 0 and self.config.keep_latest_k > 0 and not self.config.load_only:
            self._purger = Purger(self.storage, self.folder, self.config.keep_latest_k)
            if self.ft is not None and self.ft.dataloader_checkpoints:
                replica = self.ft.replica_folder(self.storage, self.folder)
                self._ft_purger = Purger(self.storage, replica, self.config.keep_latest_k)

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        cfg = self.config
        clash = sorted(self.states.keys() & self.model.state_dict().keys())
        if clash:
            raise CheckpointConfigError(
                f"State names {clash} equal model parameter names; rename those states."
            )
        known = {*self.states, DATALOADER, "optimizer", "lr_scheduler", "train_state"}
        unknown = [s for s in cfg.exclude_from_loading if s not in known]
        if unknown:
            raise CheckpointConfigError(
                f"checkpoint.exclude_from_loading names {unknown}, which are not states of this "
                f"run; the states are {sorted(self.states)}."
            )
        if not cfg.enable:
            return
        if (cfg.last_save_in_hf or cfg.initial_load_in_hf) and self.adapter is None:
            key = "last_save_in_hf" if cfg.last_save_in_hf else "initial_load_in_hf"
            raise CheckpointConfigError(
                f"checkpoint.{key}=true needs state_dict_adapter=: the model's conversion to "
                "Hugging Face names (titan-models provides one per model)."
            )
        if cfg.last_save_in_hf:
            require_safetensors("checkpoint.last_save_in_hf")
        if cfg.initial_load_in_hf:
            require_safetensors("checkpoint.initial_load_in_hf")
        if cfg.async_mode == "async_with_pinned_mem" and self._distributed:
            check_main_guard()  # the writer is a spawned process only with a process group
        check_folder_writable(cfg, self.storage)

    # ------------------------------------------------------------------ collectives
    def _decide(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on rank 0 only: every rank returns its result, or raises the error
        it raised (so that every rank loads the same step or fails the same way)."""
        outcome: tuple[Any, Exception | None] = (None, None)
        if self._rank == 0:
            try:
                outcome = (fn(), None)
            except Exception as error:  # delivered to every rank, raised there
                outcome = (None, error)
        if self._distributed:
            box = [outcome]
            dist.broadcast_object_list(box, group=self.pg, group_src=0)
            outcome = box[0]
        value, error = outcome
        if error is not None:
            raise error
        return value

    def _world_size(self) -> int:
        return dist.get_world_size() if self._distributed else 1

    # ------------------------------------------------------------------ saving
    def should_save(self, curr_step: int, *, last_step: bool = False) -> bool:
        """Whether ``save(curr_step, last_step=...)`` would write a checkpoint."""
        return saves_step(self.config, curr_step, last_step=last_step)

    @gc_paused
    def save(
        self,
        curr_step: int,
        *,
        last_step: bool = False,
        force: bool = False,
        model_only: bool = False,
    ) -> bool:
        """Checkpoint step ``curr_step`` if the policy says so (or ``force``); True if saved.

        ``model_only`` saves the model alone, no other state (e.g. a trainer's seed
        checkpoint: ``save(0, force=True, model_only=True)``); so does the last step with
        ``last_save_model_only``. In ``disabled`` mode the step is committed when this
        returns. In async modes this returns after staging; the write and commit finish in
        the background (the last step and a model-only save are always written
        synchronously).
        """
        if not (force and self.config.enable) and not self.should_save(
            curr_step, last_step=last_step
        ):
            return False
        self.wait()  # saves never overlap
        begin = time.monotonic()
        cfg = self.config
        model_only = model_only or (last_step and cfg.last_save_model_only)
        shared_states = self._shared_states()
        if self.ft is not None:
            if self.ft.dataloader_checkpoints and not model_only:
                self._write_replica(curr_step)
            if not self.ft.is_writer():
                return True  # another replica group writes the shared checkpoint
        directory = step_dir(self.storage, self.folder, curr_step)

        if model_only:
            dtype = cfg.export_torch_dtype if last_step else None
            state: dict[str, Any] = self.model.export(dtype) if dtype else self.model.state_dict()
        else:
            state = {**self.model.state_dict(), **shared_states}
        names = [MODEL] + ([] if model_only else sorted(shared_states))
        manifest = self._manifest(curr_step, names, model_only=model_only)
        needed = self._watch.step_bytes(state, "model" if model_only else "full")
        synchronous = cfg.async_mode == "disabled" or last_step or model_only
        if synchronous:
            hf = last_step and cfg.last_save_in_hf
            self._write_sync(directory, state, manifest, self._purger, hf=hf, needed=needed)
            logger.info("Saved %s in %.2f s", directory, time.monotonic() - begin)
        else:
            assert self._async is not None  # made by _start for an async mode
            self._prepare_step(directory, manifest.step, needed)
            with quiet_dcp(self._distributed):
                self._async.save(
                    state,
                    writer=self._dcp_writer(directory),
                    process_group=self.pg,
                    no_dist=not self._distributed,
                    inflight=(directory, curr_step, needed),
                    manifest=manifest,
                )
            seconds = time.monotonic() - begin
            if not self._async.staging_in_background:
                logger.info("Staged %s in %.2f s; writing in the background", directory, seconds)
            else:
                logger.info(
                    "Saving %s: %.2f s in save(); staging and writing in the background",
                    directory,
                    seconds,
                )
        return True

    def _dcp_writer(self, directory: str) -> Any:
        """The storage's DCP writer for ``directory``, hashing with ``self.checksum`` when it
        is one of ours (any other writer's files are hashed by the commit, by reading)."""
        writer = self.storage.dcp_writer(directory)
        set_checksum(writer, self.checksum)
        return writer

    def _write_replica(self, step: int) -> None:
        """Write and commit this replica group's own dataloader state in its own folder."""
        assert self.ft is not None
        directory = step_dir(self.storage, self.ft.replica_folder(self.storage, self.folder), step)
        state = {DATALOADER: self.states[DATALOADER]}
        manifest = self._manifest(step, [DATALOADER], model_only=False)
        self._write_sync(directory, state, manifest, self._ft_purger, needed=state_bytes(state))

    def _shared_states(self) -> dict[str, Any]:
        """States in the shared checkpoint: all, less a dataloader saved per replica group."""
        if self.ft is not None and self.ft.dataloader_checkpoints:
            return {k: v for k, v in self.states.items() if k != DATALOADER}
        return self.states

    def _manifest(self, step: int, states: list[str], *, model_only: bool) -> Manifest:
        return Manifest(
            step=step,
            world_size=self._world_size(),
            states=states,
            model_only=model_only,
            data_parallel_degree=self._data_parallel_degree(),
            metadata=dict(self.metadata),
        )

    def _data_parallel_degree(self) -> int:
        """How many ways the dataloader shards the data: its own ``dp_degree`` (under tensor
        parallel fewer than the ranks, which share a stream), else the world size."""
        degree = getattr(self.states.get(DATALOADER), "dp_degree", None)
        return degree if isinstance(degree, int) and degree >= 1 else self._world_size()

    def _write_sync(
        self,
        directory: str,
        state: dict[str, Any],
        manifest: Manifest,
        purger: Purger | None,
        *,
        hf: bool = False,
        needed: int | None = None,
    ) -> None:
        """Write and commit one step: committed when this returns on any rank, else one
        ``CheckpointWriteError`` raised on every rank (``SaveWatch.settle``)."""
        self._prepare_step(directory, manifest.step, needed)
        try:
            with quiet_dcp(self._distributed):
                result = dcp.save(
                    state,
                    storage_writer=self._dcp_writer(directory),
                    process_group=self.pg,
                    no_dist=not self._distributed,
                )
        except WRITE_ERRORS as e:  # DCP reports a failed write to every rank
            self._watch.settle(e, directory=directory, step=manifest.step, needed=needed)
            raise  # settle raised unless rank 0 saw no error; keep this rank's own
        error = None
        try:
            written = written_files(result)
            if hf:
                written = {**(written or {}), **self._export_hf(directory)}
            # Every rank's writer hashed its files as it wrote them, and DCP brought the
            # digests to rank 0 (its coordinator) with the write results: the commit reads
            # nothing back.
            if self._rank == 0:
                self._commit(directory, manifest, purger, written=written)
        except WRITE_ERRORS as e:  # on rank 0 the commit; an HF export write on any rank
            error = e
        self._watch.settle(error, directory=directory, step=manifest.step, needed=needed)
        if error is not None:
            raise error

    def _export_hf(self, directory: str) -> dict[str, dict]:
        """Write the Hugging Face export of the model under ``directory``; returns the sizes
        and checksums of the files written (hashed as they were written), by relative path."""
        assert self.adapter is not None  # checked in _validate
        recorder = RecordingStorage(self.storage, checksum=self.checksum)
        save_hf(
            recorder,
            self.storage.join(directory, HF_SUBDIR),
            self.model,
            self.adapter,
            self.config.export_torch_dtype,
            max_shard_size=self.config.hf_max_shard_size,
            writer=self._rank == 0,
        )
        return recorder.written_under(directory)

    def _prepare_step(self, directory: str, step: int, needed: int | None = None) -> None:
        """Make ``directory`` ours and empty before writing step ``step`` into it: remove what
        an earlier save of ours left there; refuse a directory someone else wrote. A write
        that fails here (the owner marker on a full disk) is reported like any failed save.

        No barrier follows: a rank returns from ``_decide`` only once rank 0 sent its outcome,
        i.e. after rank 0 claimed the directory."""
        try:
            self._decide(
                partial(claim_step, self.storage, directory, step, self._began, self._committed)
            )
        except WRITE_ERRORS as error:  # the same on every rank: report it as a failed save
            self._watch.settle(error, directory=directory, step=step, needed=needed)
            raise

    def _commit(
        self,
        directory: str,
        manifest: Manifest,
        purger: Purger | None,
        written: dict[str, dict] | None = None,
    ) -> None:
        commit_step(self.storage, directory, manifest, written, checksum=self.checksum)
        self._committed.add(directory)
        logger.info("Committed %s (%d files)", directory, len(manifest.files))
        if purger is not None:
            purger.request()

    def maybe_wait_for_staging(self) -> None:
        """Block until the last async save no longer reads the training tensors. The manager's
        optimizers (a step pre-hook) and a torchft heal call it themselves; anything else that
        changes the saved tensors in place must call it first."""
        if self._async is not None:
            self._async.maybe_wait_for_staging()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed."""
        finished = self._async.finish() if self._async is not None else None
        if finished is None:
            return
        (directory, step, needed), error = finished
        # The same message as a synchronous save's, on every rank.
        self._watch.settle(error, directory=directory, step=step, needed=needed)
        if error is not None:
            raise error

    def close(self) -> None:
        """Finish the save in flight and pending deletions; stop background threads."""
        try:
            self.wait()
        finally:
            if self._async is not None:
                self._async.close()
                self._async = None
            for purger in (self._purger, self._ft_purger):
                if purger is not None:
                    purger.close()
            self._purger = self._ft_purger = None
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ loading
    @gc_paused
    def load(self, step: int | None = None, *, verify_checksums: bool | None = None) -> Loaded:
        """Restore the newest committed step (or ``step``, default ``config.load_step``); a
        torchtitan checkpoint in the folder counts as one (see ``titan_ckpt.torchtitan``).

        With no such step in the folder, starts from ``config.initial_load_path`` if set.
        Returns what it loaded (``Loaded``: the step, its path, the states), falsy when there
        is nothing to load (a fresh run). A step directory titan
        did not write and cannot read raises ``CheckpointConfigError``, naming it.
        """
        cfg = self.config
        if not cfg.enable:
            return Loaded()
        self.wait()
        step = cfg.load_step if step is None else step
        checksums = cfg.verify_checksums if verify_checksums is None else verify_checksums
        # With several ranks, every rank hashes its share of the files (after rank 0's plan),
        # all before any tensor is read: a damaged step leaves the model as it was.
        shared = checksums and self._distributed and dist.get_world_size(self.pg) > 1
        sums_on_rank_0 = checksums and not shared
        plan = self._decide(
            partial(plan_load, self.storage, cfg, self.model, step=step, checksums=sums_on_rank_0)
        )
        if plan is None:
            logger.info("No checkpoint in %s and no initial_load_path: starting fresh", self.folder)
            return Loaded()
        kind, directory, manifest = plan.kind, plan.directory, plan.manifest
        begin = time.monotonic()
        self.loaded_source = "hf" if kind == "hf" else plan.source
        if kind == "hf":
            assert self.adapter is not None  # checked in _validate
            load_hf(self.storage, directory, self.model, self.adapter)
            if self._distributed:
                dist.barrier(group=self.pg)
            logger.info("Loaded Hugging Face weights from %s", directory)
            return Loaded(directory, states=(MODEL,), kind=kind)
        if manifest is not None and shared:
            verify_shared(self.storage, directory, manifest, self.pg)
        entries = plan.entries(cfg, self._shared_states(), self._data_parallel_degree())
        names = list(entries)
        model_sd = self.model.state_dict()
        state = {**model_sd, **entries}
        self._read(directory, state)
        self.model.load_state_dict({k: state[k] for k in model_sd})
        self._remember(directory, manifest)
        if self.ft is not None and self.ft.loads_dataloader(
            kind, manifest, cfg.exclude_from_loading
        ):
            assert manifest is not None  # loads_dataloader checks it
            self.ft.load_dataloader(
                self.storage,
                self.folder,
                manifest.step,
                checksums=checksums,
                decide=self._decide,
                trust_pickles=self.config.trust_pickles,
            )
            names.append(DATALOADER)
        logger.info(
            "Loaded %s (%s) in %.2f s",
            directory,
            ", ".join([MODEL, *names]),
            time.monotonic() - begin,
        )
        step = self.last_loaded_step
        metadata = manifest.metadata if manifest is not None else None
        return Loaded(directory, step, (MODEL, *names), kind, metadata)

    def _remember(self, directory: str, manifest: Manifest | None) -> None:
        self.last_loaded_step = None
        if manifest is not None:
            self.last_loaded_step = manifest.step
            self.loaded_metadata = manifest.metadata
        elif (found := step_of(directory.rstrip("/").rsplit("/", 1)[-1])) is not None:
            self.last_loaded_step = found  # e.g. torchtitan's step-<N>

    def _read(self, directory: str, state: dict[str, Any]) -> None:
        reader = self.storage.dcp_reader(directory, trust_pickles=self.config.trust_pickles)
        with quiet_dcp(self._distributed), unwrap_read_errors(directory):
            dcp.load(
                state, storage_reader=reader, process_group=self.pg, no_dist=not self._distributed
            )
