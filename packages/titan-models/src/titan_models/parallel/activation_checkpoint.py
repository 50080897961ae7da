"""Activation checkpointing of transformer blocks: whole blocks (every N-th) or by op.

Wrapping replaces each chosen block in its ``ModuleDict`` by a ``checkpoint_wrapper``;
parameter names then gain a ``_checkpoint_wrapped_module.`` segment, which the wrapper's
state-dict hooks remove again, so checkpoints keep the plain names.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_models.parallel.config import ActivationCheckpointConfig

__all__ = ["apply_activation_checkpointing"]


def _saved_ops() -> set:
    """Ops whose outputs op-level checkpointing keeps: attention (expensive to recompute),
    the max reductions of loss/normalization code, and collectives (sequence parallel's
    reduce-scatter, expert parallel's all-to-all): recomputing those would send the same
    bytes over the network again in every backward."""
    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "max",
    )
    saved = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = torch.ops._c10d_functional
    for name in ("reduce_scatter_tensor", "all_to_all_single"):
        if hasattr(functional, name):
            saved.add(getattr(functional, name).default)
    return saved


def _op_level_context():
    """Selective checkpoint contexts that save attention outputs and every other matmul's.

    Forward and recompute each count their own matmuls, so both make the same choice for the
    same matmul; halving the saved matmuls halves their memory at half their recompute cost.
    """
    saved = _saved_ops()
    mm = torch.ops.aten.mm.default
    counts: Counter[str] = Counter()

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func == mm:
            phase = "recompute" if ctx.is_recompute else "forward"
            counts[phase] += 1
            keep = counts[phase] % 2 == 1
        else:
            keep = func in saved
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(
    blocks: nn.ModuleDict, config: ActivationCheckpointConfig
) -> list[str]:
    """Wrap the blocks ``config`` selects, in place; return the names of the wrapped ones."""
    if config.mode == "none":
        return []
    every = config.every_n_blocks
    wrapped = []
    for position, (name, block) in enumerate(list(blocks.items())):
        if every is not None:
            if (position + 1) % every:
                continue
            new = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            new = checkpoint_wrapper(block, context_fn=_op_level_context, preserve_rng_state=False)
        blocks.register_module(name, new)
        wrapped.append(name)
    return wrapped
