"""Stateful views of model parts and their optimizers, keyed by fully-qualified name.

``ModelState`` flattens every model part (pipeline stages) into one FQN -> tensor dict, so a
checkpoint reshards across parallel layouts; ``OptimizerState`` does the same for optimizers
(torch's flattened optimizer state dict). ``as_states`` wraps a bare module or optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _flatten_optim_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from titan_ckpt.errors import CheckpointConfigError

__all__ = ["ModelState", "OptimizerState", "as_states"]


class ModelState:
    """The model parts as one ``Stateful``: a flat FQN -> tensor dict over all parts."""

    def __init__(self, model_parts: nn.Module | Sequence[nn.Module]) -> None:
        single = isinstance(model_parts, nn.Module)
        self.model_parts = [model_parts] if single else list(model_parts)
        if not self.model_parts:
            raise CheckpointConfigError(
                "model_parts is empty: pass the model, or its pipeline stages."
            )
        # Per part, once learned: the part's own state_dict() keys, those keys in the order
        # of torch's state dict, and their FQNs (``_learned_names``); None before the first
        # call, False once learning failed (not tried again: each try costs a state_dict()).
        self._names: list[_Names | bool | None] = [None] * len(self.model_parts)

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for index, part in enumerate(self.model_parts):
            sd = self._part_state_dict(index, part)
            clash = merged.keys() & sd.keys()
            if clash:
                raise CheckpointConfigError(
                    f"Model parts share the parameter names {sorted(clash)[:5]}: each "
                    "pipeline stage must keep its original FQNs so that they stay unique."
                )
            merged.update(sd)
        return merged

    def _part_state_dict(self, index: int, part: nn.Module) -> dict[str, Any]:
        """``get_model_state_dict(part)``, through ``part.state_dict()`` renamed by the FQNs
        learned from an earlier call while its keys are the same: torch's renaming walks every
        parameter's path each call (~6 ms of an async ``save()`` for 58 tensors, against ~1.5 ms
        for ``part.state_dict()``). The values always come from this call."""
        learned = self._names[index]
        if isinstance(learned, tuple) and not _has_fsdp1(part):
            own = part.state_dict()
            keys, order, fqns = learned
            if tuple(own) == keys:
                return {fqn: own[key] for fqn, key in zip(fqns, order, strict=True)}
        sd = get_model_state_dict(part)
        if learned is not False:
            self._names[index] = _learned_names(part, sd) or False
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each part takes the keys it owns (strict=False); together they must take every key,
        # and every part's own keys must be present.
        wanted: set[str] = set()
        for part in self.model_parts:
            keys = get_model_state_dict(part).keys()
            wanted |= keys
            missing = [k for k in keys if k not in state_dict]
            if missing:
                raise CheckpointConfigError(
                    f"Checkpoint lacks model keys {missing[:5]} (of {len(missing)})."
                )
            set_model_state_dict(
                part,
                {k: state_dict[k] for k in keys},
                options=StateDictOptions(strict=False),
            )
        unused = sorted(set(state_dict) - wanted)
        if unused:
            raise CheckpointConfigError(f"Model state has keys no model part owns: {unused[:5]}.")

    def export(self, dtype: torch.dtype) -> dict[str, Any]:
        """The flat state with floating-point tensors cast to ``dtype``."""
        return {
            k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in self.state_dict().items()
        }


_Names = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def _learned_names(part: nn.Module, fqn_state: dict[str, Any]) -> _Names | None:
    """(``part.state_dict()``'s keys, those keys in ``fqn_state``'s order, its FQNs) when both
    hold the same tensors one to one (checked position by position: views of the same
    memory), else None. Not for FSDP1 or non-tensor values."""
    if _has_fsdp1(part):
        return None
    own = part.state_dict()
    if len(own) != len(fqn_state):
        return None
    kept = [key for key in own if key in fqn_state]
    order = kept + [key for key in own if key not in fqn_state]
    if list(fqn_state)[: len(kept)] != kept:
        return None
    for key, theirs in zip(order, fqn_state.values(), strict=True):
        if not _same_tensor(own[key], theirs):
            return None
    return tuple(own), tuple(order), tuple(fqn_state)


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are views of the same memory with the same layout."""
    if not isinstance(a, torch.Tensor) or type(a) is not type(b):
        return False
    if isinstance(a, DTensor):
        if a.device_mesh != b.device_mesh or a.placements != b.placements:
            return False
        a, b = a._local_tensor, b._local_tensor
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.stride() == b.stride()
        and a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
    )


def _same_values(flat: dict[str, Any], fqn_state: dict[str, Any]) -> bool:
    """Whether two flattened states hold the same objects in the same order."""
    return len(flat) == len(fqn_state) and all(
        a is b for a, b in zip(flat.values(), fqn_state.values(), strict=True)
    )


