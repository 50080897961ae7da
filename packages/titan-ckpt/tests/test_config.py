"""CheckpointConfig: torchtitan's keys and defaults, and one clear error per bad value."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_ckpt import CheckpointConfig, CheckpointConfigError


def test_defaults_match_torchtitan_but_save():
    c = CheckpointConfig()
    # A library's config saves by default (torchtitan's enable is false).
    assert (c.enable, c.folder, c.interval, c.async_mode) == (True, "checkpoint", 500, "disabled")
    assert (c.keep_latest_k, c.load_step, c.exclude_from_loading) == (10, -1, [])
    assert (c.initial_load_path, c.initial_load_model_only, c.initial_load_in_hf) == (
        None,
        True,
        False,
    )
    assert (c.last_save_model_only, c.last_save_in_hf, c.export_dtype) == (True, False, "float32")
    assert (c.enable_first_step_checkpoint, c.load_only) == (False, False)
    assert c.export_torch_dtype is torch.float32
    assert c.hf_max_shard_size == 5 << 30  # ours: torchtitan writes one file


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_latest_k": 1}, r"keep_latest_k=1 is not allowed.*at least 2"),
        (
            {"keep_latest_k": -3},
            r"keep_latest_k=-3 is not allowed; it must be a whole number >= 0\.",
        ),
        ({"interval": 0}, r"interval=0 is not allowed; it must be a whole number >= 1\."),
        ({"interval": 2.5}, r"interval=2.5 is not allowed; it must be a whole number >= 1"),
        (
            {"load_step": -2},
            r"load_step=-2 is not allowed; it must be -1 \(the newest committed step\) or a "
            r"whole number >= 0\.",
        ),
        (
            {"async_mode": "fast"},
            r"async_mode='fast' is not allowed; choose one of 'disabled', 'async', 'async_with",
        ),
        (
            {"export_dtype": "int8"},
            r"export_dtype='int8' is not allowed; choose one of 'float32', 'bfloat16'",
        ),
        ({"exclude_from_loading": ["model"]}, r"names 'model'.*always restores the model"),
        ({"folder": ""}, r"folder='' must be a non-empty"),
        ({"enable": "yes"}, r"enable='yes' is not allowed; it must be true or false"),
        ({"last_save_in_hf": True, "last_save_model_only": False}, r"needs .*last_save_model_only"),
        (
            {
                "initial_load_in_hf": True,
                "initial_load_path": "x",
                "initial_load_model_only": False,
            },
            r"needs checkpoint.initial_load_model_only=true",
        ),
        ({"initial_load_in_hf": True}, r"needs checkpoint.initial_load_path"),
        (
            {"hf_max_shard_size": 0},
            r"hf_max_shard_size=0 is not allowed; it must be a whole number >= 1",
        ),
        (
            {"hf_max_shard_size": "5GB"},
            r"hf_max_shard_size='5GB' is not allowed; it must be a whole number",
        ),
    ],
)
def test_bad_values_are_refused_naming_key_and_value(kwargs, match):
    with pytest.raises(CheckpointConfigError, match=match):
        CheckpointConfig(**kwargs)


def test_exclude_from_loading_accepts_a_comma_separated_string():
    c = CheckpointConfig(exclude_from_loading="dataloader, lr_scheduler")
    assert c.exclude_from_loading == ["dataloader", "lr_scheduler"]


def test_config_error_is_a_value_error():
    assert issubclass(CheckpointConfigError, ValueError)


def test_trainer_settings_are_not_the_librarys():
    """A seed-checkpoint run and torchft's per-replica dataloader saves are a trainer's
    policy (titan-train's ``[checkpoint]`` section has them, under torchtitan's keys); a
    plain loop writes a seed with ``save(0, force=True, model_only=True)``."""
    names = {f.name for f in dataclasses.fields(CheckpointConfig)}
    assert not names & {"create_seed_checkpoint", "enable_ft_dataloader_checkpoints"}
    with pytest.raises(TypeError, match="create_seed_checkpoint"):
        CheckpointConfig(create_seed_checkpoint=True)
