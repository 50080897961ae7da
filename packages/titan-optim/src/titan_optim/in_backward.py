"""Optimizer-in-backward: each parameter steps (and frees its gradient) from its
post-accumulate-grad hook, so only a few gradients are alive at once. No gradient then
coexists with all others (no global norm, so no clipping), and a pipeline's several backward
passes would step each parameter once per microbatch: both are refused up front."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_optim.config import OptimizerConfig
from titan_optim.container import OptimizersContainer
from titan_optim.errors import OptimizerInBackwardError
from titan_optim.param_groups import build_optimizer, group_parameters, warn_fallback

__all__ = ["OptimizerInBackwardError", "OptimizersInBackwardContainer"]


class OptimizersInBackwardContainer(OptimizersContainer):
    """An ``OptimizersContainer`` whose optimizers step inside ``backward``.

    ``step`` runs the post hooks and checks that backward consumed every gradient (FSDP2 assigns
    sharded gradients after backward, bypassing the hook: ``step`` then raises instead of
    silently not training); ``zero_grad`` has nothing to clear. The pre hooks run before the
    first parameter steps in each backward, so they still precede every update (a checkpointer
    waiting for its background copy relies on that). State dicts are the ordinary container's."""

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        config: OptimizerConfig,
        *,
        pipeline_parallel: bool = False,
    ) -> None:
        if pipeline_parallel or len(model_parts) > 1:
            raise OptimizerInBackwardError(
                "optimizer.early_step_in_backward=True cannot be used with pipeline "
                f"parallelism (got {len(model_parts)} model parts, pipeline_parallel="
                f"{pipeline_parallel}): the schedule runs one backward per microbatch and "
                "would step every parameter several times per batch. Set "
                "early_step_in_backward=False or pipeline_parallel_degree=1."
            )
        self._pre_hooks_ran = False  # in this backward, before its first update
        part_optimizers, reasons = [], []
        self._params: list[nn.Parameter] = []
        for part in model_parts:
            opts = []
            for group in group_parameters(part, config):
                overrides = {k: v for k, v in group.items() if k != "params"}
                for param in group["params"]:
                    opt, reason = build_optimizer([{"params": [param], **overrides}], config)
                    reasons.append(reason)
                    param.register_post_accumulate_grad_hook(self._stepper(opt))
                    self._params.append(param)
                    opts.append(opt)
            part_optimizers.append(opts)
        warn_fallback(reasons)
        super().__init__(model_parts, part_optimizers)

    def _stepper(self, opt: torch.optim.Optimizer) -> Any:
        def hook(param: torch.Tensor) -> None:
            if not self._pre_hooks_ran:
                self._pre_hooks_ran = True
                OptimizersContainer._run_pre_hooks(self)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return hook

    def _run_pre_hooks(self) -> None:
        if self._pre_hooks_ran:  # before this backward's first update
            self._pre_hooks_ran = False
            return
        super()._run_pre_hooks()

    def _step_optimizers(self) -> None:
        if any(p.grad is not None for p in self._params):
            raise OptimizerInBackwardError(
                "optimizer-in-backward found gradients left after backward: some parameters "
                "got their gradient without autograd accumulation (e.g. FSDP2's sharded "
                "gradients), so their hook never stepped them. Set "
                "optimizer.early_step_in_backward=False for this model."
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each gradient was freed right after its parameter stepped."""

    def clip_grad_norm_(
        self,
        max_norm: float,
        *,
        norm_type: float = 2.0,
        pp_group: dist.ProcessGroup | DeviceMesh | None = None,
        on_nonfinite: str = "skip",
        mirrored: Collection[torch.Tensor] = (),
    ) -> torch.Tensor:
        """Always raises: the gradients were consumed during backward."""
        raise OptimizerInBackwardError(
            "Gradient clipping cannot be used with optimizer.early_step_in_backward=True: "
            "each parameter stepped during backward, so no global gradient norm exists. "
            "Turn off clipping (max_norm) or optimizer-in-backward."
        )
