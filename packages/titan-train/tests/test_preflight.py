"""``preflight(config, world)``: every check before any work, in one process and without a
process group (a ``World`` is three plain values). What it decides (batch plan, layout,
context-parallel implementation, checkpoint folder) and what it refuses, each with one
error naming the key."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from titan_dims import ParallelDims, ParallelismConfig
from titan_models import ModelConfigError
from titan_train import ConfigError, JobConfig, Plan, World, preflight
from titan_train.cli import main
from titan_train.preflight import checkpoint_cost_warning, checkpoint_settings, plan_batches

CPU = torch.device("cpu")


def world(size: int = 1) -> World:
    return World(rank=0, world_size=size, device=CPU)


def job(tmp_path, **sections) -> JobConfig:
    config = JobConfig(**sections)
    config.job.dump_folder = str(tmp_path / "out")
    return config


def degrees(**kwargs) -> ParallelismConfig:
    return ParallelismConfig(**{f"{k}_degree": v for k, v in kwargs.items()})


def test_a_plain_config_plans_one_process(tmp_path):
    plan = preflight(job(tmp_path), world())
    assert isinstance(plan, Plan)
    assert plan.parallel_dims.world_size == 1
    assert (plan.batches.local_batch_size, plan.batches.accumulation_steps) == (8, 1)
    assert plan.spec.name == "llama3"
    assert plan.step_context.cp_attention is None
    assert plan.pipeline_microbatches is None
    assert plan.checkpoint.folder == str(tmp_path / "out" / "checkpoint")
    assert not (tmp_path / "out").exists(), "preflight writes nothing"


def test_a_seed_checkpoint_in_a_world_of_several_is_refused_before_any_work(tmp_path):
    """The seed is written by one process (as torchtitan requires): preflight refuses it in a
    world of two, in one line, before the model or the checkpoint folder exists."""
    config = job(tmp_path)
    config.checkpoint.create_seed_checkpoint = True
    assert preflight(config, world(1)).checkpoint.folder == str(tmp_path / "out" / "checkpoint")
    with pytest.raises(ConfigError) as info:
        preflight(config, world(2))
    assert str(info.value) == (
        "checkpoint.create_seed_checkpoint=true writes the seed from one process, but this run "
        "has 2; run it alone (no --nproc-per-node, no torchrun)."
    )
    assert not (tmp_path / "out").exists()


def test_the_context_parallel_implementation_is_resolved_once_into_the_plan(tmp_path):
    config = job(
        tmp_path, parallelism=degrees(data_parallel_shard=1, context_parallel=2, tensor_parallel=2)
    )
    config.training.seq_len = 64
    plan = preflight(config, world(4))
    assert plan.step_context.cp_attention == "titan"  # auto on CPU
    assert plan.step_context.loss_parallel  # tp with sharded logits


def test_torch_context_parallel_on_cpu_is_refused(tmp_path):
    config = job(tmp_path, parallelism=degrees(data_parallel_shard=1, context_parallel=2))
    config.parallelize.cp_attention = "torch"
    with pytest.raises(ModelConfigError, match="cp_attention='torch' cannot run on device 'cpu'"):
        preflight(config, world(2))


@pytest.mark.parametrize(
    ("local", "global_", "dp", "expected"),
    [(4, -1, 2, (4, 8, 1)), (2, 8, 2, (2, 8, 2)), (1, 12, 3, (1, 12, 4))],
)
def test_batch_plan_splits_the_global_batch(tmp_path, local, global_, dp, expected):
    config = job(tmp_path)
    config.training.local_batch_size, config.training.global_batch_size = local, global_
    plan = plan_batches(config, ParallelDims(world_size=dp, dp_shard=dp))
    assert (plan.local_batch_size, plan.global_batch_size, plan.accumulation_steps) == expected


def test_a_global_batch_that_does_not_split_is_refused(tmp_path):
    config = job(tmp_path)
    config.training.local_batch_size, config.training.global_batch_size = 3, 8
    with pytest.raises(
        ConfigError, match=r"global_batch_size=8 must be a multiple .* = 6; e\.g\. 6"
    ):
        plan_batches(config, ParallelDims(world_size=2, dp_shard=2))


def test_an_unknown_flavor_is_refused(tmp_path):
    config = job(tmp_path)
    config.model.flavor = "13B"
    with pytest.raises(ConfigError, match=r"model\.flavor='13B' is not a flavor of llama3"):
        preflight(config, world())


def test_validation_batch_must_split_into_the_pipelines_microbatches(tmp_path):
    config = job(tmp_path, parallelism=degrees(data_parallel_shard=1, pipeline_parallel=2))
    config.training.local_batch_size = 4
    config.validation.enable, config.validation.local_batch_size = True, 6
    with pytest.raises(ConfigError, match=r"validation\.local_batch_size=6 must be a multiple"):
        preflight(config, world(2))
    config.validation.local_batch_size = 8
    assert preflight(config, world(2)).pipeline_microbatches == 4


@pytest.mark.parametrize(
    ("size", "parallelism", "max_norm", "named"),
    [
        (1, degrees(), 1.0, "gradient clipping (training.max_norm=1.0"),
        (2, degrees(data_parallel_shard=2), 0.0, "FSDP"),
        (2, degrees(data_parallel_shard=1, pipeline_parallel=2), 0.0, "pipeline parallelism"),
    ],
)
def test_optimizer_in_backward_conflicts_are_refused_before_any_work(
    tmp_path, size, parallelism, max_norm, named
):
    config = job(tmp_path, parallelism=parallelism)
    config.optimizer.early_step_in_backward = True
    config.training.max_norm = max_norm
    with pytest.raises(ConfigError, match="early_step_in_backward=true") as error:
        preflight(config, world(size))
    assert named in str(error.value)


@pytest.mark.parametrize(
    ("size", "parallelism", "pipeline", "message"),
    [
        (3, degrees(data_parallel_shard=1, tensor_parallel=3), {}, "tp=3 must divide n_heads=16"),
        (2, degrees(data_parallel_shard=2, expert_parallel=2), {}, "dense model without experts"),
        (
            2,
            degrees(data_parallel_shard=1, pipeline_parallel=2),
            {"layers_per_stage": 4},
            "layers_per_stage=4 does not divide n_layers=6",
        ),
        (
            2,
            degrees(data_parallel_shard=1, pipeline_parallel=2),
            {"microbatch_size": 3},
            "local_batch_size=8 is not a multiple of pipeline.microbatch_size=3",
        ),
        (
            4,
            degrees(data_parallel_shard=1, pipeline_parallel=4),
            {"split_points": ["layers.2", "layers.1", "layers.4"]},
            "must name increasing blocks",
        ),
    ],
)
def test_a_flavor_the_layout_cannot_train_is_refused_by_preflight(
    tmp_path, size, parallelism, pipeline, message
):
    """These were found only while building the model (after the tokenizer, the data and
    the process group); the spec's check_fn now runs them in preflight."""
    config = job(tmp_path, parallelism=parallelism)
    config.training.seq_len = 96  # a multiple of tp=3's sequence-parallel divisor, 6
    for key, value in pipeline.items():
        setattr(config.pipeline, key, value)
    with pytest.raises(ModelConfigError, match=message):
        preflight(config, world(size))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("size", "parallelism", "message"),
    [
        # debugmodel: 8 routed experts.
        (6, degrees(data_parallel_shard=6, expert_parallel=3), "expert_parallel_degree=3"),
        (2, degrees(data_parallel_shard=1, context_parallel=2), "set parallelize.cp_attention"),
    ],
)
def test_a_deepseek_v3_layout_its_plan_cannot_train_is_refused_by_preflight(
    tmp_path, size, parallelism, message
):
    config = job(tmp_path, parallelism=parallelism)
    config.model.name = "deepseek_v3"
    config.parallelize.cp_attention = "titan_ring"
    with pytest.raises(ModelConfigError, match=message):
        preflight(config, world(size))
    assert not (tmp_path / "out").exists()


