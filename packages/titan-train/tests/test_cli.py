"""The titan-train command: subcommands, and 40+ bad configurations that must each end with
one clear message and exit status 2 before anything is written."""

import tomllib

import pytest
import torch.distributed as dist

from titan_train.cli import main

REPLICA_2 = ["--fault_tolerance.replica_id", "2"]
MIN_3 = ["--fault_tolerance.min_replica_size", "3"]

# (arguments, text the one error message must contain)
BAD_COMMAND_LINES = [
    (["--training.steps", "abc"], "--training.steps"),
    (["--training.steps", "0"], "training.steps=0 is not allowed"),
    (["--training.local_batch_size", "-1"], "training.local_batch_size=-1"),
    (["--training.seq_len", "0"], "training.seq_len=0"),
    (["--training.max_norm", "-1"], "training.max_norm=-1.0"),
    (["--training.global_batch_size", "0"], "training.global_batch_size=0"),
    (["--training.gc_freq", "0"], "training.gc_freq=0"),
    (["--optimizer.name", "Adamw"], "optimizer.name"),
    (["--optimizer.lr", "-1"], "optimizer.lr"),
    (["--optimizer.betas", "1.5", "0.9"], "optimizer.betas"),
    (["--optimizer.implementation", "turbo"], "optimizer.implementation"),
    (["--optimizer.eps", "-1"], "optimizer.eps"),
    (["--optimizer.muon.adjust_lr_fn", "none"], "optimizer.muon.adjust_lr_fn"),
    (["--lr_scheduler.decay_type", "exp"], "decay_type"),
    (["--lr_scheduler.warmup_steps", "-1"], "warmup_steps"),
    (["--lr_scheduler.min_lr_factor", "2"], "min_lr_factor"),
    (["--checkpoint.async_mode", "sometimes"], "--checkpoint.async_mode"),
    (["--checkpoint.keep_latest_k", "1"], "keep_latest_k"),
    (["--checkpoint.interval", "0"], "interval"),
    (["--checkpoint.exclude_from_loading", "model"], "exclude_from_loading"),
    (["--checkpoint.export_dtype", "int8"], "--checkpoint.export_dtype"),
    (["--parallelism.tensor_parallel_degree", "0"], "parallelism.tensor_parallel_degree=0"),
    (["--parallelism.data_parallel_shard_degree", "-3"], "data_parallel_shard_degree=-3"),
    (["--parallelize.param_dtype", "float8"], "param_dtype"),
    (["--parallelize.activation_checkpoint.mode", "partial"], "activation_checkpoint.mode"),
    (["--parallelize.activation_checkpoint.selective_option", "x"], "selective_option"),
    (["--parallelize.reshard_after_forward", "sometimes"], "reshard_after_forward"),
    (["--pipeline.schedule", "Fancy"], "pipeline.schedule"),
    (["--pipeline.microbatch_size", "0"], "pipeline.microbatch_size"),
    (["--metrics.log_freq", "0"], "log_freq"),
    (["--validation.freq", "0"], "validation.freq=0"),
    (["--validation.steps", "0"], "validation.steps=0"),
    (["--profiling.profile_freq", "2"], "fit in profile_freq=2"),
    (["--profiling.profiler_active", "0"], "profiling.profiler_active=0"),
    (["--fault_tolerance.enable"], "fault_tolerance.group_size=0 is not allowed"),
    (
        ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", *REPLICA_2],
        "fault_tolerance.replica_id=2 is out of range",
    ),
    (
        ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", *MIN_3],
        "min_replica_size=3 is not",
    ),
    (["--fault_tolerance.process_group_timeout_ms", "0"], "process_group_timeout_ms=0"),
    (["--fault_tolerance.process_group", "mpi"], "--fault_tolerance.process_group"),
    (["--comm.init_timeout_seconds", "0"], "comm.init_timeout_seconds=0"),
    (["--comm.train_timeout_seconds", "-5"], "comm.train_timeout_seconds=-5"),
    (["--no.such.option", "1"], "--no.such.option"),
    (["--nproc-per-node", "zero"], "--nproc-per-node needs a whole number"),
    (["--job.config_file"], "--job.config_file needs a file name"),
    # Refused once the layout, model and data are known, still before any work:
    (["--parallelism.tensor_parallel_degree", "2"], "does not divide world_size(1)"),
    (["--parallelism.pipeline_parallel_degree", "2"], "does not divide world_size(1)"),
    (["--training.global_batch_size", "12"], "must be a multiple of local_batch_size"),
    (["--model.name", "gpt5"], "model.name='gpt5' is not a registered model"),
    (["--model.flavor", "13B"], "model.flavor='13B' is not a flavor of llama3"),
    (["--model.tokenizer_path", "/no/such/tokenizer.model"], "/no/such/tokenizer.model"),
    (["--training.dataset", "/no/such/data.jsonl"], "/no/such/data.jsonl"),
    (["--training.seq_len", "101"], "training.seq_len=101 must be divisible by 2"),
    (
        ["--validation.enable", "--validation.seq_len", "101"],
        "validation.seq_len=101 must be divisible by 2",
    ),
]

