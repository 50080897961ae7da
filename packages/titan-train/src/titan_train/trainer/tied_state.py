"""The optimizer state of a tied weight split over pipeline stages, saved as one model saves it.

Without pipeline parallel a tied weight is one parameter, and its optimizer state is saved
under its first name only (``state.tok_embeddings.weight.exp_avg``, no ``output.weight``
entry). Under pipeline parallel the last stage holds a copy of it (``output.weight``) with
its own, identical optimizer state (``titan_models.parallel.pipeline_tied``). So that a
checkpoint does not depend on the layout, :class:`TiedOptimizerState` saves the copy's
state under the first name too (DCP writes one of the equal entries) and loads it from
there: a checkpoint of either layout resumes in the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TiedOptimizerState", "tied_optimizer_state"]

_SECTIONS = ("state.", "param_groups.")


class TiedOptimizerState:
    """A checkpoint's ``"optimizer"`` entry with each tied copy's keys under the name of the
    weight it repeats (``names``: ``(first stage's, last stage's)`` per tied weight)."""

    def __init__(self, optimizers: Any, names: Sequence[tuple[str, str]]) -> None:
        self.optimizers = optimizers
        # "state.output.weight." -> "state.tok_embeddings.weight.", and the same for groups.
        self._renames = [
            (section + last + ".", section + first + ".")
            for first, last in names
            for section in _SECTIONS
        ]

    def state_dict(self) -> dict[str, Any]:
        """The container's state, each copy's entries under the first name."""
        out: dict[str, Any] = {}
        for key, value in self.optimizers.state_dict().items():
            renamed = self._rename(key)
            # A rank holding both ends has both entries, equal: keep the first end's.
            if renamed == key or renamed not in out:
                out[renamed] = value
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict of either layout: each copy takes the entries of the first name."""
        mine = self.optimizers.state_dict()
        loaded = {}
        for key in mine:
            source = self._rename(key)
            loaded[key] = state_dict[source] if source in state_dict else state_dict[key]
        self.optimizers.load_state_dict(loaded)

    def register_step_pre_hook(self, hook: Any) -> Any:
        """The container's: a checkpointer with background staging makes its steps wait for
        the staging through it (``CheckpointManager``)."""
        return self.optimizers.register_step_pre_hook(hook)

    def _rename(self, key: str) -> str:
        for copy_prefix, first_prefix in self._renames:
            if key.startswith(copy_prefix):
                return first_prefix + key[len(copy_prefix) :]
        return key


def tied_optimizer_state(optimizers: Any, pipeline: Any) -> Any:
    """What to checkpoint as ``"optimizer"``: ``optimizers`` itself, or wrapped in
    :class:`TiedOptimizerState` when ``pipeline`` splits a tied weight over its stages."""
    tied = getattr(pipeline, "tied", None)
    if tied is None:
        return optimizers
    return TiedOptimizerState(optimizers, tied.names)
