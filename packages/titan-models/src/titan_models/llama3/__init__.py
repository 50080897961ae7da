"""Llama 3: model, flavors, Hugging Face adapter and parallelize plan."""

from titan_models.llama3.adapter import Llama3StateDictAdapter, args_from_hf_config, make_adapter
from titan_models.llama3.args import (
    LLAMA3_FLAVORS,
    ROPE_SCALING_CHOICES,
    Llama3Args,
    RopeScaling,
    llama3_args,
    rope_scaling_of,
)
from titan_models.llama3.model import Llama3
from titan_models.llama3.parallelize import (
    apply_tp,
    check_llama,
    parallelize_llama,
    pipeline_llama,
)
from titan_models.llama3.spec import LLAMA3

__all__ = [
    "LLAMA3",
    "LLAMA3_FLAVORS",
    "ROPE_SCALING_CHOICES",
    "Llama3",
    "Llama3Args",
    "Llama3StateDictAdapter",
    "RopeScaling",
    "apply_tp",
    "args_from_hf_config",
    "check_llama",
    "llama3_args",
    "make_adapter",
    "parallelize_llama",
    "pipeline_llama",
    "rope_scaling_of",
]
