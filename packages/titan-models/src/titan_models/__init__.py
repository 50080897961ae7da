"""titan-models: Llama 3, DeepSeek-V3 and Qwen3 for PyTorch pretraining and the plans that
parallelize them.

``Llama3`` (flavors debugmodel to 405B, built on the meta device, then ``init_weights``),
``parallelize_llama`` (tensor + sequence parallel, context parallel, activation
checkpointing, per-block compile, FSDP2/HSDP/DDP, driven by ``titan_dims.ParallelDims`` and
``ParallelizeConfig``), ``pipeline_llama`` (stages and schedules from
``torch.distributed.pipelining``) and ``Llama3StateDictAdapter`` (to and from Hugging Face
``LlamaForCausalLM``); ``DeepSeekV3`` (flavors debugmodel to 671B, mixture-of-experts blocks
from ``titan_models.moe``) and ``DeepSeekV3StateDictAdapter`` (to and from
``DeepseekV3ForCausalLM``); ``Qwen3`` (dense and MoE flavors, debugmodel to 235B-A22B),
its plans ``parallelize_qwen3`` and ``pipeline_qwen3``, and ``Qwen3StateDictAdapter`` (to and
from ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``).
Every error raised for a setting that cannot work is a ``ModelConfigError`` (a
``ValueError``; ``ConfigError`` before, still importable for one release), under the
package's root ``ModelError``: see ``titan_models.errors``.
"""

import warnings

from titan_models.__about__ import __version__
from titan_models.deepseek_v3 import (
    DEEPSEEK_V3,
    DEEPSEEK_V3_FLAVORS,
    DeepSeekV3,
    DeepSeekV3Args,
    DeepSeekV3StateDictAdapter,
    check_deepseek_v3,
    deepseek_v3_args,
    parallelize_deepseek_v3,
    pipeline_deepseek_v3,
)
from titan_models.errors import DEPRECATED_CONFIG_ERROR, ModelConfigError, ModelError
from titan_models.kv_cache import KVCache
from titan_models.llama3 import (
    LLAMA3,
    LLAMA3_FLAVORS,
    ROPE_SCALING_CHOICES,
    Llama3,
    Llama3Args,
    Llama3StateDictAdapter,
    RopeScaling,
    check_llama,
    llama3_args,
    make_adapter,
    parallelize_llama,
    pipeline_llama,
    rope_scaling_of,
)
from titan_models.moe import MoE, MoEArgs
from titan_models.ops import plain_loss, repeat_kv
from titan_models.parallel import (
    ActivationCheckpointConfig,
    ParallelizeConfig,
    Pipeline,
    PipelineConfig,
    StepContext,
    apply_expert_parallel,
    check_seq_len,
    context_parallel_batch,
    context_parallel_shard,
    reduce_loss,
    step_context,
)
from titan_models.qwen3 import (
    QWEN3,
    QWEN3_FLAVORS,
    Qwen3,
    Qwen3Args,
    Qwen3StateDictAdapter,
    check_qwen3,
    parallelize_qwen3,
    pipeline_qwen3,
    qwen3_args,
)
from titan_models.spec import ModelSpec

__all__ = [
    "DEEPSEEK_V3",
    "DEEPSEEK_V3_FLAVORS",
    "LLAMA3",
    "LLAMA3_FLAVORS",
    "QWEN3",
    "QWEN3_FLAVORS",
    "ROPE_SCALING_CHOICES",
    "ActivationCheckpointConfig",
    "DeepSeekV3",
    "DeepSeekV3Args",
    "DeepSeekV3StateDictAdapter",
    "KVCache",
    "Llama3",
    "Llama3Args",
    "Llama3StateDictAdapter",
    "MoE",
    "MoEArgs",
    "ModelConfigError",
    "ModelError",
    "ModelSpec",
    "ParallelizeConfig",
    "Pipeline",
    "PipelineConfig",
    "Qwen3",
    "Qwen3Args",
    "Qwen3StateDictAdapter",
    "RopeScaling",
    "StepContext",
    "__version__",
    "apply_expert_parallel",
    "check_deepseek_v3",
    "check_llama",
    "check_qwen3",
    "check_seq_len",
    "context_parallel_batch",
    "context_parallel_shard",
    "deepseek_v3_args",
    "llama3_args",
    "make_adapter",
    "parallelize_deepseek_v3",
    "parallelize_llama",
    "parallelize_qwen3",
    "pipeline_deepseek_v3",
    "pipeline_llama",
    "pipeline_qwen3",
    "plain_loss",
    "qwen3_args",
    "reduce_loss",
    "repeat_kv",
    "rope_scaling_of",
    "step_context",
]


def __getattr__(name: str) -> type[ModelConfigError]:
    # ``ConfigError``, its name in 0.1.0, stays importable as ModelConfigError for one release.
    if name == "ConfigError":
        warnings.warn(DEPRECATED_CONFIG_ERROR, DeprecationWarning, stacklevel=2)
        return ModelConfigError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
