"""The ``llama3`` model spec, registered under the ``titan.models`` entry-point group."""

from __future__ import annotations

from titan_models.llama3.adapter import make_adapter
from titan_models.llama3.args import LLAMA3_FLAVORS, llama3_args
from titan_models.llama3.model import Llama3
from titan_models.llama3.parallelize import check_llama, parallelize_llama, pipeline_llama
from titan_models.spec import ModelSpec

__all__ = ["LLAMA3"]

LLAMA3 = ModelSpec(
    name="llama3",
    flavors=LLAMA3_FLAVORS,
    model_cls=Llama3,
    parallelize_fn=parallelize_llama,
    state_dict_adapter=make_adapter,
    args_fn=llama3_args,
    check_fn=check_llama,
    pipeline_fn=pipeline_llama,
)
"""Llama 3 for the trainer: flavors debugmodel, 1B, 3B, 8B, 70B, 405B."""
