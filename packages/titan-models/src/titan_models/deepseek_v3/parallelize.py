"""The plans that parallelize a DeepSeek-V3 model (or one pipeline stage of it) and split it
into pipeline stages: the shared plan (``titan_models.parallel.plan``) with DeepSeek-V3's
facts. What differs from Llama 3:

- **Tensor parallel.** ``wq`` (or ``wq_b``) and ``wkv_b`` are column-parallel, ``wo``
  row-parallel; the low-rank ``wq_a``/``wkv_a`` and their norms stay whole (replicated
  DTensors computing on plain tensors' values, so that every parameter of a tp-only model is
  a DTensor, which foreach and fused optimizers need). The rotated key
  slice of ``wkv_a``'s output is shared by all heads, so a hook sums its gradient over ``tp``.
- **Context parallel.** titan's all-gather attention only: the ring and torch's need equal
  key and value head sizes (192 and 128 here)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from titan_dims import ParallelDims
from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.deepseek_v3.model import DeepSeekV3
from titan_models.errors import ModelConfigError
from titan_models.moe import tokens_not_counted
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.moe_parallel import SumGradOverGroup, apply_moe_tp
from titan_models.parallel.pipeline import Pipeline
from titan_models.parallel.plan import block_tp_plan, parallelize_decoder, pipeline_decoder
from titan_models.parallel.rules import check_layout, check_pipeline
from titan_models.parallel.tensor_parallel import apply_tp_ends

__all__ = [
    "apply_tp_deepseek_v3",
    "check_deepseek_v3",
    "parallelize_deepseek_v3",
    "pipeline_deepseek_v3",
]


def check_deepseek_v3(
    args: DeepSeekV3Args,
    parallel_dims: ParallelDims,
    parallelize_config: ParallelizeConfig,
    *,
    seq_len: int | None = None,
    pipeline_config: PipelineConfig | None = None,
    local_batch_size: int | None = None,
) -> None:
    """Raise ``ModelConfigError`` if a DeepSeek-V3 of ``args`` cannot be trained with this
    layout: the rules every family shares (``titan_models.parallel.rules``) for ``n_heads``
    heads, expert parallel only with MoE blocks, the pipeline's included; and titan's
    context-parallel attention only. No process group or model needed
    (``DEEPSEEK_V3.check_fn``)."""
    _check_layout(args, parallel_dims, parallelize_config, seq_len)
    check_pipeline(parallel_dims, args.n_layers, pipeline_config, local_batch_size)


def _check_layout(
    args: DeepSeekV3Args,
    parallel_dims: ParallelDims,
    parallelize_config: ParallelizeConfig,
    seq_len: int | None,
) -> str | None:
    implementation = check_layout(
        parallel_dims,
        parallelize_config,
        # Keys and values come per head from the one latent (wkv_b): n_heads of each too.
        heads={"n_heads": args.n_heads},
        seq_len=args.max_seq_len if seq_len is None else seq_len,
        expert_hidden_dim=args.moe_inter_dim,
        experts=args.moe_args() if args.n_layers > args.n_dense_layers else None,
        no_experts=f"this DeepSeek-V3 has no MoE block (n_layers={args.n_layers} <= "
        f"n_dense_layers={args.n_dense_layers})",
    )
    if implementation not in (None, "titan"):
        raise ModelConfigError(
            f"cp_attention={parallelize_config.cp_attention!r} ({implementation}) cannot run "
            "DeepSeek-V3's attention, whose keys and values have different head sizes "
            f"({args.qk_nope_head_dim + args.qk_rope_head_dim} and {args.v_head_dim}); "
            "set parallelize.cp_attention='titan' (the all-gather attention)."
        )
    return implementation


def _shared_rope_key_hook(kv_lora_rank: int, tp_mesh: DeviceMesh):
    def hook(_module: nn.Module, _inputs: object, out: torch.Tensor) -> torch.Tensor:
        latent, rope_key = out[..., :kv_lora_rank], out[..., kv_lora_rank:]
        return torch.cat([latent, SumGradOverGroup.apply(rope_key, tp_mesh)], dim=-1)

    return hook


def _replicate(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """``module``'s parameters as DTensors replicated over ``tp_mesh``; its plain input
    and output stay plain (each rank computes the whole module on the same values)."""
    distribute_module(
        module,
        tp_mesh,
        input_fn=lambda _m, inputs, mesh: tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs
        ),
        output_fn=lambda _m, out, _mesh: out.to_local(),
    )


def apply_tp_deepseek_v3(
    model: DeepSeekV3, tp_mesh: DeviceMesh, *, loss_parallel: bool, shard_experts: bool = True
) -> None:
    """Tensor and sequence parallel over ``tp_mesh`` (see the module docstring). Between
    blocks the residual stream is sharded along the sequence, as for Llama 3.
    ``shard_experts``: split every expert over its hidden dimension (``apply_moe_tp``);
    ``False`` under expert parallel, which holds the routed experts."""
    apply_tp_ends(model, tp_mesh, loss_parallel=loss_parallel)
    for block in model.layers.values():
        attention = block.attention
        query = "wq" if attention.q_lora_rank == 0 else "wq_b"
        # Attention gets its gathered input as a plain tensor: the low-rank projections are
        # plain modules.
        plan = block_tp_plan(
            dense=not block.moe_enabled,
            local_input=True,
            wkv_b=ColwiseParallel(),
            **{query: ColwiseParallel()},
        )
        parallelize_module(block, tp_mesh, plan)
        for name in ("wq_a", "q_norm", "wkv_a", "kv_norm"):
            if hasattr(attention, name):
                _replicate(getattr(attention, name), tp_mesh)
        attention.wkv_a.register_forward_hook(
            _shared_rope_key_hook(attention.kv_lora_rank, tp_mesh)
        )
        if block.moe_enabled:
            apply_moe_tp(block.moe, tp_mesh, shard_experts=shard_experts)


def parallelize_deepseek_v3(
    model: DeepSeekV3,
    parallel_dims: ParallelDims,
    config: ParallelizeConfig | None = None,
    *,
    seq_len: int | None = None,
) -> DeepSeekV3:
    """``titan_models.llama3.parallelize_llama`` for DeepSeek-V3, with expert parallel;
    raises ``ModelConfigError`` (:func:`check_deepseek_v3`'s checks but the pipeline's)
    before touching anything."""
    return parallelize_decoder(
        model,
        parallel_dims,
        config,
        seq_len=seq_len,
        check_layout=_check_layout,
        apply_tp=apply_tp_deepseek_v3,
    )


def pipeline_deepseek_v3(
    model: DeepSeekV3,
    parallel_dims: ParallelDims,
    pipeline_config: PipelineConfig,
    parallelize_config: ParallelizeConfig | None = None,
    *,
    local_batch_size: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device | str | None = None,
    seq_len: int | None = None,
) -> Pipeline:
    """This rank's pipeline stages of ``model`` (built on the meta device), each
    parallelized with :func:`parallelize_deepseek_v3`, and their schedule; arguments as
    ``titan_models.llama3.pipeline_llama``."""
    return pipeline_decoder(
        model,
        parallel_dims,
        pipeline_config,
        parallelize_config,
        check=check_deepseek_v3,
        parallelize=parallelize_deepseek_v3,
        local_batch_size=local_batch_size,
        loss_fn=loss_fn,
        device=device,
        seq_len=seq_len,
        # torch's one-time metadata forward is not a training step: leave the counts alone.
        inference_context=tokens_not_counted,
    )