def _parameters_of(part: nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, ...]:
    """What maps an optimizer's parameter indices to FQNs: the model's parameters (names and
    objects) and the optimizer's, in order. The objects are compared by ``id``: the
    optimizer keeps every one of its parameters alive, so an id seen again is the same
    parameter."""
    return (
        tuple((name, id(p)) for name, p in part.named_parameters()),
        tuple(id(p) for group in opt.param_groups for p in group["params"]),
    )


def _has_fsdp1(part: nn.Module) -> bool:
    return any(isinstance(m, FullyShardedDataParallel) for m in part.modules())


class OptimizerState:
    """Optimizers of the model parts (one each, same order) as one FQN-keyed ``Stateful``."""

    def __init__(
        self,
        model_parts: nn.Module | Sequence[nn.Module],
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    ) -> None:
        parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
        opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        if len(parts) != len(opts):
            raise CheckpointConfigError(
                f"Got {len(parts)} model parts but {len(opts)} optimizers: pass one optimizer "
                "per model part, in the same order."
            )
        self.pairs = list(zip(parts, opts, strict=True))
        self._options = StateDictOptions(flatten_optimizer_state_dict=True)
        # Per (part, optimizer): what the FQN keys were learned for, and the keys; None
        # once learning failed with the optimizer's state there (not tried again).
        self._names: dict[tuple[int, int], tuple[tuple[Any, ...], tuple[str, ...]] | None] = {}

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, opt in self.pairs:
            merged.update(self._pair_state_dict(part, opt))
        return merged

    def _pair_state_dict(self, part: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """``get_optimizer_state_dict(part, opt)`` (flattened), through ``opt.state_dict()``
        flattened by torch's own function (keyed by parameter index) with keys renamed as
        learned from an earlier call (torch's renaming costs ~3 ms of an async ``save()`` for
        58 parameters). Reused only while the flattened keys and the model's and
        optimizer's parameters are those it was learned for, and the optimizer has state."""
        key = (id(part), id(opt))
        learned = self._names.get(key)
        if learned is not None and opt.state and not _has_fsdp1(part):
            flat = _flatten_optim_state_dict(opt.state_dict())
            if learned[0] == (_parameters_of(part, opt), tuple(flat)):
                return dict(zip(learned[1], flat.values(), strict=True))
        sd = get_optimizer_state_dict(part, opt, options=self._options)
        if opt.state and not _has_fsdp1(part) and (key not in self._names or learned):
            # Learned when there is no try yet, or to relearn keys that changed; a failed
            # try is not repeated (each costs the optimizer's state_dict()).
            flat = _flatten_optim_state_dict(opt.state_dict())
            if _same_values(flat, sd):
                self._names[key] = ((_parameters_of(part, opt), tuple(flat)), tuple(sd))
            else:
                self._names[key] = None
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, opt in self.pairs:
            set_optimizer_state_dict(part, opt, state_dict, options=self._options)


def as_states(states: Mapping[str, Any], model_parts: Sequence[nn.Module]) -> dict[str, Any]:
    """The manager's ``states`` (``None`` values dropped), each a ``Stateful`` that saves and
    restores all it holds: a bare ``nn.Module`` becomes a ``ModelState`` and a bare
    optimizer an ``OptimizerState`` with the model. Their own ``state_dict()`` would not do:
    an optimizer's is keyed by parameter index and, before its first step, holds no moments
    for DCP to load into, so a resume would leave the optimizer empty. Anything else must
    have ``state_dict()`` and ``load_state_dict()``; what cannot be wrapped raises one line
    naming the wrapper to use."""
    return {
        name: _as_stateful(name, value, model_parts)
        for name, value in states.items()
        if value is not None
    }


def _as_stateful(name: str, value: Any, model_parts: Sequence[nn.Module]) -> Any:
    if isinstance(value, nn.Module):
        return ModelState(value)
    if isinstance(value, torch.optim.Optimizer):
        return OptimizerState(_owner(name, value, model_parts), value)
    if not (callable(getattr(value, "state_dict", None))) or not callable(
        getattr(value, "load_state_dict", None)
    ):
        raise TypeError(
            f"states[{name!r}] is a {type(value).__name__} without state_dict() and "
            "load_state_dict(); pass an object with both (a Stateful): a module, an "
            "optimizer, an LR scheduler, or a wrapper of your own."
        )
    return value


def _owner(name: str, opt: torch.optim.Optimizer, model_parts: Sequence[nn.Module]) -> nn.Module:
    """The one model part that holds every parameter of ``opt``."""
    params = {id(p) for group in opt.param_groups for p in group["params"]}
    for part in model_parts:
        if params <= {id(p) for p in part.parameters()}:
            return part
    raise CheckpointConfigError(
        f"states[{name!r}] is an optimizer of parameters that no one model part holds; "
        f"pass OptimizerState(model_parts, optimizers) (titan_ckpt), one optimizer per part."
    )
