"""How each ``async_mode`` maps onto DCP's async save, and the checks it needs up front.

- ``async``: DCP writes from a background thread after a copy of the state to CPU memory.
  The model's buffers (and every value but the optimizers' states and the model's
  parameters) are copied before ``save()`` returns; the states of the optimizers the manager
  hooks, and while there are any the model's parameters, which only their ``step()``
  changes, are copied in the background (``ReusingStager.deferred``), and the next
  ``step()`` waits for that copy.
- ``async_with_pinned_mem``: staging itself runs in the background (``maybe_wait_for_staging``
  waits for it before the next optimizer step; the manager's optimizers call it themselves,
  through a step pre-hook; the model's buffers, which a forward may change, are copied in
  ``save()``) into pinned memory where an accelerator exists,
  and a separate process writes, so the writer never holds the trainer's GIL. On a CPU-only
  machine there is nothing to pin: staging uses plain (shared) memory and this is logged once.

Both stage through ``titan_ckpt.staging.ReusingStager``: from the second save on, staging
copies the values into the previous save's staged tensors instead of rebuilding them.

A single process without ``torch.distributed`` writes from a thread (DCP's writer process
joins the trainer's process group, so it needs one). The writer process is started with
``spawn``, which re-imports the launching script; a script without an
``if __name__ == "__main__":`` guard would start training again inside it and hang.
``check_main_guard`` refuses that before the first save instead.

``AsyncSaver`` is the machinery of one manager's async saves: the stager, the save in flight
(its staging and its upload), rank 0's committer thread, and the optimizer-step guards. The
manager keeps the policy (what and when to save, the commit, retention, loading).
"""

from __future__ import annotations

import ast
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.tensor import DTensor

from titan_ckpt.errors import DiskFullError
from titan_ckpt.formats.hashing import written_files
from titan_ckpt.space import WRITE_ERRORS
from titan_ckpt.staging import ReusingStager
from titan_ckpt.states import ModelState, OptimizerState

__all__ = [
    "AsyncSaver",
    "CheckedStager",
    "check_main_guard",
    "check_shared_memory",
    "make_stager",
]

logger = logging.getLogger("titan_ckpt")


def make_stager(
    async_mode: str, *, distributed: bool
) -> tuple[AsyncCheckpointerType, DefaultStager | None]:
    """The DCP executor type and stager for an async mode (``disabled`` is not async)."""
    if async_mode == "async":
        # Synchronous staging, less the entries the manager defers (its hooked optimizers'
        # states): training may change every other tensor as soon as save() returns.
        no_extras = StagingOptions(False, False, False, False)
        return AsyncCheckpointerType.THREAD, ReusingStager(no_extras)
    accelerator = torch.accelerator.is_available()
    if not accelerator:
        logger.info(
            "checkpoint.async_mode=async_with_pinned_mem on a machine without an accelerator: "
            "nothing to pin, staging into ordinary shared memory in the background instead."
        )
    options = StagingOptions(
        use_pinned_memory=accelerator,
        use_shared_memory=True,
        use_async_staging=True,
        use_non_blocking_copy=accelerator,
    )
    if not distributed:
        # DCP's writer process joins the trainer's process group; a single process without
        # one writes from a thread instead (staging stays in the background either way).
        logger.info(
            "checkpoint.async_mode=async_with_pinned_mem without a process group: writing from "
            "a background thread instead of a process."
        )
        return AsyncCheckpointerType.THREAD, CheckedStager(options)
    return AsyncCheckpointerType.PROCESS, CheckedStager(options)


SHARED_MEMORY = "/dev/shm"


class CheckedStager(ReusingStager):
    """torch's background stager, made safe to call right after an optimizer step:

    - It copies on its own stream, which does not wait for the kernels already queued on the
      device (the optimizer's): staging could read half-updated weights. Staging first waits
      for the device's queued work.
    - It stages each rank's whole state in shared memory (``/dev/shm``), which a container
      may give 64 MB: the first save checks the space the node's ranks need and raises
      ``DiskFullError`` with the fix, instead of a bus error mid-copy.
    """

    def __init__(self, options: StagingOptions) -> None:
        super().__init__(options)
        self._checked_space = not options.use_shared_memory

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        if not self._checked_space:
            check_shared_memory(state_dict)
            self._checked_space = True
        return super().stage(state_dict, **kwargs)


