"""``OptimizersContainer``: the optimizers of all model parts, used as one optimizer.

A pipeline rank may hold several parts (stages), each with its own ``torch.optim``
optimizer, since DCP's state-dict helpers name an optimizer's parameters through one module.
They step together and save as one flat dict keyed by parameter FQN, whose tensors are
DTensors under FSDP2/TP, so a checkpoint written at one layout loads at another."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from titan_optim.clip import clip_grad_norm_

__all__ = ["OptimizersContainer", "StepHook"]

logger = logging.getLogger(__name__)

StepHook = Callable[["OptimizersContainer"], None]
"""A step pre/post hook: called with the container, its return value ignored."""

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizersContainer:
    """One optimizer per model part, behind the interface of a single optimizer, and a DCP
    ``Stateful`` (loading into a fresh container materialises each optimizer's state first, as
    ``set_optimizer_state_dict`` requires). After :meth:`clip_grad_norm_` finds a non-finite
    norm under ``skip``, the next :meth:`step` (hooks too) is skipped and counted in
    :attr:`skipped_steps`."""

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        part_optimizers: Sequence[Sequence[torch.optim.Optimizer]],
    ) -> None:
        if len(model_parts) != len(part_optimizers):
            raise ValueError(
                f"got {len(model_parts)} model parts but {len(part_optimizers)} optimizer "
                "lists; give one list of optimizers per model part."
            )
        self.model_parts = list(model_parts)
        self._part_optimizers = [list(opts) for opts in part_optimizers]
        self._pre_hooks: OrderedDict[int, StepHook] = OrderedDict()
        self._post_hooks: OrderedDict[int, StepHook] = OrderedDict()
        self._skip_next_step = False
        self.skipped_steps = 0
        """Steps skipped because the gradient norm was not finite."""
        self.warn_on_skip = True
        """Log a warning line for each skipped step; a caller that reports skips itself
        (titan-train's ``training.skip_nonfinite_steps`` policy) turns this off."""

    # -- one optimizer's interface ------------------------------------------------------
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every inner optimizer, part by part."""
        return [opt for opts in self._part_optimizers for opt in opts]

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups of all inner optimizers (read their ``lr`` for logging)."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        """Step every optimizer, between the pre and post hooks; skipped after a non-finite
        gradient norm (see the class docstring)."""
        if self._skip_next_step:
            self._skip_next_step = False
            self.skipped_steps += 1
            log = logger.warning if self.warn_on_skip else logger.debug
            log(
                "Skipped an optimizer step: the gradient norm was not finite (%d skipped so far).",
                self.skipped_steps,
            )
            return
        self._run_pre_hooks()
        self._step_optimizers()
        for hook in list(self._post_hooks.values()):
            hook(self)

    def _run_pre_hooks(self) -> None:
        for hook in list(self._pre_hooks.values()):
            hook(self)

    def _step_optimizers(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter of every part."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def register_step_pre_hook(self, hook: StepHook) -> RemovableHandle:
        """Call ``hook(container)`` before each step; ``handle.remove()`` unregisters it."""
        handle = RemovableHandle(self._pre_hooks)
        self._pre_hooks[handle.id] = hook
        return handle

    def register_step_post_hook(self, hook: StepHook) -> RemovableHandle:
        """Call ``hook(container)`` after each step; ``handle.remove()`` unregisters it."""
        handle = RemovableHandle(self._post_hooks)
        self._post_hooks[handle.id] = hook
        return handle

    # -- gradient clipping --------------------------------------------------------------
    def clip_grad_norm_(
        self,
        max_norm: float,
        *,
        norm_type: float = 2.0,
        pp_group: dist.ProcessGroup | DeviceMesh | None = None,
        on_nonfinite: str = "skip",
        mirrored: Collection[torch.Tensor] = (),
    ) -> torch.Tensor:
        """Clip all parts' gradients by their global norm (see ``titan_optim.clip_grad_norm_``)
        and return it; a non-finite norm skips the next :meth:`step` or raises."""
        params = [p for part in self.model_parts for p in part.parameters()]
        norm = clip_grad_norm_(
            params,
            max_norm,
            norm_type=norm_type,
            pp_group=pp_group,
            on_nonfinite=on_nonfinite,
            mirrored=mirrored,
        )
        self._skip_next_step = not bool(torch.isfinite(norm))
        return norm

    # -- checkpointing (torch.distributed.checkpoint.stateful.Stateful) -----------------
    def state_dict(self) -> dict[str, Any]:
        """All parts' optimizer state as one flat dict keyed by parameter FQN."""
        out: dict[str, Any] = {}
        for model, opts in zip(self.model_parts, self._part_optimizers, strict=True):
            if not opts:
                continue
            part = get_optimizer_state_dict(model, opts, options=_FLAT)
            clash = out.keys() & part.keys()
            if clash:
                # Keys are "<state|param_groups>.<fqn>.<key>": report the parameter names.
                names = sorted({k.split(".", 1)[1].rsplit(".", 1)[0] for k in clash})
                raise ValueError(
                    f"model parts share parameter names {names[:5]}; each part must keep "
                    "the FQNs of the full model so the checkpoint can tell them apart."
                )
            out.update(part)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from :meth:`state_dict`, possibly saved at another parallel layout;
        each part takes the keys of its own parameters."""
        for model, opts in zip(self.model_parts, self._part_optimizers, strict=True):
            if opts:
                set_optimizer_state_dict(model, opts, optim_state_dict=state_dict, options=_FLAT)
