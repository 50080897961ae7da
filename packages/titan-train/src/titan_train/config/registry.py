"""Models the trainer can train, found through the ``titan.models`` entry-point group.

A distribution registers ``name = "package.module:SPEC"`` under ``titan.models``, where
``SPEC`` is a ``titan_models.ModelSpec`` (or any object with the same attributes). Nothing
is imported until a model is asked for, so a broken third-party plugin cannot break the
others.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from titan_models import ModelSpec
from titan_train.errors import UnknownModelError

__all__ = ["MODELS_ENTRY_POINT_GROUP", "UnknownModelError", "list_models", "load_model_spec"]

MODELS_ENTRY_POINT_GROUP = "titan.models"


def list_models() -> list[str]:
    """Names of every registered model, sorted."""
    return sorted({ep.name for ep in entry_points(group=MODELS_ENTRY_POINT_GROUP)})


def load_model_spec(name: str) -> ModelSpec:
    """The spec registered as ``name``: its flavors, model class and parallelize plan (a
    ``titan_models.ModelSpec``, or an object with the same attributes)."""
    found = [ep for ep in entry_points(group=MODELS_ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        known = ", ".join(list_models()) or "none (install titan-models)"
        raise UnknownModelError(
            f"model.name={name!r} is not a registered model; registered: {known}. A model "
            f"package registers itself under the '{MODELS_ENTRY_POINT_GROUP}' entry-point group."
        )
    spec: ModelSpec = found[0].load()
    return spec
