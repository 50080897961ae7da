"""torchtitan's checkpoints: recognising one, and reading its training state into titan's.

torchtitan lays a step out like ours (model FQNs at the top, ``optimizer``, ``lr_scheduler``,
``dataloader``, ``train_state``); a step is torchtitan's when its metadata has
``train_state.step`` and ``lr_scheduler.last_epoch`` (titan's is ``lr_scheduler.step``). The
optimizer (flattened by FQN) loads as is; ``last_epoch`` becomes titan's ``{"step": n}``;
``train_state`` (``step``, and ``ntokens_seen`` on current main) is handed over as is. Its
dataloader state (torchdata or grain) is not portable: skipped with one warning (silently
when ``dataloader`` is in ``checkpoint.exclude_from_loading``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from titan_ckpt.config import DATALOADER
from titan_ckpt.errors import CheckpointConfigError, UnsafeCheckpointError
from titan_ckpt.storage import Storage

__all__ = [
    "TORCHTITAN_STATES",
    "TorchtitanCompat",
    "is_torchtitan_checkpoint",
    "read_state_keys",
]

logger = logging.getLogger("titan_ckpt")

TORCHTITAN_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
"""The states torchtitan saves beside the model."""

_SIGNATURE = ("train_state.step", "lr_scheduler.last_epoch")


def read_state_keys(storage: Storage, directory: str) -> set[str] | None:
    """The keys in the DCP metadata of ``directory``; None if it has no readable ``.metadata``.
    ``UnsafeCheckpointError`` if that metadata asks to unpickle what a checkpoint never needs."""
    if not storage.exists(storage.join(directory, ".metadata")):
        return None
    try:
        metadata = storage.dcp_reader(directory).read_metadata()
    except UnsafeCheckpointError:
        raise  # a pickle asking to run something: one error naming it, never "not ours"
    except Exception as e:  # a damaged or alien .metadata: not a checkpoint we understand
        logger.warning("Cannot read the DCP metadata of %s: %s", directory, e)
        return None
    return set(metadata.state_dict_metadata)


def is_torchtitan_checkpoint(keys: Iterable[str]) -> bool:
    """Whether DCP metadata keys are those of a torchtitan full-state checkpoint."""
    keys = set(keys)
    has_model = any(k.split(".", 1)[0] not in TORCHTITAN_STATES for k in keys)
    return has_model and all(k in keys for k in _SIGNATURE)


class _Translated:
    """A ``Stateful`` that reads torchtitan's keys for ``target`` and hands it titan's."""

    def __init__(self, target: Any, template: dict[str, Any], translate: Any) -> None:
        self.target, self.template, self.translate = target, template, translate

    def state_dict(self) -> dict[str, Any]:
        return dict(self.template)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.target.load_state_dict(self.translate(state_dict))


class TorchtitanCompat:
    """Which states of a torchtitan checkpoint load, and as what (see the module docstring).

    Args:
        keys: the checkpoint's DCP metadata keys (``read_state_keys``).
        directory: the checkpoint, for messages.
    """

    def __init__(self, keys: Iterable[str], directory: str) -> None:
        self.keys = set(keys)
        self.directory = directory

    @property
    def layout(self) -> str:
        """ "2025-07" (a whole ``LambdaLR`` state) or "current" (``last_epoch`` alone)."""
        return "2025-07" if "lr_scheduler._step_count" in self.keys else "current"

    def _has(self, name: str) -> bool:
        return any(k.startswith(f"{name}.") for k in self.keys)

    def states_for_load(self, names: Iterable[str], states: Mapping[str, Any]) -> dict[str, Any]:
        """The DCP load entries for ``states[name]`` of each name in ``names`` (the states
        to restore, excluded ones already left out); the dataloader is skipped."""
        out: dict[str, Any] = {}
        missing = []
        for name in names:
            if name == DATALOADER:
                logger.warning(
                    "%s is a torchtitan checkpoint: its dataloader state is not portable, so "
                    "the data stream starts from its beginning (add 'dataloader' to "
                    "checkpoint.exclude_from_loading to say so and silence this)",
                    self.directory,
                )
            elif name == "lr_scheduler" and self._has(name):
                out[name] = _Translated(
                    states[name], {"last_epoch": 0}, lambda sd: {"step": int(sd["last_epoch"])}
                )
            elif name == "train_state" and self._has(name):
                template = {"step": 0}
                if "train_state.ntokens_seen" in self.keys:
                    template["ntokens_seen"] = 0
                out[name] = _Translated(states[name], template, dict)
            elif self._has(name):
                out[name] = states[name]
            else:
                missing.append(name)
        if missing:
            raise CheckpointConfigError(
                f"{self.directory} is a torchtitan checkpoint without the {missing} state "
                f"(it holds {sorted(n for n in TORCHTITAN_STATES if self._has(n))}); add "
                f"{missing} to checkpoint.exclude_from_loading to start them fresh."
            )
        return out
