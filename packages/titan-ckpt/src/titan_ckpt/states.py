"""Stateful views of model parts and their optimizers, keyed by fully-qualified name.

``ModelState`` flattens the state of every model part (e.g. pipeline stages) into one dict of
FQN -> tensor (DTensor under FSDP/TP), so a checkpoint written under one parallel layout loads
under another: DCP matches tensors by FQN and reshards them. ``OptimizerState`` does the same
for optimizers, one per model part, with torch's flattened optimizer state dict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_ckpt.errors import CheckpointConfigError

__all__ = ["ModelState", "OptimizerState"]


class ModelState:
    """The model parts as one ``Stateful``: a flat FQN -> tensor dict over all parts."""

    def __init__(self, model_parts: nn.Module | Sequence[nn.Module]) -> None:
        single = isinstance(model_parts, nn.Module)
        self.model_parts = [model_parts] if single else list(model_parts)
        if not self.model_parts:
            raise CheckpointConfigError(
                "model_parts is empty: pass the model, or its pipeline stages."
            )

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            sd = get_model_state_dict(part)
            clash = merged.keys() & sd.keys()
            if clash:
                raise CheckpointConfigError(
                    f"Model parts share the parameter names {sorted(clash)[:5]}: each "
                    "pipeline stage must keep its original FQNs so that they stay unique."
                )
            merged.update(sd)
        return merged

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

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, opt in self.pairs:
            merged.update(get_optimizer_state_dict(part, opt, options=self._options))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, opt in self.pairs:
            set_optimizer_state_dict(part, opt, state_dict, options=self._options)
