"""JobConfig loading: defaults, TOML (with extends and torchtitan keys), CLI overrides, and
one clear error for each kind of bad input."""

import tomllib

import pytest

from titan_train.cli import main
from titan_train.compat import translate
from titan_train.config import JobConfig, parse_job_config
from titan_train.config.loader import ConfigError, read_toml
from titan_train.config.toml_writer import dumps


def test_defaults_train_the_debug_model_on_embedded_data():
    config = parse_job_config([])
    assert (config.model.name, config.model.flavor) == ("llama3", "debugmodel")
    assert config.training.dataset == "embedded"
    assert config.parallelism.data_parallel_shard_degree == -1
    assert config.checkpoint.enable


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text("[training]\nsteps = 7\nseq_len = 128\n[optimizer]\nlr = 0.01\n")
    child = tmp_path / "child.toml"
    child.write_text('extends = "base.toml"\n[training]\nsteps = 9\n')
    config = parse_job_config(
        [
            "--job.config_file",
            str(child),
            "--optimizer.lr",
            "0.5",
            "--training.local_batch_size",
            "3",
        ]
    )
    assert config.training.steps == 9  # child over base
    assert config.training.seq_len == 128  # from base
    assert config.optimizer.lr == 0.5  # CLI over file
    assert config.training.local_batch_size == 3
    assert config.job.config_file == str(child)


def test_torchtitan_keys_are_translated(tmp_path):
    path = tmp_path / "tt.toml"
    path.write_text(
        "[activation_checkpoint]\nmode = 'full'\n[compile]\nenable = true\n"
        "[parallelism]\ntensor_parallel_degree = 2\ndisable_loss_parallel = true\n"
        "pipeline_parallel_schedule = 'GPipe'\ncontext_parallel_rotate_method = 'alltoall'\n"
    )
    config = parse_job_config(["--job.config_file", str(path)])
    assert config.parallelize.activation_checkpoint.mode == "full"
    assert config.parallelize.compile is True
    assert config.parallelize.loss_parallel is False
    assert config.pipeline.schedule == "GPipe"
    assert config.parallelize.cp_rotate_method == "alltoall"
    assert config.parallelism.tensor_parallel_degree == 2


def test_translation_leaves_titan_keys_alone():
    values = {"training": {"steps": 3}, "parallelism": {"tensor_parallel_degree": 2}}
    assert translate(values).values == values


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[trainng]\nsteps = 3\n", "unknown section 'trainng'. Did you mean training?"),
        ("[training]\nstepz = 3\n", "unknown key 'training.stepz'. Did you mean training.steps?"),
        ("[training]\nsteps = 'ten'\n", "training.steps must be a whole number, got 'ten'"),
        (
            "[training]\nsteps = 0\n",
            "training.steps=0 is not allowed; it must be a whole number >= 1",
        ),
        ("[training]\ndeterministic = 1\n", "training.deterministic must be true or false"),
        ("training = 3\n", "[training] must be a table of keys"),
        (
            "[checkpoint]\nasync_mode = 'sometimes'\n",
            "checkpoint.async_mode = 'sometimes' is not one of",
        ),
        ("[parallelism]\ntensor_parallel_degree = 0\n", "parallelism.tensor_parallel_degree=0"),
        ("[optimizer]\nname = 'Adamw'\n", "optimizer.name"),
        ("[training\n", "is not valid TOML"),
        (  # past int64: it would reach torch.manual_seed and overflow there
            "[training]\nseed = 12345678901234567890123\n",
            "training.seed=12345678901234567890123 is not allowed; a whole number here must be "
            "in [-9223372036854775808, 9223372036854775807]",
        ),
        (  # past the longest timedelta, which torch takes
            "[comm]\ninit_timeout_seconds = 9223372036854775807\n",
            "comm.init_timeout_seconds=9223372036854775807 is not allowed; it must be a whole "
            "number in [1, 86399999913600] (seconds)",
        ),
    ],
)
def test_bad_toml_is_one_clear_error(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as error:
        parse_job_config(["--job.config_file", str(path)])
    assert message in str(error.value)
    assert str(path) in str(error.value)


def test_extends_loop_and_missing_files(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="extend each other in a loop"):
        read_toml(tmp_path / "a.toml")
    with pytest.raises(ConfigError, match="does not exist"):
        read_toml(tmp_path / "missing.toml")


def test_bad_cli_values_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_job_config(["--training.steps", "many"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        parse_job_config(["--training.local_batch_size", "-4"])
    assert exit_info.value.code == 2
    assert "training.local_batch_size=-4 is not allowed" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag", ["--training.steps", "--training.seed", "--checkpoint.hf_max_shard_size"]
)
def test_whole_numbers_past_64_bits_stop_before_anything_is_written(tmp_path, capsys, flag):
    out = tmp_path / "out"
    huge = str(10**30)
    assert main(["train", "--job.dump_folder", str(out), flag, huge]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"titan-train: error: command line: {flag[2:]}={huge} is not allowed; a whole number "
        "here must be in [-9223372036854775808, 9223372036854775807] (a 64-bit integer: "
        "-2**63 .. 2**63 - 1)."
    )
    assert not out.exists()


def test_merged_config_round_trips_through_toml(tmp_path):
    config = parse_job_config(["--training.steps", "11", "--optimizer.betas", "0.8", "0.99"])
    text = dumps(config.to_dict())
    path = tmp_path / "merged.toml"
    path.write_text(text)
    again = parse_job_config(["--job.config_file", str(path)])
    again.job.config_file = None
    assert again == config
    assert tomllib.loads(text)["training"]["steps"] == 11


def test_help_lists_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_job_config(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--training.steps",
        "--optimizer.lr",
        "--checkpoint.interval",
        "--parallelism.tensor_parallel_degree",
        "--metrics.log_freq",
    ):
        assert option in out
    assert isinstance(JobConfig(), JobConfig)


def test_the_seed_checkpoint_is_a_trainer_setting_under_torchtitans_key(tmp_path):
    """``checkpoint.create_seed_checkpoint`` is titan-train's (``CheckpointSection``), not
    titan-ckpt's ``CheckpointConfig``; torchtitan's TOML key and flag still set it."""
    from titan_ckpt import CheckpointConfig
    from titan_train.config import CheckpointSection

    assert "create_seed_checkpoint" not in CheckpointConfig.__dataclass_fields__
    assert CheckpointSection.__dataclass_fields__["create_seed_checkpoint"].default is False
    path = tmp_path / "seed.toml"
    path.write_text("[checkpoint]\nenable_checkpoint = true\ncreate_seed_checkpoint = true\n")
    assert parse_job_config(["--job.config_file", str(path)]).checkpoint.create_seed_checkpoint
    assert parse_job_config(
        ["--checkpoint.create_seed_checkpoint"]
    ).checkpoint.create_seed_checkpoint
    with pytest.raises(ConfigError, match=r"^checkpoint.create_seed_checkpoint=true needs "):
        CheckpointSection(create_seed_checkpoint=True, enable=False)
    with pytest.raises(ConfigError, match=r"needs .* checkpoint.load_only=false"):
        CheckpointSection(create_seed_checkpoint=True, load_only=True)