def check_shared_memory(state_dict: Any, folder: str = SHARED_MEMORY) -> None:
    """Raise ``DiskFullError`` unless ``folder`` has room for ``state_dict``'s tensors from
    every rank on this node (``LOCAL_WORLD_SIZE``, as torchrun sets it)."""
    if not os.path.isdir(folder):
        return  # not Linux: torch's shared memory lives elsewhere
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    needed = ranks * _tensor_bytes(state_dict)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise DiskFullError(
            f"checkpoint.async_mode=async_with_pinned_mem stages each rank's state in "
            f"{folder}: this node's {ranks} rank(s) need {needed / 2**20:,.0f} MiB there and "
            f"{free / 2**20:,.0f} MiB are free (a container's default may be 64 MiB). Enlarge "
            f"it (docker run --shm-size=...), or use checkpoint.async_mode='async'.",
            path=folder,
            needed=needed,
            free=free,
        )


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def check_main_guard() -> None:
    """Raise if the running script lacks the ``__main__`` guard a spawned writer needs."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    # Interactive sessions, ``python -c`` and ``python -m pkg`` (run with a __spec__, imported by
    # name in the child) are not re-executed as scripts.
    if path is None or getattr(main, "__spec__", None) is not None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return  # cannot tell; do not refuse what may well be fine
    if not any(_is_main_guard(node) for node in tree.body):
        raise RuntimeError(
            f"checkpoint.async_mode=async_with_pinned_mem writes from a spawned process, which "
            f're-imports {path}; that script has no `if __name__ == "__main__":` guard, so the '
            "process would run the training code again and hang. Put the script's top-level "
            "code under that guard, or use async_mode='async' (a thread)."
        )


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    names = [node.test.left, *node.test.comparators]
    return any(isinstance(n, ast.Name) and n.id == "__name__" for n in names) and any(
        isinstance(n, ast.Constant) and n.value == "__main__" for n in names
    )


Inflight = tuple[str, int, int | None]
"""The save in flight: its step directory, step and the bytes it needs (None: unknown)."""


class AsyncSaver:
    """One manager's async saves (``async_mode`` other than ``disabled``): at most one in
    flight; rank 0 commits it (``commit(directory, manifest, written)``, in a thread) once
    every rank wrote. The optimizers among ``states`` wait for its staging before they step.
    """

    def __init__(
        self,
        async_mode: str,
        *,
        model: ModelState,
        states: Mapping[str, Any],
        distributed: bool,
        committer: bool,
        commit: Callable[[str, Any, dict[str, dict] | None], None],
    ) -> None:
        self.async_mode = async_mode
        self._model = model
        self._commit = commit
        self._type, self._stager = make_stager(async_mode, distributed=distributed)
        self._committer = (
            ThreadPoolExecutor(1, thread_name_prefix="titan-ckpt-commit") if committer else None
        )
        self._staging: Future | None = None
        self._pending: Future | None = None
        self._inflight: Inflight | None = None
        self._step_guards: list[Any] = []  # handles of the optimizer-step pre-hooks
        guarded = self._guard_optimizer_steps(states)
        self._guarded: frozenset[str] = frozenset()  # states whose optimizers all wait
        if async_mode == "async" and isinstance(self._stager, ReusingStager):
            # Their tensors change only in step(), which now waits for the copy.
            self._guarded = frozenset(guarded)
            self._stager.deferred = self._guarded

    @property
    def staging_in_background(self) -> bool:
        """Whether the last save's staging still runs after ``save`` returned."""
        return self._staging is not None

    def save(
        self,
        state: dict[str, Any],
        *,
        writer: Any,
        process_group: dist.ProcessGroup | None,
        no_dist: bool,
        inflight: Inflight,
        manifest: Any,
    ) -> None:
        """Stage ``state`` and start writing it with ``writer`` (the previous save finished)."""
        assert self._pending is None, "finish() the previous save first"
        if self.async_mode == "async_with_pinned_mem":
            state = self._buffers_copied(state)
        elif self._guarded and isinstance(self._stager, ReusingStager):
            self._stager.deferred = self._guarded | self._parameter_keys(state)
        response = dcp.async_save(
            state,
            storage_writer=writer,
            process_group=process_group,
            async_checkpointer_type=self._type,
            async_stager=self._stager,
            no_dist=no_dist,
        )
        if isinstance(response, Future):
            upload, self._staging = response, None
        else:
            upload, self._staging = response.upload_completion, response.staging_completion
        self._inflight = inflight
        if self._committer is not None:  # rank 0 commits once the upload finished everywhere
            directory = inflight[0]
            self._pending = self._committer.submit(self._commit_after, upload, directory, manifest)
        else:
            self._pending = upload

    def _commit_after(self, upload: Future, directory: str, manifest: Any) -> None:
        # Runs in the committer thread; a failure is raised (as CheckpointWriteError) by wait().
        # Raises if any rank failed to write: then nothing is committed. Else DCP's metadata,
        # which carries every rank's digests, also from DCP's writer process.
        result = upload.result()
        self._commit(directory, manifest, written_files(result))

    def maybe_wait_for_staging(self) -> None:
        """Block until the last save no longer reads the training tensors."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def finish(self) -> tuple[Inflight, BaseException | None] | None:
        """Wait for the save in flight to be written and committed: None if there was none,
        else what it was and the write error it ended with (None: committed)."""
        self.maybe_wait_for_staging()
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        assert self._inflight is not None  # set with _pending
        inflight, self._inflight = self._inflight, None
        try:
            pending.result()
        except WRITE_ERRORS as error:  # reported like a synchronous save's, on every rank
            return inflight, error
        return inflight, None

    def close(self) -> None:
        """Stop the committer thread and the stager; remove the step guards (after finish)."""
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        for handle in self._step_guards:
            handle.remove()
        self._step_guards = []

    def _guard_optimizer_steps(self, states: Mapping[str, Any]) -> list[str]:
        """Make every optimizer among the states wait for the staging before it steps (a
        pre-hook), so a loop that forgets ``maybe_wait_for_staging`` cannot save a mix of two
        steps' values. An optimizer is a state with ``register_step_pre_hook`` (torch's,
        titan-optim's container) or one inside an ``OptimizerState``. Returns the names of the
        states whose optimizers all carry the hook: their staging may run in the background."""
        guarded = []
        for name, state in states.items():
            targets = (
                [opt for _, opt in state.pairs] if isinstance(state, OptimizerState) else [state]
            )
            hooked = 0
            for target in targets:
                register = getattr(target, "register_step_pre_hook", None)
                if callable(register):
                    self._step_guards.append(register(self._wait_before_step))
                    hooked += 1
            if targets and hooked == len(targets):
                guarded.append(name)
        return guarded

    def _wait_before_step(self, *_: Any) -> None:
        self.maybe_wait_for_staging()

    def _buffers_copied(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with the model's buffers replaced by copies taken now. Background staging
        reads the state while the next step's forward runs, and a forward may change a
        buffer in place (an MoE layer's token counts, a norm's running statistics); the
        parameters change only in the optimizer's step, which waits for the staging. Buffers
        are small: copying them here costs little."""
        buffers = _addresses(b for part in self._model.model_parts for b in part.buffers())
        return {
            key: value.clone()
            if isinstance(value, torch.Tensor) and _storage_address(value) in buffers
            else value
            for key, value in state.items()
        }

    def _parameter_keys(self, state: dict[str, Any]) -> frozenset[str]:
        """The keys of ``state`` holding the model's parameters (and no buffer's values),
        which ``async`` copies in the background like the guarded optimizers' states: a
        parameter changes only in an optimizer's ``step()``, which waits for the copy (the
        same premise as torch's background staging of ``async_with_pinned_mem``). A forward
        may change a buffer in place, so buffers are copied before ``save()`` returns."""
        parts = self._model.model_parts
        params = _addresses(p for part in parts for p in part.parameters())
        params -= _addresses(b for part in parts for b in part.buffers())
        return frozenset(
            key
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and _storage_address(value) in params
        )


def _addresses(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The storage addresses of ``tensors`` (``_storage_address``), those without one left out."""
    return {address for t in tensors if (address := _storage_address(t)) is not None}


def _storage_address(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s (local) values live: equal for a module's tensor and its entry in a
    state dict. None for a tensor without one storage (a wrapper subclass, say)."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
