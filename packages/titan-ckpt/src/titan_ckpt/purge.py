"""Retention: delete committed steps beyond the newest ``keep_latest_k``, off the training path.

Only titan's committed steps are deleted, through ``layout.remove_step`` (no link followed,
nothing titan did not write); a step it must leave is warned about once. Runs in a daemon
thread on one rank; a failure is logged and the next request carries on.
"""

from __future__ import annotations

import logging
import queue
import threading

from titan_ckpt.layout import committed_steps, remove_step, step_dir
from titan_ckpt.storage import Storage

__all__ = ["Purger"]

logger = logging.getLogger("titan_ckpt")

_STOP = object()


class Purger:
    """Background deletion of old committed steps under one folder."""

    def __init__(self, storage: Storage, folder: str, keep_latest_k: int) -> None:
        if keep_latest_k < 2:
            raise ValueError(f"keep_latest_k={keep_latest_k}: the purger keeps at least 2.")
        self.storage, self.folder, self.keep = storage, folder, keep_latest_k
        self.failures: list[str] = []
        self.left: set[str] = set()
        """Steps ``remove_step`` left in place (a link, files not ours): not tried again."""
        self._queue: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="titan-ckpt-purge", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Ask for a purge pass; returns at once."""
        self._queue.put(None)

    def close(self) -> None:
        """Finish every pass already requested, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while self._queue.get() is not _STOP:
            try:
                self._purge_once()
            except Exception as e:  # the thread must outlive any one failed pass
                logger.exception("Checkpoint purge pass in %s failed", self.folder)
                self.failures.append(f"{self.folder}: {e}")

    def _purge_once(self) -> None:
        # Only steps with our commit marker count and go: never torchtitan's, a foreign
        # directory, or an interrupted save (see titan_ckpt.layout).
        committed = committed_steps(self.storage, self.folder)
        for step in committed[: max(0, len(committed) - self.keep)]:
            directory = step_dir(self.storage, self.folder, step)
            if directory in self.left:
                continue
            try:
                if not remove_step(self.storage, directory):
                    self.left.add(directory)
                    continue
                logger.info("Deleted checkpoint %s (keep_latest_k=%d)", directory, self.keep)
            except Exception as e:
                logger.warning("Could not delete checkpoint %s: %s", directory, e)
                self.failures.append(f"{directory}: {e}")
