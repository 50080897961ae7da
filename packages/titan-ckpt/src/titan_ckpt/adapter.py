"""The state-dict adapter seam: model-aware conversion to and from Hugging Face checkpoints.

titan-ckpt knows no model. A model package implements ``StateDictAdapter`` structurally and
registers a factory under the entry-point group ``titan.state_dict_adapters`` (name = model
name, e.g. ``llama3``): ``(*, flavor=None, hf_config=None, model_args=None, overrides=None,
tensor_shapes=None) -> StateDictAdapter``. ``flavor`` is a name the model package defines;
``hf_config`` a ``config.json`` as a dict; ``model_args`` the model's recorded arguments
(JSON); ``overrides`` (e.g. ``{"rope_scaling": "none"}``) win over them; ``tensor_shapes``
(native key -> shape, to HF) are the checkpoint's, which the factory checks the descriptions
against. A factory may lack ``model_args`` and ``tensor_shapes``. One that cannot build an
adapter raises ``ValueError`` (or ``KeyError``) saying why: ``convert`` exits 2. An adapter
may have ``model_args()``, which ``convert`` records in a DCP checkpoint it writes from HF.

``to_hf`` / ``from_hf`` convert whole dicts (the caller holds the model once). The optional
``to_hf_items`` / ``from_hf_items`` (``StreamingStateDictAdapter``) map ``(key, full tensor)``
pairs lazily, holding what an output needs (stacked experts) until it is complete. Their
output (keys, shapes, dtypes, order) must depend only on the input's, never on values, and
they must work on ``meta`` tensors: writers need every shape first, so titan-ckpt runs the
stream over ``meta`` tensors (``plan_items``) and then over the real ones, in the same order.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from titan_ckpt.formats.base import TensorSpec

__all__ = [
    "ADAPTER_ENTRY_POINT_GROUP",
    "OPTIONAL_FACTORY_ARGS",
    "StateDictAdapter",
    "StreamingStateDictAdapter",
    "from_hf_items",
    "load_state_dict_adapter",
    "plan_items",
    "streams",
    "to_hf_items",
]

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


@runtime_checkable
class StreamingStateDictAdapter(StateDictAdapter, Protocol):
    """A ``StateDictAdapter`` that also converts tensor by tensor (see the module docstring
    for the two rules a stream follows)."""

    def to_hf_items(self, items: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Native ``(key, full tensor)`` pairs -> Hugging Face pairs, lazily."""
        ...

    def from_hf_items(self, items: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Hugging Face ``(key, tensor)`` pairs -> native pairs, lazily."""
        ...


def streams(adapter: StateDictAdapter) -> bool:
    """Whether ``adapter`` converts tensor by tensor (else the whole-dict fallback is used)."""
    return isinstance(adapter, StreamingStateDictAdapter)


def to_hf_items(
    adapter: StateDictAdapter, items: Iterable[tuple[str, Tensor]]
) -> Iterator[tuple[str, Tensor]]:
    """Native pairs -> Hugging Face pairs through ``adapter``, streaming when it can."""
    if streams(adapter):
        return iter(adapter.to_hf_items(items))  # type: ignore[attr-defined]
    return iter(adapter.to_hf(dict(items)).items())  # fallback: one model copy


def from_hf_items(
    adapter: StateDictAdapter, items: Iterable[tuple[str, Tensor]]
) -> Iterator[tuple[str, Tensor]]:
    """Hugging Face pairs -> native pairs through ``adapter``, streaming when it can."""
    if streams(adapter):
        return iter(adapter.from_hf_items(items))  # type: ignore[attr-defined]
    return iter(adapter.from_hf(dict(items)).items())  # fallback: one model copy


def plan_items(
    convert: Callable[[Iterable[tuple[str, Tensor]]], Iterator[tuple[str, Tensor]]],
    specs: Iterable[tuple[str, TensorSpec]],
) -> dict[str, TensorSpec]:
    """The output keys, shapes and dtypes (in output order) of a streaming conversion,
    found by running it over ``meta`` tensors of the input ``specs`` (no data is read)."""
    inputs = ((k, torch.empty(shape, dtype=dtype, device="meta")) for k, (shape, dtype) in specs)
    out: dict[str, TensorSpec] = {}
    for key, value in convert(inputs):
        if key in out:
            raise ValueError(f"The state-dict adapter yielded {key!r} twice.")
        out[key] = (tuple(value.shape), value.dtype)
    return out


OPTIONAL_FACTORY_ARGS = ("model_args", "tensor_shapes")
"""Factory keywords a factory may lack: it is then called without them (no recorded args,
no check against the tensors)."""


def load_state_dict_adapter(
    name: str,
    *,
    flavor: str | None = None,
    hf_config: Mapping[str, Any] | None = None,
    model_args: Any | None = None,
    overrides: Mapping[str, Any] | None = None,
    tensor_shapes: Mapping[str, tuple[int, ...]] | None = None,
    recorded_flavor: str | None = None,
) -> StateDictAdapter:
    """Build the adapter that an installed package registered as ``name``; the keywords
    that are not ``None`` go to its factory (see the module docstring).

    ``recorded_flavor`` is the flavor a checkpoint's model record names beside its args: it
    goes to the factory as ``flavor`` (unless one is given) only when the factory takes no
    ``model_args``. The recorded args are the model; a run that changed the flavor's sizes
    (titan-train's ``[model.args]``) would otherwise be contradicted by its own flavor."""
    found = {ep.name: ep for ep in entry_points(group=ADAPTER_ENTRY_POINT_GROUP)}
    if name not in found:
        known = ", ".join(sorted(found)) or "none installed"
        raise LookupError(
            f"No state-dict adapter named {name!r} (group {ADAPTER_ENTRY_POINT_GROUP}); "
            f"available: {known}. Install the package that defines the model."
        )
    factory: Callable[..., Any] = found[name].load()
    if flavor is None and not (model_args is not None and takes_keyword(factory, "model_args")):
        flavor = recorded_flavor
    given = {
        "flavor": flavor,
        "hf_config": hf_config,
        "model_args": model_args,
        "overrides": overrides,
        "tensor_shapes": tensor_shapes,
    }
    kwargs = {
        k: v
        for k, v in given.items()
        if v is not None and (k not in OPTIONAL_FACTORY_ARGS or takes_keyword(factory, k))
    }
    adapter = factory(**kwargs)
    if not isinstance(adapter, StateDictAdapter):
        raise TypeError(
            f"The adapter factory {found[name].value} returned {type(adapter).__name__}, which "
            "lacks to_hf/from_hf/hf_config."
        )
    return adapter


def takes_keyword(function: Callable[..., Any], name: str) -> bool:
    """Whether ``function`` accepts the keyword argument ``name``."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read: let the call decide
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return True
    p = parameters.get(name)
    return p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
