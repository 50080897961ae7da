"""``Prefetcher``: run an iterator in a background thread, a bounded number of items ahead.

The dataloader tokenizes and packs the next batches here while the step runs. A thread is
enough: the tokenizers and torch release the GIL while they work, and a thread shares the
dataloader's state without copying it. At most ``depth`` items wait; a producer's exception
is raised in the consumer at its item, with its traceback; ``close()`` (also reached when
the consuming generator is dropped) stops and joins the producer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Prefetcher"]

T = TypeVar("T")

_END = object()
_POLL_S = 0.1  # how often a blocked producer looks whether it was closed


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher(Generic[T]):
    """Items of ``make()``'s iterator, produced by a daemon thread ``depth`` (>= 1) items
    ahead; ``make`` runs in the thread, so its set-up work is off the caller's path."""

    def __init__(self, make: Callable[[], Iterator[T]], *, depth: int, name: str) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth}; a prefetcher needs depth >= 1")
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(make,), name=name, daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._stop.is_set():
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise StopIteration from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the producer and wait for it to end; safe to call more than once."""
        self._stop.set()
        while self._thread.is_alive():
            try:  # unblock a producer waiting for room
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=_POLL_S)

    @property
    def alive(self) -> bool:
        """Whether the producer thread still runs."""
        return self._thread.is_alive()

    def _produce(self, make: Callable[[], Iterator[T]]) -> None:
        try:
            for item in make():
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as e:  # handed to the consumer, raised there
            self._put(_Failure(e))

    def _put(self, item: object) -> bool:
        """Queue ``item`` unless closed first; False if closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False
