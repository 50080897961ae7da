"""A step that runs out of device memory dumps a memory snapshot before the error ends the
run (issue 18, F24): ``<dump_folder>/memory_snapshot/iteration_<step>_exit/rank<r>_memory_
snapshot.pickle``, through the device's memory module (``torch.cuda.memory`` on CUDA).

On CPU there is no allocator to snapshot, so the CPU tests hand the profiler a stand-in for
that module (the part under test is the handler: which step, where the file goes, the
error kept) and raise a real ``torch.OutOfMemoryError`` from inside the trainer's loop. On
an accelerator (skipped cleanly without one; ``tools/gpu_smoke.sh`` runs it) a real OOM and
torch's real snapshot."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from titan_dims import init_distributed
from titan_train import JobConfig, World, build, close, preflight, train
from titan_train.trainer.profiling import Profiler, ProfilingConfig, memory_history

ACCELERATOR = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


class _MemoryModule:
    """Stands in for ``torch.cuda.memory`` on CPU: history calls and a snapshot dict."""

    def __init__(self) -> None:
        self.history_calls: list[dict] = []

    def _record_memory_history(self, **kwargs) -> None:
        self.history_calls.append(kwargs)

    def _snapshot(self) -> dict:
        return {"segments": [{"total_size": 123}], "device_traces": []}


def _profiler(tmp_path, **config) -> Profiler:
    return Profiler(
        ProfilingConfig(**config), dump_folder=str(tmp_path), rank=3, device=torch.device("cpu")
    )


def test_cpu_has_no_memory_module_and_dumps_nothing(tmp_path):
    assert memory_history(torch.device("cpu")) is None
    assert _profiler(tmp_path).snapshot_on_oom(5) is None
    assert list(tmp_path.iterdir()) == []


def test_the_snapshot_goes_where_configured_and_can_be_turned_off(tmp_path):
    profiler = _profiler(tmp_path, save_memory_snapshot_folder="mem")
    profiler._memory = _MemoryModule()
    path = profiler.snapshot_on_oom(5)
    assert path == str(tmp_path / "mem" / "iteration_5_exit" / "rank3_memory_snapshot.pickle")
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"] == [{"total_size": 123}]

    off = _profiler(tmp_path / "off", memory_snapshot_on_oom=False)
    off._memory = _MemoryModule()
    assert off.snapshot_on_oom(5) is None
    assert not (tmp_path / "off").exists()


def test_an_oom_in_a_training_step_dumps_a_snapshot_and_still_fails(tmp_path):
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    config.training.steps, config.training.seq_len, config.training.local_batch_size = 4, 32, 2
    config.lr_scheduler.warmup_steps = 1
    config.checkpoint.enable = False
    config.metrics.enable_tensorboard = False
    device = init_distributed()
    try:
        run = build(config, preflight(config, World.current(device)))
        run.profiler._memory = _MemoryModule()
        forwards = []

        def out_of_memory_in_step_3(module, args):
            forwards.append(1)
            if len(forwards) == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

        run.model_parts[0].register_forward_pre_hook(out_of_memory_in_step_3)
        try:
            with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
                train(run)
        finally:
            close(run)
    finally:
        dist.destroy_process_group()
    assert run.train_state.step == 3
    dumped = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.pickle"))
    assert [str(p) for p in dumped] == [
        "memory_snapshot/iteration_3_exit/rank0_memory_snapshot.pickle"
    ]


@pytest.mark.skipif(ACCELERATOR is None, reason="needs an accelerator")
def test_a_real_oom_on_the_accelerator_dumps_torchs_snapshot(tmp_path):
    device = torch.device(ACCELERATOR.type, torch.accelerator.current_device_index())
    config = ProfilingConfig(enable_memory_snapshot=True)
    with Profiler(config, dump_folder=str(tmp_path), rank=0, device=device) as profiler:
        assert profiler._memory is not None
        kept = torch.ones(2**20, device=device)
        try:
            torch.empty(2**50, dtype=torch.uint8, device=device)  # a petabyte
        except torch.OutOfMemoryError:
            path = profiler.snapshot_on_oom(1)
        del kept
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"]  # the allocator's blocks at the failure
    assert any(snapshot["device_traces"])  # the recorded history
