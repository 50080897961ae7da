"""The plans that parallelize a DeepSeek-V3 model (or one pipeline stage of it).

Order as for Llama 3: tensor parallel, expert parallel, context parallel, activation
checkpointing, per-block compile, then FSDP2/HSDP or DDP. What differs:

- **Tensor parallel.** Attention heads are split: ``wq`` (or ``wq_b``) and ``wkv_b`` are
  column-parallel, ``wo`` row-parallel; the low-rank projections ``wq_a``/``wkv_a`` and their
  norms stay whole on every rank. The rotated key slice of ``wkv_a``'s output is shared by
  all heads, so its gradient is partial on each rank: a hook sums it over ``tp`` in backward.
  An MoE layer runs on the whole (gathered) sequence on every tp rank: routing and the
  routed experts are replicated (with ``ep`` they are spread over the ep ranks instead), the
  shared expert is split over its hidden dimension (input gradient summed and output summed
  over ``tp``): ``titan_models.parallel.moe_parallel.apply_moe_tp``, shared with Qwen3.
- **Expert parallel.** ``titan_models.parallel.apply_expert_parallel`` over the ``ep`` mesh; then
  FSDP shards the experts over ``dp_shard_mod_ep`` (with ``dp_replicate`` for HSDP), the rest
  over ``dp_shard_cp``, and divides the experts' gradients by the same data-parallel degree
  as every other gradient's (their tokens came from all ``dp_shard_cp`` ranks):
  ``apply_fsdp_with_experts``, shared with Qwen3.
- **Context parallel.** Only titan's all-gather attention: the ring and torch's need equal
  key and value head sizes (192 and 128 here).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_dims import ParallelDims
from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.deepseek_v3.model import DeepSeekV3
from titan_models.errors import ModelConfigError
from titan_models.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.context_parallel import apply_context_parallel
from titan_models.parallel.data_parallel import apply_ddp
from titan_models.parallel.expert_parallel import apply_expert_parallel
from titan_models.parallel.moe_parallel import (
    SumGradOverGroup,
    apply_fsdp_with_experts,
    apply_moe_tp,
)
from titan_models.parallel.rules import check_layout, check_pipeline
from titan_models.parallel.tensor_parallel import apply_tp_ends

__all__ = ["apply_tp_deepseek_v3", "check_deepseek_v3", "parallelize_deepseek_v3"]


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
) -> None:
    """What one model (or one pipeline stage) is checked against."""
    has_experts = args.n_layers > args.n_dense_layers
    implementation = check_layout(
        parallel_dims,
        parallelize_config,
        # Keys and values come per head from the one latent (wkv_b): n_heads of each too.
        heads={"n_heads": args.n_heads},
        seq_len=args.max_seq_len if seq_len is None else seq_len,
        experts=args.moe_args() if has_experts else None,
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


def _shared_rope_key_hook(kv_lora_rank: int, tp_mesh: DeviceMesh):
    def hook(_module: nn.Module, _inputs: object, out: torch.Tensor) -> torch.Tensor:
        latent, rope_key = out[..., :kv_lora_rank], out[..., kv_lora_rank:]
        return torch.cat([latent, SumGradOverGroup.apply(rope_key, tp_mesh)], dim=-1)

    return hook


def apply_tp_deepseek_v3(model: DeepSeekV3, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Tensor and sequence parallel over ``tp_mesh`` (see the module docstring). Between
    blocks the residual stream is sharded along the sequence, as for Llama 3."""
    apply_tp_ends(model, tp_mesh, loss_parallel=loss_parallel)
    for block in model.layers.values():
        attention = block.attention
        plan: dict[str, object] = {
            "attention_norm": SequenceParallel(),
            # forward(x, rope): gather x along the sequence, as a plain tensor, since the
            # low-rank projections are plain modules; rope is a plain, full tensor.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None),
                desired_input_layouts=(Replicate(), None),
                use_local_output=True,
            ),
            "attention.wkv_b": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        plan["attention.wq" if attention.q_lora_rank == 0 else "attention.wq_b"] = ColwiseParallel()
        if not block.moe_enabled:
            plan.update(
                {
                    "feed_forward": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    "feed_forward.w3": ColwiseParallel(),
                }
            )
        parallelize_module(block, tp_mesh, plan)
        attention.wkv_a.register_forward_hook(
            _shared_rope_key_hook(attention.kv_lora_rank, tp_mesh)
        )
        if block.moe_enabled:
            apply_moe_tp(block.moe, tp_mesh)


def parallelize_deepseek_v3(
    model: DeepSeekV3,
    parallel_dims: ParallelDims,
    config: ParallelizeConfig | None = None,
    *,
    seq_len: int | None = None,
) -> DeepSeekV3:
    """Apply tensor/sequence parallel, expert parallel, context parallel, activation
    checkpointing, per-block compile and FSDP2 / HSDP / DDP to ``model`` in place (build it
    on the meta device first), as ``parallel_dims`` and ``config`` say; return it. Raises
    ``ModelConfigError`` (the checks of :func:`check_deepseek_v3` but the pipeline's) before
    touching anything."""
    config = config or ParallelizeConfig()
    _check_layout(model.args, parallel_dims, config, seq_len)
    if parallel_dims.tp_enabled:
        apply_tp_deepseek_v3(
            model, parallel_dims.get_mesh("tp"), loss_parallel=config.loss_parallel
        )
    if parallel_dims.ep_enabled:
        apply_expert_parallel(model, parallel_dims.get_mesh("ep"))
    if parallel_dims.cp_enabled:
        attentions = [block.attention for block in model.layers.values()]
        apply_context_parallel(attentions, parallel_dims.get_mesh("cp"), "titan")
    apply_activation_checkpointing(model.layers, config.activation_checkpoint)
    if config.compile:
        for block in model.layers.values():
            # An MoE block breaks the graph where it counts tokens (eager, so that the count
            # knows whether autograd is recomputing) and, with expert parallel, where it
            # reads the all-to-all split sizes on the host. Dense blocks compile whole.
            block.compile(backend=config.compile_backend, fullgraph=not block.moe_enabled)
    if parallel_dims.fsdp_enabled:
        apply_fsdp_with_experts(model, parallel_dims, config)
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"))
    return model
