"""Expert parallelism: each rank of an ``ep`` mesh holds ``num_experts / ep`` of every MoE
layer's experts, and tokens travel to the rank that owns their expert and back.

``apply_expert_parallel(model, ep_mesh)`` shards every MoE layer's ``experts.w1/w2/w3`` on
dim 0 (the experts) over ``ep_mesh`` (a DCP checkpoint holds the full stacks, so it loads at
any ep degree) and hooks the experts' forward. Dispatch: the per-expert counts are exchanged
first (both split lists reach the host in one copy, the layer's only host sync), then the
tokens, sorted by expert, by an all-to-all with those splits, reordered expert-major (source
ranks in order), the layout the experts compute on. Combine: the reverse all-to-all. Both are
autograd functions. Router, shared expert and buffers stay local: each rank routes and
counts its own tokens, as data parallelism expects; tokens arriving in a single process's
order give bit-identical expert outputs and gradients.

Gradients: a local expert's gradient sums over the tokens of its whole ep group, so the
experts' FSDP (over ``dp_shard_mod_ep``) divides by all ``dp_shard x cp`` ranks, like every
other gradient. gloo has no PREMUL_SUM: force sum reduction there, but only on a mesh of more
than one rank (torch 2.13 divides twice on a one-rank mesh; the ``fsdp`` case of
``tests/workers/moe_expert_parallel.py`` checks both)."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titan_models.errors import ModelConfigError
from titan_models.moe.args import MoEArgs
from titan_models.moe.balance import moe_layers

__all__ = ["ExpertParallel", "apply_expert_parallel", "check_expert_parallel"]


def check_expert_parallel(args: MoEArgs, ep: int) -> None:
    """Raise ``ModelConfigError`` unless ``ep`` ranks can share ``args.num_experts``
    experts equally (the up-front check, before any mesh exists)."""
    if ep < 1 or args.num_experts % ep:
        divisors = [d for d in range(1, args.num_experts + 1) if args.num_experts % d == 0]
        raise ModelConfigError(
            f"expert_parallel_degree={ep} is not allowed with num_experts={args.num_experts}; "
            f"every ep rank holds an equal share of the experts, so choose one of "
            f"{', '.join(map(str, divisors))}."
        )


class ExpertParallel(ParallelStyle):
    """Shards a ``GroupedExperts``' weights on dim 0 over a one-dimensional mesh and moves its
    input tokens there and back by all-to-all (see the module docstring). One instance per
    experts module: it keeps the split sizes of the forward in flight between its two hooks."""

    def __init__(self) -> None:
        super().__init__()
        self._splits: tuple[list[int], list[int], torch.Tensor] | None = None

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]))
            module.register_parameter(param_name, sharded)

    def _dispatch(
        self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor]:
        routed, counts = inputs
        group, ep = mesh.get_group(), mesh.size()
        with torch.no_grad():
            # received[r * local + e]: tokens source rank r sends to my local expert e. The
            # functional collective: op-level activation checkpointing saves its output, so
            # the recompute does not exchange the counts again.
            received = all_to_all_single(counts, None, None, group)
            by_source = received.view(ep, -1)
            # The one device-to-host copy of the layer: both split lists at once.
            splits = torch.stack((counts.view(ep, -1).sum(dim=1), by_source.sum(dim=1)))
            if isinstance(counts, FakeTensor):
                # Fake tensors (the memory estimate) have no values: assume the balance the
                # router is trained toward, an equal share of the rows to every rank.
                rows = routed.shape[0]
                input_splits = [rows // ep + (r < rows % ep) for r in range(ep)]
                output_splits = list(input_splits)
            else:
                input_splits, output_splits = splits.tolist()
            local_experts = torch.arange(by_source.shape[1], device=counts.device)
            # output_size: the total is known on the host (without it, a second sync).
            expert_of_row = local_experts.repeat(ep).repeat_interleave(
                by_source.flatten(), output_size=sum(output_splits)
            )
            # Expert-major, source ranks in order within an expert (stable sort).
            order = torch.argsort(expert_of_row, stable=True)
        self._splits = (input_splits, output_splits, order)
        arrived = all_to_all_single_autograd(routed, output_splits, input_splits, group)
        return arrived[order], by_source.sum(dim=0)

    def _combine(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if self._splits is None:
            raise RuntimeError("ExpertParallel's combine ran without a dispatch before it.")
        input_splits, output_splits, order = self._splits
        self._splits = None
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_single_autograd(
            output[inverse], input_splits, output_splits, mesh.get_group()
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition,
            input_fn=self._dispatch,
            output_fn=self._combine,
        )


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard the experts of every MoE layer in ``model`` (a model, a block, or one ``MoE``)
    over the one-dimensional ``ep_mesh`` and route tokens to them by all-to-all, in place.

    Call it on the model before FSDP and before materializing (it works on the meta
    device). Raises ``ModelConfigError``, before changing anything, if ``model`` has no MoE
    layer or if a layer's experts do not divide equally over ``ep_mesh.size()`` ranks.
    """
    if ep_mesh.ndim != 1:
        raise ModelConfigError(
            f"ep_mesh has {ep_mesh.ndim} dimensions {ep_mesh.mesh_dim_names}; expert "
            "parallelism takes the one-dimensional 'ep' mesh (e.g. world_mesh['ep'])."
        )
    layers = moe_layers(model)
    if not layers:
        raise ModelConfigError(
            f"expert_parallel_degree={ep_mesh.size()} needs MoE layers, and "
            f"{type(model).__name__} has none; use expert_parallel_degree=1 for a dense model."
        )
    for _, layer in layers:
        check_expert_parallel(layer.args, ep_mesh.size())
    for _, layer in layers:
        parallelize_module(layer.experts, ep_mesh, ExpertParallel())
