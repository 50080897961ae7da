"""``ModelSpec``: what a trainer needs to know about a model family, in one small object.

titan-train finds specs through the entry-point group ``titan.models`` (this package
registers ``llama3``), so a model defined in another distribution trains the same way once
installed. A spec holds only references; nothing is built until the trainer asks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from titan_dims import ParallelDims
from titan_models.errors import ModelConfigError

__all__ = ["ModelSpec", "check_fields", "flavor_args"]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model family: its flavors, its module class, its parallelize plan and its
    Hugging Face state-dict adapter."""

    name: str
    """The name the trainer selects it by (``--model.name``)."""
    flavors: Mapping[str, Any]
    """Flavor name -> model args (a dataclass the model class takes)."""
    model_cls: Callable[[Any], nn.Module]
    """Builds the model from args: ``model_cls(args)``; call it under ``torch.device("meta")``."""
    parallelize_fn: Callable[..., nn.Module]
    """``parallelize_fn(model, parallel_dims, parallelize_config, *, seq_len=None)``."""
    state_dict_adapter: Callable[..., Any]
    """``state_dict_adapter(*, flavor=None, hf_config=None, model_args=None, overrides=None,
    tensor_shapes=None)`` -> an object with ``to_hf``, ``from_hf`` and ``hf_config`` (see
    ``titan_ckpt.adapter``); a trainer passes the args the model was built with."""
    args_fn: Callable[..., Any]
    """``args_fn(flavor, **overrides)`` -> a fresh copy of the flavor's args, a dataclass
    (recorded with checkpoints as JSON). The trainer overrides ``vocab_size`` and
    ``max_seq_len``, and ``rope_scaling`` (``"none"`` or ``"llama3"``) when
    ``model.rope_scaling`` asks."""
    check_fn: Callable[..., None] | None = None
    """``check_fn(args, parallel_dims, parallelize_config, *, seq_len=None,
    pipeline_config=None, local_batch_size=None)``: raise ``ModelConfigError`` when ``args``
    cannot be trained with this layout (the rules every family shares are
    ``titan_models.parallel.check_layout`` and ``check_pipeline``). No process group or
    model needed: a trainer calls it before any work. ``None``: the plans check as they
    build."""
    post_step_fn: (
        Callable[[Sequence[nn.Module], ParallelDims], Callable[[], None] | None] | None
    ) = None
    """``post_step_fn(model_parts, parallel_dims)`` -> what to run after every optimizer step
    taken (a step post-hook), or ``None``; e.g. the MoE bias update. If it has a
    ``replica_summed_buffers()`` method, a trainer with torchft replica groups sums those
    tensors over the groups before each commit, so every group updates alike."""
    metrics_fn: Callable[[Sequence[nn.Module]], Mapping[str, float]] | None = None
    """``metrics_fn(model_parts)`` -> named numbers a trainer logs at its reporting steps
    (e.g. the share of tokens each expert received). It may read the device: call it only
    when logging."""
    pipeline_fn: Callable[..., Any] | None = None
    """``pipeline_fn(model, parallel_dims, pipeline_config, parallelize_config, *,
    local_batch_size, loss_fn, device=None, seq_len=None)`` -> a ``Pipeline``; ``None`` if
    the family cannot be pipelined."""


def check_fields(cls: type, names: Iterable[str], what: str | None = None) -> None:
    """Raise ``ModelConfigError`` naming every one of ``names`` that ``cls`` (an args
    dataclass) has no field for; ``what`` says where they came from."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(names) - known)
    if unknown and what is None:
        raise ModelConfigError(
            f"Unknown {cls.__name__} field(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(known))}."
        )
    if unknown:
        raise ModelConfigError(
            f"{what} have field(s) {', '.join(unknown)} that {cls.__name__} lacks; were they "
            "written by another version or model?"
        )


def flavor_args(family: str, flavors: Mapping[str, Any], flavor: str, overrides: dict) -> Any:
    """A fresh copy of ``flavors[flavor]`` with ``overrides`` applied (a family's ``args_fn``
    after it has taken the overrides it reads itself, e.g. ``rope_scaling``)."""
    if flavor not in flavors:
        raise ModelConfigError(
            f"Unknown {family} flavor {flavor!r}; choose one of {', '.join(map(repr, flavors))}."
        )
    base = flavors[flavor]
    check_fields(type(base), overrides)
    return dataclasses.replace(base, **overrides)