def test_the_pipeline_check_counts_the_accumulated_batch(tmp_path):
    # 2 accumulation steps of 8 rows run as one schedule step of 16: microbatches of 16 fit.
    config = job(tmp_path, parallelism=degrees(data_parallel_shard=1, pipeline_parallel=2))
    config.training.global_batch_size = 16
    config.pipeline.microbatch_size = 16
    config.validation.local_batch_size = 1
    assert preflight(config, world(2)).pipeline_microbatches == 1
    config.training.global_batch_size = 8
    with pytest.raises(ModelConfigError, match="local_batch_size=8 is not a multiple"):
        preflight(config, world(2))


def test_optimizer_in_backward_alone_passes(tmp_path):
    config = job(tmp_path)
    config.optimizer.early_step_in_backward = True
    config.training.max_norm = 0.0
    preflight(config, world())


def test_optimizer_in_backward_with_clipping_exits_2_and_writes_nothing(tmp_path, capsys):
    """It used to fail at step 1 with a traceback, after building and loading everything."""
    out = tmp_path / "out"
    code = main(["train", "--job.dump_folder", str(out), "--optimizer.early_step_in_backward"])
    assert code == 2
    assert "training.max_norm=1.0" in capsys.readouterr().err
    assert not out.exists()
    assert not dist.is_initialized()


