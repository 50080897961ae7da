"""The parallel plans of an MoE layer, shared by the families with MoE blocks (DeepSeek-V3,
Qwen3 MoE).

- **Tensor parallel** (:func:`apply_moe_tp`): the layer runs on the gathered sequence on
  every tp rank, routing replicated. Without expert parallel every expert (routed and
  shared) is split over its hidden dimension and the layer's partial output is
  reduce-scattered once; with it the routed experts are spread over ``ep`` and only the
  shared expert is split (its own sums over ``tp``).
- **FSDP** (:func:`apply_fsdp_with_experts`): under expert parallel the experts are sharded
  over ``dp_shard_mod_ep`` (with ``dp_replicate`` for HSDP) before the blocks over
  ``dp_shard_cp``, their gradients divided by the same data-parallel degree as every other's
  (see ``titan_models.parallel.expert_parallel``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

from titan_dims import ParallelDims, detect_device_type
from titan_models.moe.balance import moe_layers
from titan_models.moe.layer import MoE
from titan_models.parallel.config import ParallelizeConfig
from titan_models.parallel.data_parallel import apply_fsdp, resolve_param_dtype

__all__ = ["SumGradOverGroup", "SumOverGroup", "apply_fsdp_with_experts", "apply_moe_tp"]


class SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over ``mesh``: for a
    tensor every rank holds whole but whose uses are split over the ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        summed = DTensor.from_local(grad.contiguous(), ctx.mesh, [Partial()], run_check=False)
        return summed.redistribute(placements=[Replicate()]).to_local(), None


class SumOverGroup(torch.autograd.Function):
    """Forward all-reduces (sums) partial results over ``mesh``; backward is the identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:  # type: ignore[override]
        partial = DTensor.from_local(x.contiguous(), mesh, [Partial()], run_check=False)
        return partial.redistribute(placements=[Replicate()]).to_local()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def _split_hidden(experts: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A ``GroupedExperts``' weights split over its hidden dimension: w1 and w3 (E, dim,
    hidden) on dim 2, w2 (E, hidden, dim) on dim 1, each rank computing a partial sum."""
    for name, dim in (("w1", 2), ("w2", 1), ("w3", 2)):
        weight = getattr(experts, name)
        experts.register_parameter(
            name, nn.Parameter(distribute_tensor(weight, tp_mesh, [Shard(dim)]))
        )


def _split_shared_expert(shared: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The shared expert split over its hidden dimension, the input's gradient and the
    output summed over ``tp`` by its own hooks (routed experts replicated, under ep)."""
    _split_hidden(shared, tp_mesh)
    shared.register_forward_pre_hook(
        lambda _m, args: (SumGradOverGroup.apply(args[0], tp_mesh), *args[1:])
    )
    shared.register_forward_hook(lambda _m, _args, out: SumOverGroup.apply(out, tp_mesh))


def _gather_partial_grad(tp_mesh: DeviceMesh):
    """Forward pre-hook: all-gather the input, sharded along the sequence (dim 1), into a
    plain tensor whose gradient is a partial sum per rank, reduce-scattered back in the
    backward (torch's functional collectives: they trace under ``torch.compile``)."""

    def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        if isinstance(x, DTensor):  # the norm before hands over its Shard(1) part
            x = x.to_local()
        return (funcol.all_gather_single(x, 1, tp_mesh.get_group()), *args[1:])

    return hook


