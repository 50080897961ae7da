"""A model family's own step work and numbers reach the trainer through its ``ModelSpec``:
``post_step_fn`` runs after every optimizer step taken (the experts' bias update of a
mixture-of-experts model), ``metrics_fn`` is read at reporting steps only and lands in
``metrics.jsonl`` beside the loss. One process, the real trainer loop."""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist

from titan_dims import ParallelDims, init_distributed
from titan_train import JobConfig, World, build, close, preflight, train


def test_post_step_and_metrics_hooks_run_in_the_trainer_loop(tmp_path):
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    config.training.steps, config.training.seq_len, config.training.local_batch_size = 4, 32, 2
    config.lr_scheduler.warmup_steps = 1
    config.checkpoint.enable = False
    config.metrics.log_freq = 2
    config.metrics.enable_tensorboard = False

    calls: list[tuple[int, int]] = []  # (step hook calls so far, metrics reads so far)
    reads: list[int] = []

    def post_step_fn(model_parts, parallel_dims):
        assert isinstance(parallel_dims, ParallelDims)
        first = model_parts[0]
        before = first.norm.weight.detach().clone()

        def after_step() -> None:
            # Runs after the optimizer moved the weights.
            assert not torch.equal(first.norm.weight.detach(), before)
            before.copy_(first.norm.weight.detach())
            calls.append((len(calls) + 1, len(reads)))

        return after_step

    def metrics_fn(model_parts):
        reads.append(len(calls))
        return {"model/steps_seen": float(len(calls))}

    device = init_distributed()
    try:
        plan = preflight(config, World.current(device))
        spec = dataclasses.replace(plan.spec, post_step_fn=post_step_fn, metrics_fn=metrics_fn)
        run = build(config, dataclasses.replace(plan, spec=spec))
        try:
            train(run)
        finally:
            close(run)
    finally:
        dist.destroy_process_group()

    assert [n for n, _ in calls] == [1, 2, 3, 4]
    assert reads == [1, 2, 4]  # at the reporting steps (the first, then every 2nd), after the hook
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["model/steps_seen"]) for r in records if "model/steps_seen" in r]
    assert logged == [(1, 1.0), (2, 2.0), (4, 4.0)]


def test_a_modules_own_loss_term_is_scaled_like_the_loss_under_accumulation(tmp_path):
    """DeepSeek-V3's MoE layers add their balance loss in backward; with 2 accumulation
    steps the trainer's loss is halved per micro-batch, and so is theirs."""
    from titan_models.moe import MoE

    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    config.model.name, config.model.flavor = "deepseek_v3", "debugmodel"
    config.training.seq_len, config.training.local_batch_size = 32, 2
    config.training.global_batch_size = 4  # 2 accumulation steps of 2
    config.checkpoint.enable = False
    config.metrics.enable_tensorboard = False
    device = init_distributed()
    try:
        plan = preflight(config, World.current(device))
        assert plan.batches.accumulation_steps == 2
        run = build(config, plan)
        close(run)
    finally:
        dist.destroy_process_group()
    layers = [m for part in run.model_parts for m in part.modules() if isinstance(m, MoE)]
    assert len(layers) == 2
    assert {layer.aux_loss_grad_scale for layer in layers} == {0.5}


def test_deterministic_mode_sets_what_cublas_and_cudnn_need(monkeypatch):
    """training.deterministic on a GPU: without CUBLAS_WORKSPACE_CONFIG cuBLAS raises at the
    first matmul; a user's own setting is kept."""
    from titan_train.trainer.build import use_deterministic_algorithms

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    try:
        use_deterministic_algorithms()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        assert torch.are_deterministic_algorithms_enabled()
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        use_deterministic_algorithms()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


def test_where_parameters_and_buffers_are_built():
    """A seed checkpoint holds the whole unsharded model in one process: on the host, not on
    the GPU (70B in fp32 is 280 GB). With CPU offload FSDP keeps the parameters on the host,
    and the buffers (the RoPE table, read every forward) go to the device."""
    from titan_train.trainer.build import materialization_devices

    config = JobConfig()
    gpu, host = torch.device("cuda", 0), torch.device("cpu")
    assert materialization_devices(config, gpu) == (gpu, gpu)
    config.parallelize.cpu_offload = True
    assert materialization_devices(config, gpu) == (host, gpu)
    config.checkpoint.create_seed_checkpoint = True
    assert materialization_devices(config, gpu) == (host, host)
