"""``FTOptimizersContainer`` with a real torchft ``Manager`` (one replica, local lighthouse).

The tests needing torchft are skipped when the ``torchft`` extra is not installed.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest
import torch
from torch import nn

from titan_optim import FTOptimizersContainer, OptimizerConfig, build_optimizers

# torchft 0.2.0 logs through the deprecated Logger.warn; that is its business, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated")


def test_without_torchft_the_wrapper_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install titan-optim\[torchft\]"):
        FTOptimizersContainer(build_optimizers(nn.Linear(2, 2)), manager=object())


@pytest.fixture
def torchft():
    return pytest.importorskip("torchft")


@pytest.fixture
def manager(torchft):
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    mgr = torchft.Manager(
        pg=torchft.ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=None,
        state_dict=None,
        replica_id="titan-optim-test",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse.address(),
        use_async_quorum=False,
        timeout=timedelta(seconds=10),
    )
    yield mgr
    mgr.shutdown()
    lighthouse.shutdown()


def test_commits_steps_and_serves_cached_state_without_stepping(manager):
    torch.manual_seed(0)
    model, plain_model = nn.Linear(3, 2), nn.Linear(3, 2)
    plain_model.load_state_dict(model.state_dict())
    optimizers = FTOptimizersContainer(build_optimizers(model, OptimizerConfig(lr=0.1)), manager)
    plain = build_optimizers(plain_model, OptimizerConfig(lr=0.1))
    for _step in range(2):
        x = torch.randn(4, 3)
        for m, opt in ((model, optimizers), (plain_model, plain)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    assert manager.current_step() == 2
    assert torch.equal(model.weight, plain_model.weight)  # same numbers as without torchft

    # Mid-step (gradients alive, nothing stepped yet) a peer reads our state for recovery.
    optimizers.zero_grad()
    model(torch.randn(4, 3)).square().mean().backward()
    before = model.weight.detach().clone()
    peer_view = manager._manager_state_dict()["user"]["optimizer"]
    assert peer_view is optimizers.state_dict()  # the cache, not a recomputation
    assert peer_view["state.weight.step"].item() == 2.0  # as of the last committed step
    assert torch.equal(model.weight, before)


def test_uncommitted_step_is_skipped(manager):
    model = nn.Linear(3, 2)
    optimizers = FTOptimizersContainer(build_optimizers(model, OptimizerConfig(lr=0.1)), manager)
    optimizers.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    manager.report_error(RuntimeError("a peer failed mid-allreduce"))
    before = model.weight.detach().clone()
    optimizers.step()
    assert torch.equal(model.weight, before)


def _count_allreduces(manager, monkeypatch):
    calls = []
    real = manager.allreduce

    def allreduce(tensor, *args, **kwargs):
        calls.append(tensor.shape)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(manager, "allreduce", allreduce)
    return calls


@pytest.mark.parametrize("clip", [True, False])
def test_gradients_are_averaged_once_per_step_before_clipping(manager, monkeypatch, clip):
    """The replica-group average runs inside the container (clip first, else step), once."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ft = FTOptimizersContainer(build_optimizers(model, OptimizerConfig(lr=0.1)), manager)
    calls = _count_allreduces(manager, monkeypatch)
    ft.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    if clip:
        ft.clip_grad_norm_(1.0)
        assert len(calls) == 2  # weight and bias, before the norm was taken
    ft.step()
    assert sorted(calls) == sorted([model.weight.shape, model.bias.shape])
