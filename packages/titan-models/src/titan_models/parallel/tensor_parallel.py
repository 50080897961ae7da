"""Tensor parallel pieces shared by the model families' plans."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["apply_tp_ends"]


def apply_tp_ends(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Tensor parallel for the ends of a decoder laid out as titan's (``tok_embeddings``,
    ``norm``, ``output``; a pipeline stage may lack some, set to ``None``): the embedding
    row-parallel with its output sharded along the sequence (the first block's input), the
    final norm sequence-parallel, and the output projection column-parallel; with
    ``loss_parallel`` its logits stay sharded over the vocabulary as a DTensor."""
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, plan)
