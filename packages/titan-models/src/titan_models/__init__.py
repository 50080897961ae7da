"""titan-models: Llama 3, Qwen3 and DeepSeek-V3 for PyTorch pretraining, and the plans that
parallelize them.

Each family is its own module with its own ``__all__``: ``titan_models.llama3``,
``titan_models.qwen3``, ``titan_models.deepseek_v3`` (args and flavors, the model, the
Hugging Face adapter, ``parallelize_*``/``pipeline_*``/``check_*`` and the family's
``ModelSpec``). The top level holds what every family shares: ``ModelSpec`` (what a trainer
finds under the ``titan.models`` entry-point group), the parallelize and pipeline configs,
what a training step runs inside (``step_context``, ``reduce_loss``, ...), ``KVCache`` and
the errors (``ModelConfigError``, a ``ValueError``, under the root ``ModelError``). After a bare
``import titan_models`` each family is an attribute away (``titan_models.qwen3.Qwen3``).
"""

import importlib
import warnings

from titan_models.__about__ import __version__
from titan_models.errors import DEPRECATED_CONFIG_ERROR, ModelConfigError, ModelError
from titan_models.kv_cache import KVCache
from titan_models.ops import plain_loss
from titan_models.parallel import (
    ActivationCheckpointConfig,
    ParallelizeConfig,
    Pipeline,
    PipelineConfig,
    StepContext,
    check_seq_len,
    context_parallel_batch,
    reduce_loss,
    step_context,
)
from titan_models.spec import ModelSpec

__all__ = [
    "ActivationCheckpointConfig",
    "KVCache",
    "ModelConfigError",
    "ModelError",
    "ModelSpec",
    "ParallelizeConfig",
    "Pipeline",
    "PipelineConfig",
    "StepContext",
    "__version__",
    "check_seq_len",
    "context_parallel_batch",
    "plain_loss",
    "reduce_loss",
    "step_context",
]

# Names this module exported in 0.1, now in their family's (or a shared) module: importable
# from here for one more release, with a warning naming the new place.
_MOVED = {
    "llama3": "LLAMA3 LLAMA3_FLAVORS ROPE_SCALING_CHOICES Llama3 Llama3Args Llama3StateDictAdapter"
    " RopeScaling check_llama llama3_args make_adapter parallelize_llama pipeline_llama"
    " rope_scaling_of",
    "qwen3": "QWEN3 QWEN3_FLAVORS Qwen3 Qwen3Args Qwen3StateDictAdapter check_qwen3"
    " parallelize_qwen3 pipeline_qwen3 qwen3_args",
    "deepseek_v3": "DEEPSEEK_V3 DEEPSEEK_V3_FLAVORS DeepSeekV3 DeepSeekV3Args"
    " DeepSeekV3StateDictAdapter check_deepseek_v3 deepseek_v3_args parallelize_deepseek_v3"
    " pipeline_deepseek_v3",
    "moe": "MoE MoEArgs",
    "ops": "repeat_kv",
    "parallel": "apply_expert_parallel context_parallel_shard",
}
_MOVED_TO = {name: module for module, names in _MOVED.items() for name in names.split()}


def __getattr__(name: str) -> object:
    if name in ("llama3", "qwen3", "deepseek_v3"):  # ``titan_models.qwen3`` after a bare import
        return importlib.import_module(f"titan_models.{name}")
    if name == "ConfigError":  # its name in 0.1.0
        warnings.warn(DEPRECATED_CONFIG_ERROR, DeprecationWarning, stacklevel=2)
        return ModelConfigError
    if name in _MOVED_TO:
        module = f"titan_models.{_MOVED_TO[name]}"
        warnings.warn(
            f"titan_models.{name} moved to {module}.{name}; import it from there (the old "
            "place goes away in the next release).",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
