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

__all__ = [
    "DEEPSEEK_V3_FLAVORS",
    "DEEPSEEK_V3_ROPE_SCALINGS",
    "DeepSeekV3",
    "DeepSeekV3Args",
    "DeepSeekV3StateDictAdapter",
    "MultiHeadLatentAttention",
    "args_from_hf_config",
    "deepseek_v3_args",
    "make_adapter",
]