def test_initial_load_path_with_checkpointing_off_is_refused(tmp_path, capsys):
    """torchtitan skips it silently: the run trained from random weights instead."""
    out = tmp_path / "out"
    start = tmp_path / "start"
    start.mkdir()
    run = [
        "train",
        "--job.dump_folder",
        str(out),
        "--checkpoint.no_enable",
        "--training.steps",
        "1",
    ]
    assert main([*run, "--checkpoint.initial_load_path", str(start)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.initial_load_path={str(start)!r}" in err
    assert "--checkpoint.enable" in err
    assert not out.exists()


def test_a_url_checkpoint_folder_stays_a_url(tmp_path):
    config = job(tmp_path)
    config.checkpoint.folder = "s3://bucket/ckpt"
    assert checkpoint_settings(config).folder == "s3://bucket/ckpt"


def test_frequent_checkpoints_of_a_large_model_are_warned_about(tmp_path, caplog):
    """titan-train's default interval (10) suits its CPU demo; for an 8B model each save
    writes ~96 GB (issue 18, F27): one warning line, the run goes on."""
    config = job(tmp_path)
    config.model.flavor = "8B"
    config.training.memory_check = False  # 8B does not fit on every machine the tests run on
    message = checkpoint_cost_warning(config, preflight(job(tmp_path), world()).spec)
    assert message.startswith("checkpoint.interval=10 saves a 8.0B-parameter model (~96 GB")
    with caplog.at_level("WARNING", logger="titan_train"):
        preflight(config, world())
    assert [r.getMessage() for r in caplog.records] == [message]
    config.checkpoint.interval = 500
    assert checkpoint_cost_warning(config, preflight(config, world()).spec) is None
    assert checkpoint_cost_warning(job(tmp_path), preflight(job(tmp_path), world()).spec) is None


def test_a_model_whose_state_cannot_fit_on_this_host_is_refused_before_any_work(tmp_path):
    # 405B parameters in fp32 with AdamW's moments: ~6 TB, more than any one host has.
    config = job(tmp_path)
    config.model.flavor = "405B"
    with pytest.raises(ConfigError, match=r"cannot fit in host memory: .* 16 bytes") as refused:
        preflight(config, world())
    assert "--training.no_memory_check" in str(refused.value)
    assert "sharded" in str(refused.value)  # what would fit
    config.training.memory_check = False
    preflight(config, world())
    assert not (tmp_path / "out").exists()


def test_the_ranks_a_launcher_would_start_on_this_host_count_together(tmp_path):
    from titan_train.trainer.memory_fit import _resident_bytes, host_memory

    available = host_memory().available
    ranks = available // _resident_bytes() + 1  # each as big as this process: too many
    launching = World(rank=0, world_size=ranks, device=CPU, local_world_size=ranks, started=False)
    with pytest.raises(ConfigError, match=rf"{ranks} rank\(s\) on this host .* --nproc-per-node"):
        preflight(job(tmp_path), launching)
    # The same ranks spread one per host fit.
    preflight(job(tmp_path), World(rank=0, world_size=ranks, device=CPU, started=False))


@pytest.mark.parametrize(
    ("name", "momentum", "per_param"), [("AdamW", 0.0, 16), ("SGD", 0.0, 8), ("SGD", 0.9, 12)]
)
def test_the_model_state_floor_counts_weights_gradients_and_moments(name, momentum, per_param):
    from titan_train.trainer.memory_fit import model_state_bytes

    config = JobConfig()
    config.optimizer.name, config.optimizer.momentum = name, momentum
    assert model_state_bytes(config, 1000) == 1000 * per_param


def test_the_command_refuses_an_unfitting_run_in_seconds_writing_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--model.flavor", "405B", "--training.steps", "1"]) == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # one estimate of the step on fake tensors, ~5-20 s
def test_many_small_ranks_are_refused_by_the_estimate_of_their_step(tmp_path):
    """A small model on so many CPU ranks that their processes alone take most of the host:
    the model-state floor passes, the launcher's estimate of each rank's step refuses (a
    64-rank debug run on a 24 GB host was OOM-killed before)."""
    from titan_train.trainer.memory_fit import (
        RUNTIME_HEAP,
        _resident_bytes,
        check_launch_fits,
        host_memory,
    )

    available = host_memory().available
    ranks = int(0.8 * available / (_resident_bytes() + RUNTIME_HEAP))  # past half, under all
    config = job(tmp_path)
    launching = World(rank=0, world_size=ranks, device=CPU, local_world_size=ranks, started=False)
    preflight(config, launching)  # the floor alone lets it through
    with pytest.raises(ConfigError, match=rf"{ranks} rank\(s\) on this host need about .* "
                       r"peak_resident.* Start at most \d+ rank\(s\) per host"):  # fmt: skip
        check_launch_fits(config, world_size=ranks, local_ranks=ranks, device=CPU)
    assert not (tmp_path / "out").exists()
    # A handful of ranks is not estimated at all, and fits.
    check_launch_fits(config, world_size=2, local_ranks=2, device=CPU)
    config.training.memory_check = False
    check_launch_fits(config, world_size=ranks, local_ranks=ranks, device=CPU)
