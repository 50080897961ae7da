"""DeepSeek-V3: args and flavors (debugmodel, 16B, 236B, 671B), the model (multi-head latent
attention with YaRN RoPE, dense then mixture-of-experts blocks), and the Hugging Face
adapter."""

from titan_models.deepseek_v3.adapter import (
    DeepSeekV3StateDictAdapter,
    args_from_hf_config,
    make_adapter,
)
from titan_models.deepseek_v3.args import (
    DEEPSEEK_V3_FLAVORS,
    DEEPSEEK_V3_ROPE_SCALINGS,
    DeepSeekV3Args,
    deepseek_v3_args,
)
from titan_models.deepseek_v3.model import DeepSeekV3, MultiHeadLatentAttention
from titan_models.deepseek_v3.parallelize import (
    apply_tp_deepseek_v3,
    check_deepseek_v3,
    parallelize_deepseek_v3,
    pipeline_deepseek_v3,
)
from titan_models.deepseek_v3.spec import DEEPSEEK_V3

__all__ = [
    "DEEPSEEK_V3",
    "DEEPSEEK_V3_FLAVORS",
    "DEEPSEEK_V3_ROPE_SCALINGS",
    "DeepSeekV3",
    "DeepSeekV3Args",
    "DeepSeekV3StateDictAdapter",
    "MultiHeadLatentAttention",
    "apply_tp_deepseek_v3",
    "args_from_hf_config",
    "check_deepseek_v3",
    "deepseek_v3_args",
    "make_adapter",
    "parallelize_deepseek_v3",
    "pipeline_deepseek_v3",
]
