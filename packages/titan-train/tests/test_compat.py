"""torchtitan's configs and command lines in titan-train (``titan_train.compat``).

Checked against torchtitan's own files: the four Llama 3 TOMLs of July 2025 (unchanged copies
in ``torchtitan_configs/``, see its README) load through ``titan-train config --print`` and
keep their meaning; the debug one trains; every key of torchtitan's JobConfig (July 2025, and
the later ``job_config.py`` names) has a titan place, is ignored with a reason, or is refused
with one message and exit status 2 before anything is written.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest

from titan_train.cli import main
from titan_train.compat import KEYS, TORCHTITAN_DEFAULTS, lookup
from titan_train.compat.argv import split_argv
from titan_train.config import JobConfig, parse_job_config
from titan_train.config.loader import ConfigError

CONFIGS = Path(__file__).parent / "torchtitan_configs"

# Every key a user may set in torchtitan's JobConfig, by section: July 2025
# (torchtitan/config_manager.py at 6204cdff9), February 2026 (torchtitan/config/
# job_config.py at e347b1e5e, the last version before TOML files were replaced) and August
# 2026 (the flags that still override a --module/--config configuration).
TORCHTITAN_KEYS = {
    "july_2025": {
        "job": "config_file dump_folder description use_for_integration_test print_args",
        "profiling": "enable_profiling save_traces_folder profile_freq enable_memory_snapshot "
        "save_memory_snapshot_folder",
        "metrics": "log_freq enable_tensorboard disable_color_printing save_tb_folder "
        "save_for_all_ranks enable_wandb",
        "model": "name flavor tokenizer_path converters print_after_conversion",
        "optimizer": "name lr beta1 beta2 eps weight_decay implementation early_step_in_backward",
        "lr_scheduler": "warmup_steps decay_ratio decay_type lr_min",
        "training": "dataset dataset_path local_batch_size global_batch_size seq_len max_norm "
        "steps enable_cpu_offload mixed_precision_param mixed_precision_reduce compile gc_freq "
        "gc_debug seed deterministic",
        "parallelism": "data_parallel_replicate_degree enable_compiled_autograd "
        "data_parallel_shard_degree fsdp_reshard_after_forward tensor_parallel_degree "
        "disable_loss_parallel enable_async_tensor_parallel pipeline_parallel_degree "
        "pipeline_parallel_split_points pipeline_parallel_layers_per_stage "
        "pipeline_parallel_schedule pipeline_parallel_schedule_csv "
        "pipeline_parallel_microbatch_size context_parallel_degree "
        "context_parallel_rotate_method expert_parallel_degree",
        "checkpoint": "enable_checkpoint folder initial_load_path initial_load_model_weights_only "
        "interval last_save_model_weights_only export_dtype create_seed_checkpoint async_mode "
        "keep_latest_k load_step exclude_from_loading enable_first_step_checkpoint",
        "activation_checkpoint": "mode selective_ac_option",
        "float8": "enable_fsdp_float8_all_gather precompute_float8_dynamic_scale_for_fsdp "
        "force_recompute_fp8_weight_in_bwd recipe_name filter_fqns emulate moe_fqns_prototype",
        "mx": "use_fp8_dim1_cast_triton_kernel recipe_name filter_fqns",
        "comm": "init_timeout_seconds train_timeout_seconds trace_buf_size",
        "memory_estimation": "enabled disable_fake_mode",
        "fault_tolerance": "enable replica_id group_size min_replica_size semi_sync_method "
        "sync_steps should_quantize fragment_sync_delay fragment_update_alpha",
        "experimental": "custom_import custom_args_module",
        "validation": "enabled dataset dataset_path local_batch_size seq_len freq steps",
    },
    "february_2026": {
        "job": "config_file dump_folder description print_config save_config_file "
        "custom_config_module",
        "profiling": "enable_profiling save_traces_folder profile_freq profiler_active "
        "profiler_warmup enable_memory_snapshot save_memory_snapshot_folder",
        "model": "name flavor hf_assets_path tokenizer_path converters print_after_conversion",
        "lr_scheduler": "warmup_steps total_steps decay_ratio decay_type min_lr_factor",
        "training": "dataset dataset_path local_batch_size global_batch_size seq_len max_norm "
        "steps enable_cpu_offload dtype mixed_precision_param mixed_precision_reduce gc_freq "
        "gc_debug",
        "training.dataloader": "num_workers persistent_workers pin_memory prefetch_factor",
        "parallelism": "module_fqns_per_model_part pipeline_parallel_first_stage_less_layers "
        "pipeline_parallel_last_stage_less_layers pipeline_parallel_expert_parallel_overlap "
        "context_parallel_load_balancer expert_tensor_parallel_degree "
        "expert_parallel_comm_backend",
        "checkpoint": "enable enable_ft_dataloader_checkpoints folder interval initial_load_path "
        "initial_load_model_only initial_load_in_hf initial_load_in_hf_quantized "
        "last_save_model_only last_save_in_hf export_dtype async_mode keep_latest_k load_step "
        "exclude_from_loading enable_first_step_checkpoint create_seed_checkpoint load_only",
        "activation_checkpoint": "mode selective_ac_option "
        "per_op_sac_force_recompute_mm_shapes_by_fqns early_stop memory_budget "
        "visualize_memory_budget_pareto preserve_rng_state determinism_check debug",
        "compile": "enable components backend",
        "quantize.linear.float8": "enable_fsdp_float8_all_gather "
        "precompute_float8_dynamic_scale_for_fsdp recipe_name filter_fqns emulate",
        "quantize.linear.mx": "mxfp8_dim1_cast_kernel_choice recipe_name filter_fqns",
        "quantize.grouped_mm.float8": "fqns",
        "quantize.grouped_mm.mx": "recipe_name fqns",
        "comm": "init_timeout_seconds train_timeout_seconds trace_buf_size save_traces_folder "
        "save_traces_file_prefix mode",
        "memory_estimation": "enable disable_fake_mode",
        "fault_tolerance": "enable process_group process_group_timeout_ms replica_id group_size "
        "min_replica_size semi_sync_method",
        "validation": "enable dataset dataset_path local_batch_size seq_len freq steps",
        "validation.dataloader": "num_workers persistent_workers pin_memory prefetch_factor",
        "debug": "seed deterministic deterministic_warn_only moe_force_load_balance",
    },
    # The command-line flags of Trainer.Config (torchtitan/trainer.py at b5bcd76c6, August
    # 2026: `--module llama3 --config llama3_debugmodel --help`); "" holds the top-level ones.
    "august_2026": {
        "": "dump_folder hf_assets_path",
        "checkpoint": "async_mode create_seed_checkpoint enable enable_first_step_checkpoint "
        "exclude_from_loading export_dtype folder initial_load_in_hf initial_load_in_hf_quantized "
        "initial_load_model_only initial_load_path interval keep_latest_k last_save_in_hf "
        "last_save_model_only load_only load_step",
        "comm": "init_timeout_seconds mode save_traces_file_prefix save_traces_folder "
        "trace_buf_size train_timeout_seconds",
        "compile": "backend components enable enable_async_tensor_parallel",
        "dataloader": "seed",
        "debug": "batch_invariant detect_anomaly deterministic deterministic_warn_only "
        "enable_structured_logging moe_force_load_balance print_config save_config_file seed "
        "spmd_typechecking",
        "loss": "num_chunks",
        "loss.loss_fn": "global_vocab_size",
        "lr_scheduler": "decay_ratio decay_type min_lr_factor total_steps warmup_steps",
        "metrics": "disable_color_printing enable_tensorboard enable_wandb log_freq "
        "save_for_all_ranks save_tb_folder",
        "optimizer": "implementation",
        "optimizer.param_groups.0": "optimizer_name pattern",
        "optimizer.param_groups.0.optimizer_kwargs": "betas eps lr weight_decay",
        "override": "imports",
        "parallelism": "context_parallel_degree context_parallel_load_balancer "
        "context_parallel_ptrr_mask_key data_parallel_replicate_degree data_parallel_shard_degree "
        "enable_fsdp_symm_mem enable_sequence_parallel expert_parallel_degree "
        "fsdp_reshard_after_forward module_fqns_per_model_part num_pp_microbatches "
        "pipeline_parallel_degree pipeline_parallel_first_stage_less_layers "
        "pipeline_parallel_last_stage_less_layers pipeline_parallel_layers_per_stage "
        "pipeline_parallel_schedule pipeline_parallel_schedule_csv spmd_backend "
        "tensor_parallel_degree",
        "profiler": "enable_memory_snapshot enable_profiling memory_snapshot_freq "
        "memory_snapshot_max_entries profile_freq profiler_active profiler_repeat "
        "profiler_skip_first profiler_skip_first_wait profiler_warmup save_memory_snapshot_folder "
        "save_traces_folder",
        "training": "disable_cuda_graphs dtype enable_cpu_offload gc_debug gc_freq "
        "max_context_length max_norm mixed_precision_param mixed_precision_reduce "
        "num_tokens_per_microbatch_per_dp_rank num_tokens_per_train_step steps",
        "validator": "enable freq steps",
        "validator.dataloader": "seed",
    },
}


def _titan_keys(cls: type = JobConfig, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= _titan_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.add(f"{prefix}{f.name}")
    return keys


def _get(values: dict, path: str):
    for part in path.split("."):
        values = values[part]
    return values


@pytest.mark.parametrize("version", TORCHTITAN_KEYS)
def test_every_torchtitan_key_has_a_titan_answer(version):
    titan = _titan_keys()
    paths = [
        f"{section}.{key}" if section else key
        for section, keys in TORCHTITAN_KEYS[version].items()
        for key in keys.split()
    ]
    assert [p for p in paths if p not in titan and lookup(p) is None] == []


def test_the_table_never_shadows_a_titan_key():
    titan = _titan_keys()
    assert [k for k in KEYS if k in titan] == []
    for key in KEYS.values():
        if key.action == "move":
            assert key.to in titan, key
    assert set(TORCHTITAN_DEFAULTS) <= titan


def test_the_readme_tells_every_answer():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert [k for k in KEYS if f"| `{k}` |" not in readme] == []
    assert [k for k in TORCHTITAN_DEFAULTS if f"| `{k}` |" not in readme] == []


# What each file means under torchtitan, as titan keys of the merged config.
MEANINGS = {
    "debug_model": {
        "model.flavor": "debugmodel",
        "optimizer.lr": 8e-4,
        "lr_scheduler.warmup_steps": 2,
        "lr_scheduler.decay_ratio": 0.8,
        "lr_scheduler.min_lr_factor": 0.0,  # lr_min = 0.0
        "training.steps": 10,
        "training.seq_len": 2048,
        "training.local_batch_size": 8,
        "parallelism.data_parallel_shard_degree": -1,
        "parallelize.compile": False,  # training.compile
        "parallelize.reshard_after_forward": "default",
        "parallelize.param_dtype": "bfloat16",  # torchtitan's default
        "parallelize.activation_checkpoint.mode": "selective",
        "parallelize.activation_checkpoint.selective_option": "2",
        "checkpoint.enable": False,  # enable_checkpoint = false
        "checkpoint.interval": 10,
        "checkpoint.last_save_model_only": False,  # last_save_model_weights_only
        "metrics.enable_tensorboard": False,
        "metrics.tensorboard_names": "torchtitan",  # torchtitan's tags for its files
        "metrics.log_freq": 1,
        "validation.enable": False,  # validation.enabled
        "validation.freq": 5,
        "profiling.save_traces_folder": "profile_trace",
    },
    "llama3_8b": {
        "model.flavor": "8B",
        "optimizer.lr": 3e-4,
        "lr_scheduler.warmup_steps": 200,
        "training.steps": 1000,
        "training.seq_len": 8192,
        "training.local_batch_size": 1,
        "parallelize.activation_checkpoint.mode": "selective",
        "parallelize.activation_checkpoint.selective_option": "op",
        "checkpoint.enable": False,
        "checkpoint.interval": 500,
        "metrics.enable_tensorboard": True,
        "profiling.enable_profiling": True,
        "profiling.profile_freq": 100,
    },
    "llama3_70b": {
        "model.flavor": "70B",
        "optimizer.lr": 1.5e-4,
        "lr_scheduler.warmup_steps": 200,
        "training.steps": 1000,
        "training.local_batch_size": 8,
        "parallelism.tensor_parallel_degree": 8,
        "parallelism.data_parallel_shard_degree": -1,
        "parallelize.activation_checkpoint.mode": "full",
        "checkpoint.enable": False,
        "checkpoint.interval": 500,
    },
    "llama3_405b": {
        "model.flavor": "405B",
        "model.converters": ["float8"],  # refused when training starts, see below
        "optimizer.lr": 8e-5,
        "lr_scheduler.warmup_steps": 600,
        "training.steps": 3000,
        "training.local_batch_size": 2,
        "parallelism.tensor_parallel_degree": 8,
        "parallelize.compile": True,
        "parallelize.activation_checkpoint.mode": "full",
        "checkpoint.enable": False,
    },
}


@pytest.mark.parametrize("name", MEANINGS)
def test_torchtitan_tomls_load_unchanged_and_keep_their_meaning(
    name, tmp_path, monkeypatch, capsys, caplog
):
    monkeypatch.chdir(tmp_path)
    path = CONFIGS / f"{name}.toml"
    with caplog.at_level(logging.INFO, logger="titan_train"):
        assert main(["config", "--print", "--job.config_file", str(path)]) == 0
    printed = capsys.readouterr().out
    merged = tomllib.loads(printed)
    assert {key: _get(merged, key) for key in MEANINGS[name]} == MEANINGS[name]
    assert list(tmp_path.iterdir()) == []  # printing the config writes nothing
    # The printed config is a titan file that means the same: every value is explicit.
    (tmp_path / "printed.toml").write_text(printed)
    again = parse_job_config(["--job.config_file", str(tmp_path / "printed.toml")])
    original = parse_job_config(["--job.config_file", str(path)])
    again.job.config_file = original.job.config_file
    assert again == original
    log = caplog.text
    assert log.count("read as a torchtitan config") == 1
    assert log.count("checkpoint.enable_checkpoint is checkpoint.enable") == 1
    if name == "debug_model":
        assert log.count("job.print_args (") == 1


def test_a_titan_file_keeps_titan_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[training]\nseq_len = 64\n")
    config = parse_job_config(["--job.config_file", str(path), "--checkpoint.enable_checkpoint"])
    # torchtitan keys on the command line are aliases: they do not make the file torchtitan's.
    assert (config.training.steps, config.checkpoint.interval) == (30, 10)
    assert config.checkpoint.enable
    assert config.metrics.tensorboard_names == "titan"


def test_a_later_torchtitan_file_loads(tmp_path):
    path = tmp_path / "tt.toml"
    path.write_text(
        "[job]\nprint_config = false\n[model]\nhf_assets_path = 'assets/tok'\n"
        "[lr_scheduler]\nmin_lr_factor = 0.1\n[optimizer]\nbeta1 = 0.8\n"
        "[compile]\nenable = true\ncomponents = ['model', 'loss']\n"
        "[checkpoint]\nenable = true\nlast_save_model_only = false\n"
        "[quantize.linear.float8]\nfilter_fqns = ['output']\n[validation]\nenable = true\n"
        "[activation_checkpoint]\nmode = 'selective'\nselective_ac_option = 3\n"
        "[debug]\nseed = 7\n"
    )
    config = parse_job_config(["--job.config_file", str(path)])
    assert config.model.tokenizer_path == "assets/tok"
    assert config.lr_scheduler.min_lr_factor == 0.1
    assert config.optimizer.betas == (0.8, 0.95)
    assert config.parallelize.compile
    assert config.checkpoint.enable
    assert config.validation.enable
    assert config.parallelize.activation_checkpoint.selective_option == "3"
    assert config.training.seed == 7
    assert config.training.steps == 10000  # torchtitan's default: the file sets none


# (command line, titan key, value)
ALIASES = [
    (["--checkpoint.enable_checkpoint"], "checkpoint.enable", True),
    (["--checkpoint.no-enable-checkpoint"], "checkpoint.enable", False),
    (["--checkpoint.no_enable_checkpoint"], "checkpoint.enable", False),
    (["--checkpoint.enable_checkpoint=false"], "checkpoint.enable", False),
    (["--training.mixed_precision_param", "bfloat16"], "parallelize.param_dtype", "bfloat16"),
    (["--training.mixed-precision-param", "float32"], "parallelize.param_dtype", "float32"),
    (["--activation_checkpoint.mode", "full"], "parallelize.activation_checkpoint.mode", "full"),
    (
        ["--activation_checkpoint.selective_ac_option", "op"],
        "parallelize.activation_checkpoint.selective_option",
        "op",
    ),
    (["--parallelism.pipeline_parallel_schedule", "GPipe"], "pipeline.schedule", "GPipe"),
    (["--training.compile"], "parallelize.compile", True),
    (["--compile.enable", "--training.no-compile"], "parallelize.compile", None),  # conflict
    (["--compile.enable"], "parallelize.compile", True),
    (["--compile.backend", "eager"], "parallelize.compile_backend", "eager"),
    (["--parallelism.disable_loss_parallel"], "parallelize.loss_parallel", False),
    (["--lr_scheduler.lr_min", "0.1"], "lr_scheduler.min_lr_factor", 0.1),
    (["--optimizer.beta2", "0.99"], "optimizer.betas", (0.9, 0.99)),
    (["--validation.enabled"], "validation.enable", True),
    (["--checkpoint.last_save_model_weights_only"], "checkpoint.last_save_model_only", True),
    (["--parallelism.pipeline_parallel_split_points", "layers.2,layers.4"], "pipeline.split_points",
     ["layers.2", "layers.4"]),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "key", "value"), ALIASES, ids=lambda v: str(v)[:50])
def test_torchtitan_command_line_names(argv, key, value, caplog):
    if value is None:
        with pytest.raises(ConfigError, match=r"both set titan's parallelize\.compile"):
            parse_job_config(argv)
        return
    with caplog.at_level(logging.INFO, logger="titan_train"):
        config = parse_job_config(argv)
    assert _get(dataclasses.asdict(config), key) == value
    assert caplog.text.count(f" is {key}") == 1  # the titan name, said once


def test_command_line_names_override_the_file(tmp_path):
    path = tmp_path / "tt.toml"
    path.write_text(
        "[checkpoint]\nenable_checkpoint = true\n[activation_checkpoint]\nmode='full'\n"
    )
    config = parse_job_config(["--job.config-file", str(path), "--checkpoint.no-enable-checkpoint"])
    assert not config.checkpoint.enable
    assert config.parallelize.activation_checkpoint.mode == "full"
    # A titan option on the command line wins over both.
    config = parse_job_config(
        [
            f"--job.config_file={path}",
            "--activation_checkpoint.mode",
            "none",
            "--parallelize.activation_checkpoint.mode",
            "selective",
        ]
    )
    assert config.parallelize.activation_checkpoint.mode == "selective"


def test_split_argv_leaves_titan_options_alone():
    rest, found = split_argv(["--training.steps", "3", "--float8.emulate", "--training.no-compile"])
    assert rest == ["--training.steps", "3"]
    assert found == {"float8": {"emulate": True}, "training": {"compile": False}}
    # A boolean flag takes only an explicit true/false after it, never the next option.
    assert split_argv(["--training.compile", "-h"]) == (["-h"], {"training": {"compile": True}})
    assert split_argv(["--training.compile", "False"])[1] == {"training": {"compile": False}}


@pytest.mark.parametrize(
    ("argv", "key", "value"),
    [
        (["--checkpoint.exclude_from_loading", "dataloader,lr_scheduler"],
         "checkpoint.exclude_from_loading", ["dataloader", "lr_scheduler"]),
        (["--checkpoint.exclude_from_loading=dataloader,train_state"],
         "checkpoint.exclude_from_loading", ["dataloader", "train_state"]),
        (["--checkpoint.exclude_from_loading", "dataloader", "lr_scheduler"],
         "checkpoint.exclude_from_loading", ["dataloader", "lr_scheduler"]),
        (["--pipeline.split_points", "layers.1,layers.3"], "pipeline.split_points",
         ["layers.1", "layers.3"]),
        (["--optimizer.betas", "0.8,0.9"], "optimizer.betas", (0.8, 0.9)),
    ],
)  # fmt: skip
def test_list_options_take_comma_lists(argv, key, value):
    assert _get(dataclasses.asdict(parse_job_config(argv)), key) == value


REFUSED = [
    ("[parallelism]\nenable_compiled_autograd = true\n", [], "enable_compiled_autograd = true"),
    ("[memory_estimation]\nenabled = true\n", [], "memory_estimation.enabled = true"),
    ("[training]\ndtype = 'bfloat16'\n", [], "training.dtype = 'bfloat16'"),
    ("[job]\nprint_args = true\n", ["--experimental.custom_import", "my.models"],
     "experimental.custom_import = 'my.models'"),
    ("[model]\ntokenizer_path = 'a'\nhf_assets_path = 'b'\n", [], "keep one of them"),
]  # fmt: skip


@pytest.mark.parametrize(("toml", "argv", "message"), REFUSED, ids=lambda v: str(v)[:40])
def test_a_torchtitan_key_titan_cannot_honour_is_one_message_and_exit_2(
    toml, argv, message, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "tt.toml"
    path.write_text(toml)
    # The dump folder (./outputs) already holds a run's records: they must stay as they are.
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "metrics.jsonl").write_text('{"step": 1, "loss": 8.0}\n')
    before = _disk(tmp_path)
    assert main(["train", "--job.config_file", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("titan-train: error:") == 1
    assert message in err
    assert _disk(tmp_path) == before  # nothing written, nothing changed


def _disk(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder``: a file's bytes, None for a directory."""
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