def _reduce_scatter_output(tp_mesh: DeviceMesh):
    """Forward hook: sum the per-rank partial output over ``tp`` into this rank's part of
    the sequence (one reduce-scatter; its backward all-gathers the gradient)."""

    def hook(_module: nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
        return funcol.reduce_scatter_single(out, "sum", 1, tp_mesh.get_group())

    return hook


def apply_moe_tp(moe: MoE, tp_mesh: DeviceMesh, *, shard_experts: bool = True) -> None:
    """Tensor parallel around one MoE layer whose input and output are sharded along the
    sequence (dim 1) over ``tp_mesh``; the layer runs on the gathered sequence.

    ``shard_experts`` (tensor parallel without expert parallel): every routed expert and the
    shared expert split over their hidden dimension, so each rank computes a partial output
    of the whole layer from the replicated routing; one reduce-scatter sums it into this
    rank's part of the sequence, and the input's gradient (partial too, the router's
    included) is reduce-scattered back. The router gate's weight (a replicated DTensor)
    has its gradient summed over ``tp``, the balance loss's divided by ``tp`` (each rank
    adds it). Without (expert parallel holds the routed experts): the routed experts
    replicated over tp, only the shared expert split, the output cut back to this rank's
    part."""
    if not shard_experts:
        parallelize_module(
            moe,
            tp_mesh,
            PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=True,
            ),
        )
        if moe.shared_expert is not None:
            _split_shared_expert(moe.shared_expert, tp_mesh)
        return
    _split_hidden(moe.experts, tp_mesh)
    if moe.shared_expert is not None:
        _split_hidden(moe.shared_expert, tp_mesh)
    # The gate replicated as a DTensor, as every other parameter of a tp-only model is (an
    # optimizer's foreach/fused step refuses a mix); its local gradient is partial per rank.
    gate = moe.router.gate
    gate.register_parameter(
        "weight", nn.Parameter(distribute_tensor(gate.weight, tp_mesh, [Replicate()]))
    )

    def sum_gate_grad(weight: torch.Tensor) -> torch.Tensor:
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        return SumGradOverGroup.apply(local, tp_mesh)

    moe.router.gate_weight_hook = sum_gate_grad
    moe.aux_loss_grad_divisor = tp_mesh.size()
    moe.register_forward_pre_hook(_gather_partial_grad(tp_mesh))
    moe.register_forward_hook(_reduce_scatter_output(tp_mesh))


def _shard_experts(
    model: nn.Module, parallel_dims: ParallelDims, config: ParallelizeConfig
) -> None:
    """FSDP over ``dp_shard_mod_ep`` for every MoE layer's experts (expert parallel on)."""
    device_type = parallel_dims.device_type or detect_device_type()
    replicate = ("dp_replicate",) if parallel_dims.dp_replicate_enabled else ()
    expert_mesh = parallel_dims.get_mesh((*replicate, "dp_shard_mod_ep"))
    mp = MixedPrecisionPolicy(
        param_dtype=resolve_param_dtype(config.param_dtype, device_type),
        reduce_dtype=getattr(torch, config.reduce_dtype),
    )
    reshard = config.reshard_after_forward == "always" or (
        config.reshard_after_forward == "default" and not parallel_dims.pp_enabled
    )
    degree = parallel_dims.dp_replicate * parallel_dims.dp_shard * parallel_dims.cp
    # A divide factor other than the group's size is a pre-multiplied sum, which gloo
    # lacks: there, sum and divide after. (Not on a one-rank shard group: torch 2.13
    # divides that copy itself, and would divide once more after.)
    shard_group = expert_mesh.get_group(expert_mesh.ndim - 1)
    sum_then_divide = dist.get_backend(shard_group) == "gloo" and shard_group.size() > 1
    for _, layer in moe_layers(model):
        experts = fully_shard(
            layer.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard
        )
        experts.set_gradient_divide_factor(float(degree))
        experts.set_force_sum_reduction_for_comms(sum_then_divide)


def apply_fsdp_with_experts(
    model: nn.Module, parallel_dims: ParallelDims, config: ParallelizeConfig
) -> None:
    """FSDP2 (HSDP with ``dp_replicate``) of a titan decoder (``model.layers``, then the
    root), with, under expert parallel, every MoE layer's experts sharded first over
    ``dp_shard_mod_ep`` (see the module docstring)."""
    device_type = parallel_dims.device_type or detect_device_type()
    if parallel_dims.ep_enabled:
        _shard_experts(model, parallel_dims, config)
    replicate = ("dp_replicate",) if parallel_dims.dp_replicate_enabled else ()
    apply_fsdp(
        model,
        model.layers,
        parallel_dims.get_mesh((*replicate, "dp_shard_cp")),
        config,
        device_type=device_type,
        pipeline=parallel_dims.pp_enabled,
    )
