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
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.tensor import DTensor

__all__ = ["ReusingStager"]


class ReusingStager(DefaultStager):
    """torch's ``DefaultStager`` that refills its last staged state dict (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staged: Any = None
        self.reused = 0
        """How many stagings refilled the previous copy (the others staged afresh)."""

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        if self._staged is not None:
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            refilled = _rebuild(self._staged, state_dict, pairs)
            if refilled is not _MISMATCH:
                self._copy(pairs)
                self._staged = refilled
                self.reused += 1
                return refilled
        self._staged = super()._stage(state_dict, **kwargs)
        return self._staged

    @torch.no_grad()
    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
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
        self._staged = None
        super().close()


_MISMATCH = object()


def _rebuild(staged: Any, new: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
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
