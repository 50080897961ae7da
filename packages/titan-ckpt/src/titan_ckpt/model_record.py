"""What a checkpoint says about its model: the record a trainer attaches to every step
(``Manifest.metadata["model"]``), and the shapes of its model tensors::

    {"name": "llama3", "flavor": "debugmodel", "args": {"dim": 256, ..., "rope_scaling": null}}

``name`` is the state-dict adapter, ``args`` the model's real arguments, which ``titan-ckpt
convert`` hands to the adapter so an HF export describes what was trained.
"""

from __future__ import annotations

from typing import Any

from titan_ckpt.formats.base import Source, group_of
from titan_ckpt.layout import json_metadata, read_manifest
from titan_ckpt.storage import LocalStorage

__all__ = ["MODEL_RECORD", "adapter_record", "model_record", "model_tensor_shapes"]

MODEL_RECORD = "model"
"""The key of the model's record in ``Manifest.metadata``."""


def model_record(source: Source) -> dict[str, Any] | None:
    """The model record of a titan DCP step (``{"name", "flavor", "args"}``), or ``None``
    when the source is no committed titan step or records no model (an older titan,
    torchtitan, a plain DCP directory, safetensors, torch.save)."""
    if source.format != "dcp":
        return None
    try:
        manifest = read_manifest(LocalStorage(), source.path)
    except (
        OSError,
        ValueError,
        TypeError,
    ):  # a foreign or damaged marker: as if none were recorded
        return None
    record = manifest.metadata.get(MODEL_RECORD) if manifest is not None else None
    if not isinstance(record, dict) or not isinstance(record.get("args"), dict):
        return None
    return record


def model_tensor_shapes(source: Source) -> dict[str, tuple[int, ...]]:
    """Native key -> shape of every model tensor of ``source`` (what an adapter checks a
    description against)."""
    return {
        key: tuple(entry.shape or ())
        for key, entry in source.entries.items()
        if entry.is_tensor and group_of(key) == "model"
    }


def adapter_record(adapter: Any, name: str, flavor: str | None) -> dict[str, Any] | None:
    """The model record of a checkpoint converted from HF by ``adapter`` (registered as
    ``name``), when the adapter tells its model's args (an optional ``model_args()`` method
    returning a JSON object, e.g. as read from the HF ``config.json``); else ``None``."""
    method = getattr(adapter, "model_args", None)
    if not callable(method):
        return None
    try:
        args = json_metadata(method())
    except (TypeError, ValueError):  # not a JSON object: record nothing rather than fail
        return None
    return {"name": name, "flavor": flavor, "args": args}