def test_float8_training_is_refused_when_training_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = CONFIGS / "llama3_405b.toml"
    assert main(["train", "--job.config_file", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    (line,) = [e for e in err if "error" in e]
    assert "model.converters = ['float8']" in line
    assert "titan has none, on this device" in line
    assert "--model.converters=" in line  # how to go on
    assert list(tmp_path.iterdir()) == []


def _run_titan_train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "titan_train.cli", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_torchtitans_checkpoint_flag_turns_checkpoints_on(tmp_path):
    """torchtitan's debug_model.toml (``enable_checkpoint = false``; trained unedited, with no
    checkpoint written, by ``torchtitan/test_torchtitan_checkout.py``) with torchtitan's
    flag turned on writes one: that test's check can fail. Dataset and tokenizer are what
    titan ships, 1 step of 64 tokens."""
    from titan_train.tokenizer import default_tokenizer_path

    result = _run_titan_train(
        tmp_path, "--job.config_file", str(CONFIGS / "debug_model.toml"),
        "--training.dataset", "embedded", "--model.tokenizer_path", str(default_tokenizer_path()),
        "--training.seq_len", "64", "--training.steps", "1", "--checkpoint.enable_checkpoint",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "outputs" / "checkpoint" / "step-1").is_dir()


def test_a_python_warning_is_one_log_line():
    code = (
        "import warnings; from titan_train.cli import _setup_logging; _setup_logging(); "
        "warnings.warn('lr_scheduler.warmup_steps=5 is longer than training.steps=2')"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    (line,) = result.stderr.splitlines()  # no source line, no "UserWarning:" prefix
    assert line.startswith("[rank0] ")
    assert line.endswith(" WARNING lr_scheduler.warmup_steps=5 is longer than training.steps=2")


def test_a_closed_pipe_ends_quietly(tmp_path):
    code = (
        "import sys; from titan_train.cli import quiet_on_closed_pipe; "
        "sys.exit(quiet_on_closed_pipe(lambda: print('x' * 1_000_000) or 0))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = f'"{sys.executable}" -c "{code}" | head -c 10; echo "status=${{PIPESTATUS[0]}}" >&2'
    result = subprocess.run(
        ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.stdout == "x" * 10
    assert result.stderr == "status=141\n"
