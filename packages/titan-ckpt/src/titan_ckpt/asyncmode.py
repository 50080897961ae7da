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
"""

from __future__ import annotations

import ast
import logging
import os
import shutil
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from titan_ckpt.errors import DiskFullError
from titan_ckpt.staging import ReusingStager

__all__ = ["CheckedStager", "check_main_guard", "check_shared_memory", "make_stager"]

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