BAD_FILES = [
    ("[trainng]\nsteps = 3\n", "unknown section 'trainng'"),
    ("[training]\nstepz = 3\n", "unknown key 'training.stepz'"),
    ("[training]\nsteps = 'ten'\n", "training.steps must be a whole number"),
    ("[training\n", "is not valid TOML"),
    ('extends = "missing.toml"\n', "does not exist"),
]


def _run(args, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["train", "--job.dump_folder", str(out), *args])
    err = capsys.readouterr().err
    return code, err, out


@pytest.mark.parametrize(("args", "message"), BAD_COMMAND_LINES, ids=lambda v: str(v)[:40])
def test_bad_command_line_exits_2(args, message, tmp_path, capsys):
    try:
        code, err, out = _run(args, tmp_path, capsys)
    except SystemExit as exit_info:  # tyro's own parse errors
        code, err, out = exit_info.code, capsys.readouterr().err, tmp_path / "out"
    assert code == 2
    assert message in err
    assert not out.exists(), "a refused configuration must write nothing"
    assert not dist.is_initialized()


@pytest.mark.parametrize(("toml", "message"), BAD_FILES, ids=lambda v: str(v)[:30])
def test_bad_config_file_exits_2(toml, message, tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    code, err, out = _run(["--job.config_file", str(path)], tmp_path, capsys)
    assert code == 2
    assert err.startswith("titan-train: error: ")
    assert message in err
    assert not out.exists()


def test_at_least_forty_bad_configurations_are_covered():
    assert len(BAD_COMMAND_LINES) + len(BAD_FILES) >= 40


def test_config_prints_the_merged_config_as_toml(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("[training]\nsteps = 7\n")
    assert main(["config", "--print", "--job.config_file", str(path), "--optimizer.lr", "0.5"]) == 0
    merged = tomllib.loads(capsys.readouterr().out)
    assert merged["training"]["steps"] == 7
    assert merged["optimizer"]["lr"] == 0.5
    assert merged["model"] == {"name": "llama3", "flavor": "debugmodel", "rope_scaling": "flavor"}


def test_list_models(capsys):
    assert main(["list-models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "llama3: debugmodel, 1B, 3B, 8B, 70B, 405B" in lines
    assert "deepseek_v3: debugmodel, 16B, 236B, 671B" in lines
    assert lines == sorted(lines)


def test_help(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "titan-train --nproc-per-node 2" in out
    assert "--training.local_batch_size" in out  # bare --help shows train's options too
    assert "``" not in out  # docstrings as plain text, not reST
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--training.local_batch_size" in out
    assert "``" not in out


# (command, a line of its own description, an example of its own, one of its own options)
COMMAND_HELP = [
    ("train", "Launcher flags", "titan-train --nproc-per-node 2", "--training.steps"),
    ("config", "merged configuration", "titan-train config --print", "--print"),
    ("list-models", "each one's flavors", "titan-train list-models", None),
    ("generate", "sample text", "titan-train generate --checkpoint.path", "--max-new-tokens"),
    ("estimate", "one rank's memory", "titan-train estimate --world-size 8", "--world-size"),
]


@pytest.mark.parametrize(("command", "description", "example", "option"), COMMAND_HELP)
def test_each_command_documents_itself(command, description, example, option, capsys):
    try:
        code = main([command, "--help"])
    except SystemExit as done:  # tyro's --help
        code = done.code
    assert code == 0
    out = capsys.readouterr().out
    assert description in out
    assert example in out
    if option is not None:
        assert option in out
    assert "``" not in out  # no reST or markdown leftovers
    assert "\n- titan-train" not in out
    if command != "train":
        assert "Launcher flags" not in out  # train's description is train's alone


def test_an_unknown_command_lists_the_commands(capsys):
    assert main(["bogus", "--training.steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "titan-train: error: unknown command 'bogus'; the commands are train, config, "
        "list-models, generate, estimate (titan-train COMMAND --help)."
    ]
