"""Device detection, backend choice and the launcher environment, on this (CPU) machine."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from titan_dims import (
    DistributedEnv,
    DistributedEnvError,
    default_backend,
    detect_device_type,
    device_module,
    init_distributed,
    local_device_index,
    set_collective_timeout,
)


def test_detects_the_accelerator_or_cpu(monkeypatch):
    monkeypatch.delenv("TITAN_DEVICE", raising=False)
    if torch.accelerator.is_available():
        assert detect_device_type() == torch.accelerator.current_accelerator().type
    else:
        assert detect_device_type() == "cpu"


def test_environment_override(monkeypatch):
    monkeypatch.setenv("TITAN_DEVICE", "cpu")
    assert detect_device_type() == "cpu"
    monkeypatch.setenv("TITAN_DEVICE", "tpu9")
    with pytest.raises(ValueError, match=r"\$TITAN_DEVICE='tpu9' is not a torch device type"):
        detect_device_type()


@pytest.mark.parametrize(
    ("device_type", "cpu_collectives", "backend"),
    [
        ("cpu", False, "gloo"),
        ("cpu", True, "gloo"),
        ("cuda", False, "nccl"),
        ("cuda", True, "cpu:gloo,cuda:nccl"),
        ("xpu", False, "xccl"),
        ("xpu", True, "cpu:gloo,xpu:xccl"),
    ],
)
def test_backend_follows_torch_device_table(device_type, cpu_collectives, backend):
    assert default_backend(device_type, cpu_collectives=cpu_collectives) == backend


def test_unknown_device_has_no_backend():
    with pytest.raises(
        ValueError, match=r"No collective backend is known for device type 'quux'.*cpu -> gloo"
    ):
        default_backend("quux")


def test_device_module():
    assert device_module("cpu") is torch.cpu
    with pytest.raises(ValueError, match="'nope' is not a torch device type"):
        device_module("nope")


def test_no_launcher_means_one_process():
    env = DistributedEnv.from_environ({})
    assert (env.rank, env.world_size, env.local_rank, env.launched) == (0, 1, 0, False)


def test_torchrun_environment_is_read():
    env = DistributedEnv.from_environ(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.launched


def test_partial_environment_names_what_is_missing():
    with pytest.raises(
        DistributedEnvError,
        match=r"Found RANK, WORLD_SIZE but not LOCAL_RANK, MASTER_ADDR, MASTER_PORT",
    ):
        DistributedEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"RANK": "x"}, r"RANK='x' in the environment is not a whole number"),
        ({"RANK": "4"}, r"RANK=4 and WORLD_SIZE=4 are inconsistent"),
    ],
)
def test_bad_environment_values(overrides, message):
    env = {
        "RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }
    with pytest.raises(DistributedEnvError, match=message):
        DistributedEnv.from_environ({**env, **overrides})


def test_unlaunched_process_gets_a_one_rank_group_with_timeouts(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TITAN_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    try:
        device = init_distributed(device_type="cpu", timeout=timedelta(seconds=42))
        assert device == torch.device("cpu")
        assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("gloo", 1, 0)
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(seconds=42)
        set_collective_timeout(timedelta(seconds=7))
        assert backend.options._timeout == timedelta(seconds=7)
        assert init_distributed(device_type="cpu") == device  # idempotent
        total = torch.ones(3)
        dist.all_reduce(total)
        assert total.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("local_rank", "visible", "index"),
    [(0, 8, 0), (5, 8, 5), (3, 1, 0), (5, 4, 1)],  # one GPU per task: always device 0
)
def test_the_device_index_is_the_local_rank_among_the_visible_devices(local_rank, visible, index):
    assert local_device_index(local_rank, visible) == index


def test_no_visible_accelerator_is_one_clear_error():
    with pytest.raises(DistributedEnvError, match="none is visible to this process"):
        local_device_index(2, 0)
