"""The state-dict adapter seam: model-aware conversion to and from Hugging Face checkpoints.

titan-ckpt knows no model. A model package implements ``StateDictAdapter`` structurally (it
need not import this module) and registers a factory under the entry-point group
``titan.state_dict_adapters``: name = model name (e.g. ``llama3``), value = a callable
``(*, flavor=None, hf_config=None) -> StateDictAdapter``.

The factory gets one of the two descriptions of the model: ``flavor``, a name the model
package defines, or ``hf_config``, a Hugging Face ``config.json`` as a dict (from an HF
folder, or from ``titan-ckpt convert --hf-config FILE`` for shapes no flavor has). A factory
that cannot build an adapter from what it got raises ``ValueError`` (or ``KeyError``) saying
why; ``titan-ckpt convert`` reports that as a usage error naming the adapter and the input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["ADAPTER_ENTRY_POINT_GROUP", "StateDictAdapter", "load_state_dict_adapter"]

ADAPTER_ENTRY_POINT_GROUP = "titan.state_dict_adapters"


@runtime_checkable
class StateDictAdapter(Protocol):
    """Converts a model's native FQN state dict to Hugging Face names and layout and back."""

    def to_hf(self, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Native (full, unsharded) state dict -> Hugging Face state dict."""
        ...

    def from_hf(self, hf_state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Hugging Face state dict -> native state dict."""
        ...

    def hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` content for this model."""
        ...


def load_state_dict_adapter(
    name: str,
    *,
    flavor: str | None = None,
    hf_config: Mapping[str, Any] | None = None,
) -> StateDictAdapter:
    """Build the adapter that an installed package registered as ``name``."""
    found = {ep.name: ep for ep in entry_points(group=ADAPTER_ENTRY_POINT_GROUP)}
    if name not in found:
        known = ", ".join(sorted(found)) or "none installed"
        raise LookupError(
            f"No state-dict adapter named {name!r} (group {ADAPTER_ENTRY_POINT_GROUP}); "
            f"available: {known}. Install the package that defines the model."
        )
    factory: Callable[..., Any] = found[name].load()
    adapter = factory(flavor=flavor, hf_config=hf_config)
    if not isinstance(adapter, StateDictAdapter):
        raise TypeError(
            f"The adapter factory {found[name].value} returned {type(adapter).__name__}, which "
            "lacks to_hf/from_hf/hf_config."
        )
    return adapter
