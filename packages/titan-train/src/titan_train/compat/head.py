"""torchtitan's 2026 configurations in titan: ``titan-train --module llama3 --config
llama3_debugmodel``, from a table.

torchtitan's main branch configures a run with a Python function returning its
``Trainer.Config`` (each model's ``config_registry.py``), picked with ``--module`` and
``--config``. titan keeps the facts, not the code: ``CONFIGS`` holds, for the llama3,
deepseek_v3 and qwen3 registries at ``HEAD_COMMIT``, each function's name and the values it
sets over ``HEAD_DEFAULTS`` in torchtitan's key names (``compat.KEYS`` translates them), and
in ``model_args`` where its model differs from titan's flavor. A function asking for a
feature titan lacks is refused in one line naming one that runs; what changes only speed is
logged (``notes``). Nothing of torchtitan is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from titan_train.errors import ConfigError

__all__ = [
    "CONFIGS",
    "HEAD_COMMIT",
    "HEAD_DEFAULTS",
    "HeadConfig",
    "head_config",
    "preset_values",
]

HEAD_COMMIT = "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"
"""The torchtitan commit the table was read from (main, 2026-08-21)."""

_AC_OP = {  # torchtitan's SelectiveAC: per-op selective recomputation
    "parallelize.activation_checkpoint.mode": "selective",
    "parallelize.activation_checkpoint.selective_option": "op",
}
_AC_FULL = {"parallelize.activation_checkpoint.mode": "full"}

HEAD_DEFAULTS: Mapping[str, Any] = {
    "hf_assets_path": "./tests/assets/tokenizer",
    "dump_folder": "./outputs",
    "profiler.enable_profiling": False,
    "profiler.save_traces_folder": "profiling/traces",
    "profiler.profile_freq": 10,
    "profiler.profiler_active": 1,
    "profiler.profiler_warmup": 3,
    "profiler.enable_memory_snapshot": False,
    "profiler.save_memory_snapshot_folder": "profiling/memory_snapshot",
    "metrics.log_freq": 10,
    "metrics.enable_tensorboard": False,
    "metrics.save_tb_folder": "tb",
    "metrics.enable_wandb": False,
    "metrics.tensorboard_names": "torchtitan",  # titan key: torchtitan's tags
    # default_adamw(lr=...), which every registered function calls
    "optimizer.param_groups.0.optimizer_name": "AdamW",
    "optimizer.param_groups.0.optimizer_kwargs.betas": [0.9, 0.95],
    "optimizer.param_groups.0.optimizer_kwargs.eps": 1e-8,
    "optimizer.param_groups.0.optimizer_kwargs.weight_decay": 0.1,
    "optimizer.implementation": "fused",
    "lr_scheduler.warmup_steps": 200,
    "lr_scheduler.decay_type": "linear",
    "lr_scheduler.min_lr_factor": 0.0,
    "training.num_tokens_per_microbatch_per_dp_rank": 16384,
    "training.num_tokens_per_train_step": -1,
    "training.max_context_length": 2048,
    "training.max_norm": 1.0,
    "training.steps": 10000,
    "training.mixed_precision_param": "bfloat16",
    "training.mixed_precision_reduce": "float32",
    "training.gc_freq": 50,
    "parallelism.data_parallel_replicate_degree": 1,
    "parallelism.data_parallel_shard_degree": -1,
    "parallelism.fsdp_reshard_after_forward": "default",
    "parallelism.tensor_parallel_degree": 1,
    "parallelism.pipeline_parallel_degree": 1,
    "parallelism.pipeline_parallel_schedule": "1F1B",
    "parallelism.num_pp_microbatches": 1,
    "parallelism.context_parallel_degree": 1,
    "parallelism.expert_parallel_degree": 1,
    "checkpoint.enable": False,
    "checkpoint.folder": "checkpoint",
    "checkpoint.interval": 500,
    "checkpoint.last_save_model_only": True,
    "checkpoint.export_dtype": "float32",
    "checkpoint.keep_latest_k": 10,
    "checkpoint.async_mode": "disabled",
    "compile.enable": False,
    "compile.backend": "inductor",
    "validator.enable": False,
    "validator.freq": 10,
    "validator.steps": -1,
    # torchtitan's language models attend within each document of a packed sequence, its
    # positions restarting at each (block-causal masks, whatever the attention backend)
    "training.document_masking": True,
    "training.document_positions": "restart",
    **_AC_OP,
}
"""torchtitan's ``Trainer.Config()`` at ``HEAD_COMMIT``, by its keys, where titan has the
setting; every entry of ``CONFIGS`` starts from these."""

_SHUFFLED = (
    "data order: torchtitan's dataloader shuffles this dataset (its default); titan reads "
    "documents in order"
)
_CONVERTERS = (
    "it trains with torchao's low-precision linear layers (float8/MX/NVFP4 converters), which "
    "titan does not have"
)
_DEEPEP = "it routes MoE tokens with DeepEP/HybridEP all-to-all, which titan does not have"


@dataclass(frozen=True, kw_only=True)
class HeadConfig:
    """One function of a torchtitan ``config_registry`` at ``HEAD_COMMIT``, as facts."""

    model: str = ""
    """titan's model name (torchtitan's ``model_registry`` module)."""
    flavor: str = ""
    """titan's flavor (the name passed to torchtitan's ``model_registry``)."""
    base: str = ""
    """The function of the same module this one starts from (``config = llama3_debugmodel()``)."""
    sets: Mapping[str, Any] = field(default_factory=dict)
    """What it sets beyond ``HEAD_DEFAULTS`` (or its base), by torchtitan's key; titan keys
    where torchtitan has no flag (``training.dataset``, activation checkpointing)."""
    model_args: Mapping[str, Any] = field(default_factory=dict)
    """Where torchtitan's model differs from titan's flavor: ``[model.args]``."""
    shuffled: bool = True
    """Whether torchtitan shuffles the data (its dataloader's default)."""
    notes: tuple[str, ...] = ()
    """What it sets that changes speed, not results, here: logged."""
    refused: str = ""
    """Why titan cannot train it (one line; names a function that runs)."""


def _debug(lr: float = 8e-4, **sets: Any) -> dict[str, Any]:
    """The values torchtitan's debug functions share."""
    return {
        "metrics.log_freq": 1,
        "optimizer.param_groups.0.optimizer_kwargs.lr": lr,
        "lr_scheduler.warmup_steps": 2,
        "lr_scheduler.decay_ratio": 0.8,
        "training.steps": 10,
        "checkpoint.interval": 10,
        "checkpoint.last_save_model_only": False,
        "training.dataset": "c4_test",
        "validation.dataset": "c4_validation",
        **sets,
    }


def _big(hf: str, lr: float, **sets: Any) -> dict[str, Any]:
    """The values torchtitan's full-size functions share."""
    return {
        "hf_assets_path": f"./assets/hf/{hf}",
        "optimizer.param_groups.0.optimizer_kwargs.lr": lr,
        "training.dataset": "c4",
        "validation.dataset": "c4_validation",
        **sets,
    }


def _refused(why: str, instead: str) -> HeadConfig:
    return HeadConfig(refused=f"{why}; train {instead} instead")


_LLAMA3_DEBUG = {"vocab_size": 2048}
_LLAMA3_BIG = {"vocab_size": 128256}


def _llama3_big(hf: str, lr: float, tokens: int, **sets: Any) -> dict[str, Any]:
    return _big(
        hf,
        lr,
        **{
            "profiler.enable_profiling": True,
            "profiler.profile_freq": 100,
            "metrics.enable_tensorboard": True,
            "training.num_tokens_per_microbatch_per_dp_rank": tokens,
            "training.max_context_length": 8192,
            "training.steps": 1000,
            "validator.freq": 500,
            "validator.steps": 1200,
        },
        **sets,
    )


_DSV3_16B = {
    "lr_scheduler.decay_ratio": 0.8,
    "lr_scheduler.decay_type": "cosine",
    "lr_scheduler.min_lr_factor": 0.1,
    "training.max_context_length": 4096,
    "training.disable_cuda_graphs": True,
    "parallelism.pipeline_parallel_schedule": "Interleaved1F1B",
    "compile.enable": True,
    "compile.components": ["loss"],
}
_ALL_ONE = {  # the minimal_async_ep functions: one rank of everything, no sequence parallel
    "parallelism.data_parallel_replicate_degree": 1,
    "parallelism.data_parallel_shard_degree": 1,
    "parallelism.tensor_parallel_degree": 1,
    "parallelism.context_parallel_degree": 1,
    "parallelism.pipeline_parallel_degree": 1,
    "parallelism.expert_parallel_degree": 1,
    "parallelism.enable_sequence_parallel": False,
}
_MINIMAL_ASYNC_EP = "moe_comm_backend minimal_async_ep: an all-to-all implementation, ignored"
_QWEN3_BIG = {
    "training.max_context_length": 4096,
    "checkpoint.last_save_model_only": False,
    "checkpoint.export_dtype": "float16",
}
_QWEN3_VOCAB = {"vocab_size": 151936}


def _qwen3_big(flavor: str, hf: str, tokens: int | None = None) -> HeadConfig:
    """qwen3_14b, qwen3_30b_a3b, qwen3_32b: full activation checkpointing, 3,000 steps."""
    sets = {"lr_scheduler.warmup_steps": 600, "training.steps": 3000, **_AC_FULL}
    if tokens is not None:
        sets["training.num_tokens_per_microbatch_per_dp_rank"] = tokens
    return HeadConfig(
        model="qwen3",
        flavor=flavor,
        sets=_big(hf, 8e-4, **_QWEN3_BIG, **sets),
        model_args=_QWEN3_VOCAB,
    )


CONFIGS: Mapping[str, Mapping[str, HeadConfig]] = {
    "llama3": {
        "llama3_debugmodel": HeadConfig(
            model="llama3",
            flavor="debugmodel",
            sets=_debug(
                **{
                    "training.dataset": "c4_test",
                    "validation.dataset": "c4_test",
                    "parallelism.pipeline_parallel_schedule": "Interleaved1F1B",
                    "validator.freq": 5,
                    "validator.steps": 10,
                }
            ),
            model_args=_LLAMA3_DEBUG,
            shuffled=False,
        ),
        "llama3_debugmodel_ce_loss": HeadConfig(
            base="llama3_debugmodel",
            notes=("loss: plain cross-entropy, as titan's (the chunked one gives the same loss)",),
        ),
        "llama3_debugmodel_varlen_attn": HeadConfig(
            base="llama3_debugmodel",
            sets={"training.disable_cuda_graphs": True},
            notes=("attn_backend varlen: another kernel for the same document-masked attention",),
        ),
        "llama3_debugmodel_dist_gemm": HeadConfig(
            base="llama3_debugmodel",
            sets={"parallelism.spmd_backend": "spmd_types"},
            notes=("tp_gemm_backend dist_gemm: TP collectives fused into matmuls, same numbers",),
        ),
        "llama3_debugmodel_float8": _refused(_CONVERTERS, "llama3_debugmodel"),
        "llama3_debugmodel_float8_emulate_lora": _refused(
            f"{_CONVERTERS} (and LoRA adapters)", "llama3_debugmodel"
        ),
        "llama3_debugmodel_nvfp4": _refused(_CONVERTERS, "llama3_debugmodel"),
        "llama3_debugmodel_first_85_pct_layers_nvfp4": _refused(_CONVERTERS, "llama3_debugmodel"),
        "llama3_8b": HeadConfig(
            model="llama3",
            flavor="8B",
            sets=_llama3_big("Llama-3.1-8B", 3e-4, 8192),
            model_args=_LLAMA3_BIG,
        ),
        "llama3_8b_first_85_pct_layers_nvfp4": _refused(_CONVERTERS, "llama3_8b"),
        "llama3_8b_mxfp8": _refused(_CONVERTERS, "llama3_8b"),
        "llama3_70b": HeadConfig(
            model="llama3",
            flavor="70B",
            sets={
                **_llama3_big("Llama-3.1-70B", 1.5e-4, 65536),
                "parallelism.tensor_parallel_degree": 8,
                **_AC_FULL,
            },
            model_args=_LLAMA3_BIG,
        ),
        "llama3_405b": _refused(_CONVERTERS, "llama3_70b"),
        "sft_debugmodel": _refused(
            "it fine-tunes on chat data (question/answer messages, first-fit packing), which "
            "titan's pretraining data path does not read",
            "llama3_debugmodel",
        ),
    },
    "deepseek_v3": {
        "deepseek_v3_debugmodel": HeadConfig(
            model="deepseek_v3",
            flavor="debugmodel",
            sets=_debug(),
            # torchtitan's debug model: 6 blocks, 2,048 rows; its RoPE table spans 16,384
            # positions, so YaRN applies (max_seq_len > original_seq_len) at any length.
            model_args={"vocab_size": 2048, "n_layers": 6, "max_seq_len": 16384},
        ),
        "deepseek_v3_debugmodel_mtp": _refused(
            "it adds a multi-token-prediction block and loss, which titan does not have",
            "deepseek_v3_debugmodel",
        ),
        "deepseek_v3_debugmodel_mxfp8": _refused(_CONVERTERS, "deepseek_v3_debugmodel"),
        "deepseek_v3_debugmodel_hybridep": _refused(_DEEPEP, "deepseek_v3_debugmodel"),
        "deepseek_v3_debugmodel_minimal_async_ep": HeadConfig(
            base="deepseek_v3_debugmodel", sets=_ALL_ONE, notes=(_MINIMAL_ASYNC_EP,)
        ),
        "deepseek_v3_16b": HeadConfig(
            model="deepseek_v3",
            flavor="16B",
            sets=_big(
                "deepseek-moe-16b-base",
                2.2e-4,
                **_DSV3_16B,
                **{
                    "training.steps": 1000,
                    "parallelism.expert_parallel_degree": 8,
                    "checkpoint.interval": 10,
                },
            ),
            model_args={"vocab_size": 102400, "max_seq_len": 16384},
        ),
        "deepseek_v3_16b_hybridep": _refused(_DEEPEP, "deepseek_v3_16b"),
        "deepseek_v3_16b_minimal_async_ep": HeadConfig(
            base="deepseek_v3_16b",
            sets={**_ALL_ONE, "training.disable_cuda_graphs": False},
            notes=(_MINIMAL_ASYNC_EP,),
        ),
        "deepseek_v3_671b": HeadConfig(
            model="deepseek_v3",
            flavor="671B",
            sets=_big(
                "DeepSeek-V3.1-Base",
                2.2e-4,
                **_DSV3_16B,
                **{"lr_scheduler.warmup_steps": 2000, "parallelism.expert_parallel_degree": 2},
            ),
            model_args={"vocab_size": 129280, "max_seq_len": 16384},
        ),
        "deepseek_v3_671b_float8": _refused(_CONVERTERS, "deepseek_v3_671b"),
    },
    "qwen3": {
        "qwen3_debugmodel": HeadConfig(
            model="qwen3",
            flavor="debugmodel",
            sets=_debug(),
            model_args={"vocab_size": 2048},
            shuffled=False,
        ),
        "qwen3_debugmodel_non_fused_qkv": HeadConfig(
            base="qwen3_debugmodel",
            notes=("separate q/k/v projections in place of a fused one: the same model",),
        ),
        "qwen3_debugmodel_flex_flash": HeadConfig(
            base="qwen3_debugmodel",
            notes=("attn_backend flex_flash: FlexAttention's flash kernel, same attention",),
        ),
        "qwen3_debugmodel_nvfp4": _refused(_CONVERTERS, "qwen3_debugmodel"),
        "qwen3_debugmodel_first_85_pct_layers_nvfp4": _refused(_CONVERTERS, "qwen3_debugmodel"),
        "qwen3_debugmodel_moe_param_groups": _refused(
            "it steps the router with Adam and the rest with AdamW (three optimizer groups); "
            "titan runs one optimizer (optimizer.param_group_rules set per-parameter lr and "
            "weight decay)",
            "qwen3_moe_debug",
        ),
        "qwen3_moe_debug": HeadConfig(
            model="qwen3",
            flavor="debugmodel_moe",
            sets=_debug(
                3e-4,
                **{
                    "lr_scheduler.decay_ratio": None,
                    "training.max_context_length": 4096,
                    "checkpoint.export_dtype": "float16",
                },
            ),
            # torchtitan's MoE debug model routes each token to 8 of 64 experts; titan's
            # debugmodel_moe flavor to 2 of 8 (CPU-sized).
            model_args={"vocab_size": 2048, "num_experts": 64, "top_k": 8},
            shuffled=False,
        ),
        "qwen3_moe_deepep": _refused(_DEEPEP, "qwen3_moe_debug"),
        "qwen3_0_6b": HeadConfig(
            model="qwen3",
            flavor="0.6B",
            sets=_big(
                "Qwen3-0.6B",
                3e-4,
                **_QWEN3_BIG,
                **{
                    "metrics.log_freq": 1,
                    "lr_scheduler.warmup_steps": 2,
                    "training.steps": 10,
                },
            ),
            model_args=_QWEN3_VOCAB,
        ),
        "qwen3_1_7b": HeadConfig(
            model="qwen3",
            flavor="1.7B",
            sets=_big(
                "Qwen3-1.7B",
                8e-4,
                **_QWEN3_BIG,
                **{
                    "lr_scheduler.warmup_steps": 20,
                    "training.steps": 100,
                    "checkpoint.interval": 50,
                },
            ),
            model_args=_QWEN3_VOCAB,
        ),
        "qwen3_8b_first_85_pct_layers_nvfp4": _refused(_CONVERTERS, "qwen3_14b"),
        "qwen3_14b": _qwen3_big("14B", "Qwen3-14B"),
        "qwen3_30b_a3b": _qwen3_big("30B-A3B", "Qwen3-30B-A3B", tokens=8192),
        "qwen3_32b": _qwen3_big("32B", "Qwen3-32B", tokens=8192),
        "sft_qwen3_8b_math": _refused(
            "it fine-tunes on chat data (GSM8K question/answer messages) from Hugging Face "
            "weights, which titan's pretraining data path does not read",
            "qwen3_14b",
        ),
    },
}
"""torchtitan's registered configuration functions at ``HEAD_COMMIT``, by ``--module`` and
``--config``."""


def head_config(module: str, name: str) -> HeadConfig:
    """The entry of ``--module module --config name`` (``module`` as torchtitan takes it:
    ``llama3``, ``torchtitan.models.llama3[.config_registry]``); ``ConfigError`` otherwise."""
    short = module.removeprefix("torchtitan.models.").removesuffix(".config_registry")
    functions = CONFIGS.get(short)
    if functions is None:
        raise ConfigError(
            f"--module {module}: titan knows torchtitan's configurations of "
            f"{', '.join(CONFIGS)} (torchtitan {HEAD_COMMIT[:9]}); for another, write its "
            "settings as a titan TOML file (--job.config_file)."
        )
    entry = functions.get(name)
    if entry is None:
        raise ConfigError(
            f"--config {name} is not a configuration of torchtitan's {short} (at "
            f"{HEAD_COMMIT[:9]}); choose one of {', '.join(functions)}."
        )
    if entry.refused:
        raise ConfigError(
            f"torchtitan's {short}.{name} cannot be trained by titan: {entry.refused}."
        )
    return entry


def preset_values(module: str, name: str) -> tuple[dict[str, Any], list[str]]:
    """``--module module --config name`` as one flat dict (torchtitan's keys, titan's where it
    has no flag, ``model.args.*``), and a line for each thing not carried."""
    entry = head_config(module, name)
    chain = [entry]
    while chain[-1].base:
        chain.append(head_config(module, chain[-1].base))
    root = chain[-1]
    flat: dict[str, Any] = {**HEAD_DEFAULTS}
    for link in reversed(chain):
        flat.update(link.sets)
    flat["model.name"], flat["model.flavor"] = root.model, root.flavor
    flat.update({f"model.args.{k}": v for k, v in root.model_args.items()})
    flat = {k: v for k, v in flat.items() if v is not None}  # None: torchtitan's unset
    notes = [_SHUFFLED] if root.shuffled else []
    notes += [note for link in chain for note in link.notes]
    return flat, notes
