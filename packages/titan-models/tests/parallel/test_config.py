"""ParallelizeConfig and ActivationCheckpointConfig validation; per-device dtype defaults."""

from __future__ import annotations

import pytest
import torch

from titan_models import ActivationCheckpointConfig, ConfigError, ParallelizeConfig
from titan_models.parallel import cpu_has_fast_bf16, resolve_param_dtype


def test_defaults_are_valid_and_conservative():
    config = ParallelizeConfig()
    assert config.activation_checkpoint.mode == "none"
    assert not config.compile
    assert config.loss_parallel


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"param_dtype": "fp8"}, "param_dtype='fp8' is not allowed; choose one of 'auto'"),
        ({"reduce_dtype": "auto"}, "reduce_dtype='auto'"),
        ({"reshard_after_forward": "sometimes"}, "reshard_after_forward"),
        ({"compile": "yes"}, "compile='yes' must be true or false"),
    ],
)
def test_bad_parallelize_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
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
    with pytest.raises(ConfigError, match=match):
        ActivationCheckpointConfig(**kwargs)


def test_nested_table_becomes_a_config():
    config = ParallelizeConfig(activation_checkpoint={"mode": "full"})
    assert config.activation_checkpoint.every_n_blocks == 1
    assert ActivationCheckpointConfig(mode="selective", selective_option="3").every_n_blocks == 3
    assert (
        ActivationCheckpointConfig(mode="selective", selective_option="op").every_n_blocks is None
    )


def test_param_dtype_per_device():
    assert resolve_param_dtype("auto", "cuda") == torch.bfloat16
    expected = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    assert resolve_param_dtype("auto", "cpu") == expected
    assert resolve_param_dtype("float32", "cuda") == torch.float32
