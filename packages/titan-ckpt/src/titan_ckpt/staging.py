"""Staging for async saves that refills the previous save's copy instead of building a new one.

An async save first copies ("stages") the state to CPU memory; training waits for that copy
(``async``) or for its end before the next optimizer step (``async_with_pinned_mem``). torch's
``DefaultStager`` deep-copies the whole state dict each time: it reuses its CPU storages, but
rebuilds every tensor object around them (a ``new_empty``, a ``set_``, the attributes of each
DTensor) in Python, which costs more than the bytes copied on a state of a few hundred tensors.

``ReusingStager`` keeps the state dict it staged last. When the next state has the same layout
(the same tensors in the same order, each of the same type, dtype, shapes, strides and, for a
DTensor, mesh and placements), it copies each tensor's values into the staged tensor and takes
every other value (a step count, a learning rate, a dataloader's state) from the new state,
deep-copied: one ``copy_`` per tensor and no new tensor object. Any difference stages afresh.

Why it is safe to overwrite the previous copy: saves never overlap (``CheckpointManager.save``
waits for the previous one to be written), and torch's stager already writes each save into
the storages of the one before.

Deferred entries (``deferred``, top-level keys, for ``async``): a refilling staging matches
and copies the entries under those keys on a background thread, after ``stage`` returned (a
``Future`` of the staged state), and stages such an entry afresh there when its layout
changed; everything else is matched and copied before it returns. The manager defers the
states of optimizers it has hooked, and then the model's parameters: those tensors change only
inside an optimizer's ``step()``, and the hook waits for the copy first. What training waits
for is then the model's buffers and the small values (a step count, the dataloader's state).
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.tensor import DTensor

__all__ = ["ReusingStager"]

_Pairs = list[tuple[torch.Tensor, torch.Tensor]]
"""(staged tensor, source tensor) pairs to copy, local tensors."""


class ReusingStager(DefaultStager):
    """torch's ``DefaultStager`` that refills its last staged state dict (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staged: Any = None
        self.reused = 0
        """How many stagings refilled the previous copy (the others staged afresh)."""
        self.deferred: frozenset[str] = frozenset()
        """Top-level keys whose tensors a refilling staging copies in the background (see the
        module docstring); only for a stager that otherwise stages synchronously."""
        self._deferrer: ThreadPoolExecutor | None = None

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        if self.deferred and not self._config.use_async_staging and self._staged is not None:
            split = _split_rebuild(self._staged, state_dict, self.deferred)
            if split is not None:
                refilled, now, later = split
                self._copy(now)
                self._staged = refilled
                self.reused += 1
                if not later:
                    return refilled
                if self._deferrer is None:
                    self._deferrer = ThreadPoolExecutor(1, thread_name_prefix="titan-ckpt-stage")
                return self._deferrer.submit(self._finish, refilled, later)
        return super().stage(state_dict, **kwargs)

    def _finish(self, refilled: dict[str, Any], later: list[_Deferred]) -> Any:
        """Refill (or, for another layout, stage afresh) each deferred entry, in place in
        ``refilled``, which holds the previous staging's entry until then."""
        for key, staged, new in later:
            pairs: _Pairs = []
            item = _rebuild(staged, new, pairs)
            if item is _MISMATCH:
                item = super()._stage(new)  # torch's deep copy of this entry alone
            else:
                self._copy(pairs)
            refilled[key] = item
        return refilled

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        if self._staged is not None:
            pairs: _Pairs = []
            refilled = _rebuild(self._staged, state_dict, pairs)
            if refilled is not _MISMATCH:
                self._copy(pairs)
                self._staged = refilled
                self.reused += 1
                return refilled
        self._staged = super()._stage(state_dict, **kwargs)
        return self._staged

    @torch.no_grad()
    def _copy(self, pairs: _Pairs) -> None:
        """Copy each source into its staged tensor, as ``DefaultStager._stage`` copies: on the
        staging stream with non-blocking copies when configured so, then synchronized."""
        non_blocking = self._config.use_non_blocking_copy
        stream = self._staging_stream
        with stream if stream is not None else nullcontext():
            for staged, source in pairs:
                staged.copy_(source, non_blocking=non_blocking)
        if non_blocking:
            stream.synchronize() if stream is not None else torch.accelerator.synchronize()

    def close(self) -> None:
        if self._deferrer is not None:
            self._deferrer.shutdown(wait=True)
            self._deferrer = None
        self._staged = None
        super().close()


_MISMATCH = object()


def _rebuild(staged: Any, new: Any, pairs: _Pairs) -> Any:
    """``new`` with each tensor replaced by its counterpart in ``staged`` (same position), or
    ``_MISMATCH`` when the layouts differ. Appends (staged local tensor, new local tensor) to
    ``pairs`` for each tensor; other values are deep-copied from ``new``."""
    if isinstance(new, torch.Tensor):
        pair = _local_pair(staged, new)
        if pair is None:
            return _MISMATCH
        pairs.append(pair)
        return staged
    if type(new) is dict:
        if type(staged) is not dict or list(staged) != list(new):
            return _MISMATCH
        out = {}
        for key, value in new.items():
            item = _rebuild(staged[key], value, pairs)
            if item is _MISMATCH:
                return _MISMATCH
            out[key] = item
        return out
    if type(new) in (list, tuple):
        if type(staged) is not type(new) or len(staged) != len(new):
            return _MISMATCH
        items = [_rebuild(s, v, pairs) for s, v in zip(staged, new, strict=True)]
        if any(item is _MISMATCH for item in items):
            return _MISMATCH
        return items if type(new) is list else tuple(items)
    if isinstance(staged, torch.Tensor):
        return _MISMATCH  # a tensor became something else
    return copy.deepcopy(new)  # any other value (a custom container too): a fresh copy


_Deferred = tuple[str, Any, Any]
"""(top-level key, its previous staged entry, its new entry), rebuilt in the background."""


def _split_rebuild(
    staged: Any, new: Any, deferred: frozenset[str]
) -> tuple[dict[str, Any], _Pairs, list[_Deferred]] | None:
    """``_rebuild`` of a top-level dict but for its ``deferred`` keys, which are left for
    the background (their previous staged entries stand in until then): (refilled, pairs
    to copy now, deferred entries), or None when the layouts differ outside them."""
    if type(new) is not dict or type(staged) is not dict or list(staged) != list(new):
        return None
    now: _Pairs = []
    later: list[_Deferred] = []
    out = {}
    for key, value in new.items():
        if key in deferred:
            later.append((key, staged[key], value))
            out[key] = staged[key]
            continue
        item = _rebuild(staged[key], value, now)
        if item is _MISMATCH:
            return None
        out[key] = item
    return out, now, later


def _local_pair(staged: Any, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(staged, new) as local tensors when ``staged`` can hold ``new``'s values as they are
    laid out, else None."""
    if type(staged) is not type(new) or staged.dtype != new.dtype:
        return None
    if isinstance(new, DTensor):
        mesh = staged.device_mesh is new.device_mesh or staged.device_mesh == new.device_mesh
        if not mesh or staged.placements != new.placements or staged.shape != new.shape:
            return None
        staged, new = staged._local_tensor, new._local_tensor  # to_local() without autograd
    if staged.shape != new.shape or staged.stride() != new.stride():
        return None
    return staged, new
