"""Qwen3, dense and mixture of experts: args and flavors (debugmodel, debugmodel_moe, 0.6B to
32B, 30B-A3B, 235B-A22B), the model (grouped-query attention with QK-norm, SwiGLU or MoE
blocks, tied embeddings where the flavor ties them), the Hugging Face adapter, the parallel
plans (``parallelize_qwen3``, ``pipeline_qwen3``, ``check_qwen3``) and the ``QWEN3`` spec."""

from titan_models.qwen3.adapter import Qwen3StateDictAdapter, make_adapter
from titan_models.qwen3.args import QWEN3_FLAVORS, QWEN3_ROPE_SCALINGS, Qwen3Args, qwen3_args
from titan_models.qwen3.hf_config import HF_ARCHITECTURES, args_from_hf_config, hf_config_of
from titan_models.qwen3.model import Qwen3, Qwen3Attention, Qwen3Block
from titan_models.qwen3.parallelize import (
    apply_tp_qwen3,
    check_qwen3,
    parallelize_qwen3,
    pipeline_qwen3,
)
from titan_models.qwen3.spec import QWEN3

__all__ = [
    "HF_ARCHITECTURES",
    "QWEN3",
    "QWEN3_FLAVORS",
    "QWEN3_ROPE_SCALINGS",
    "Qwen3",
    "Qwen3Args",
    "Qwen3Attention",
    "Qwen3Block",
    "Qwen3StateDictAdapter",
    "apply_tp_qwen3",
    "args_from_hf_config",
    "check_qwen3",
    "hf_config_of",
    "make_adapter",
    "parallelize_qwen3",
    "pipeline_qwen3",
    "qwen3_args",
]
