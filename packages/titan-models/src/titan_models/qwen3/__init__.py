"""Qwen3, dense and mixture of experts: args and flavors (debugmodel, debugmodel_moe, 0.6B to
32B, 30B-A3B, 235B-A22B), the model (grouped-query attention with QK-norm, SwiGLU or MoE
blocks, tied embeddings where the flavor ties them), and the Hugging Face adapter."""

from titan_models.qwen3.args import QWEN3_FLAVORS, QWEN3_ROPE_SCALINGS, Qwen3Args, qwen3_args
from titan_models.qwen3.model import Qwen3, Qwen3Attention, Qwen3Block

__all__ = [
    "QWEN3_FLAVORS",
    "QWEN3_ROPE_SCALINGS",
    "Qwen3",
    "Qwen3Args",
    "Qwen3Attention",
    "Qwen3Block",
    "qwen3_args",
]
