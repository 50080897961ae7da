"""Qwen3, dense and mixture of experts: args and flavors (debugmodel, debugmodel_moe, 0.6B to
32B, 30B-A3B, 235B-A22B), the model (grouped-query attention with QK-norm, SwiGLU or MoE
blocks, tied embeddings where the flavor ties them), and the Hugging Face adapter."""

from titan_models.qwen3.adapter import Qwen3StateDictAdapter, make_adapter
from titan_models.qwen3.args import QWEN3_FLAVORS, QWEN3_ROPE_SCALINGS, Qwen3Args, qwen3_args
from titan_models.qwen3.hf_config import HF_ARCHITECTURES, args_from_hf_config, hf_config_of
from titan_models.qwen3.model import Qwen3, Qwen3Attention, Qwen3Block

__all__ = [
    "HF_ARCHITECTURES",
    "QWEN3_FLAVORS",
    "QWEN3_ROPE_SCALINGS",
    "Qwen3",
    "Qwen3Args",
    "Qwen3Attention",
    "Qwen3Block",
    "Qwen3StateDictAdapter",
    "args_from_hf_config",
    "hf_config_of",
    "make_adapter",
    "qwen3_args",
]
