"""ParallelizeConfig and ActivationCheckpointConfig validation; per-device dtype defaults."""

from __future__ import annotations

import pytest
import torch

from titan_models import ActivationCheckpointConfig, ModelConfigError, ParallelizeConfig
from titan_models.parallel import auto_param_dtype, cpu_has_fast_bf16, resolve_param_dtype


def test_defaults_are_valid_and_conservative():
    config = ParallelizeConfig()
    assert config.activation_checkpoint.mode == "none"
    assert not config.compile
    assert config.loss_parallel
    assert config.cp_attention == "auto"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"param_dtype": "fp8"}, "param_dtype='fp8' is not allowed; choose one of 'auto'"),
        ({"reduce_dtype": "auto"}, "reduce_dtype='auto'"),
        ({"reshard_after_forward": "sometimes"}, "reshard_after_forward"),
        ({"compile": "yes"}, "compile='yes' is not allowed; it must be true or false"),
        ({"cp_attention": "ring"}, "cp_attention='ring' is not allowed; choose one of 'auto'"),
        ({"cp_rotate_method": "ring"}, "cp_rotate_method='ring'.*'allgather', 'alltoall'"),
    ],
)
def test_bad_parallelize_settings(kwargs, match):
    with pytest.raises(ModelConfigError, match=match):
        ParallelizeConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "partial"}, "activation_checkpoint.mode='partial'"),
        ({"mode": "selective", "selective_option": "0"}, "selective_option='0'"),
        ({"mode": "selective", "selective_option": "ops"}, "'op' or a whole number"),
    ],
)
def test_bad_activation_checkpoint_settings(kwargs, match):
    with pytest.raises(ModelConfigError, match=match):
        ActivationCheckpointConfig(**kwargs)


def test_nested_table_becomes_a_config():
    config = ParallelizeConfig(activation_checkpoint={"mode": "full"})
    assert config.activation_checkpoint.every_n_blocks == 1
    assert ActivationCheckpointConfig(mode="selective", selective_option="3").every_n_blocks == 3
    assert (
        ActivationCheckpointConfig(mode="selective", selective_option="op").every_n_blocks is None
    )


@pytest.mark.parametrize(
    ("device_type", "cpu_fast_bf16", "expected"),
    [
        ("cpu", False, torch.float32),
        ("cpu", True, torch.bfloat16),
        ("cuda", False, torch.bfloat16),
        ("cuda", True, torch.bfloat16),
        ("xpu", False, torch.bfloat16),
    ],
)
def test_auto_param_dtype_per_device(device_type, cpu_fast_bf16, expected):
    """bf16 where it is fast (accelerators, CPUs with bf16 instructions), fp32 elsewhere;
    the CPU capability is an input, so both CPU kinds are tested on any machine."""
    assert auto_param_dtype(device_type, cpu_fast_bf16) == expected
    assert resolve_param_dtype("auto", device_type, cpu_fast_bf16=cpu_fast_bf16) == expected


def test_param_dtype_names_and_this_machine():
    assert resolve_param_dtype("float32", "cuda") == torch.float32
    assert resolve_param_dtype("bfloat16", "cpu", cpu_fast_bf16=False) == torch.bfloat16
    # Without the capability given, this machine's CPU is asked.
    assert resolve_param_dtype("auto", "cpu") == auto_param_dtype("cpu", cpu_has_fast_bf16())


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype"])
def test_float16_is_refused_for_want_of_a_gradient_scaler(field):
    with pytest.raises(ModelConfigError, match=f"{field}='float16' is not allowed: fp16 needs"):
        ParallelizeConfig(**{field: "float16"})
