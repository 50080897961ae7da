"""An async checkpoint of an optimizer that steps inside backward (titan-optim's
``early_step_in_backward``): the next step's backward updates the parameters and the optimizer
state while the checkpoint's background copy may still read them. The container runs its
pre-step hooks, the checkpointer's wait among them, before the first update in backward, so
the step holds the values of save time."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from titan_ckpt import CheckpointConfig, CheckpointManager
from titan_optim import OptimizerConfig, build_optimizers

# DCP's background writer warns that it runs without torch.distributed: in one process, it does.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _train(model: nn.Module, optimizers, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
    nn.functional.mse_loss(model(x), y).backward()  # every parameter steps in here
    optimizers.step()


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_save_of_optimizer_in_backward_holds_the_save_time_values(tmp_path, mode):
    config = OptimizerConfig(lr=0.05, early_step_in_backward=True)
    model = _model()
    optimizers = build_optimizers(model, config)
    _train(model, optimizers, 0)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path), interval=1, async_mode=mode),
        model_parts=model,
        states={"optimizer": optimizers},
    )
    assert manager.save(1)  # async: the first save copies everything before it returns
    manager.wait()
    # Hold the background copy back until 0.3 s from now: long after the backward below
    # would have updated everything, unless it waits for the copy.
    name = "_finish" if mode == "async" else "_stage"
    copy = getattr(manager._async._stager, name)
    start = threading.Event()

    def late(*args, **kwargs):
        assert start.wait(timeout=60)
        return copy(*args, **kwargs)

    setattr(manager._async._stager, name, late)
    threading.Timer(0.3, start.set).start()
    saved_model, saved_optimizer = _tensors(model.state_dict()), _tensors(optimizers.state_dict())
    assert manager.save(2)
    _train(model, optimizers, 1)  # no maybe_wait_for_staging
    changed = _tensors(optimizers.state_dict())
    assert not all(torch.equal(changed[k], v) for k, v in saved_optimizer.items())
    manager.close()

    fresh = _model()
    fresh_optimizers = build_optimizers(fresh, config)
    _train(fresh, fresh_optimizers, 7)  # its own state, replaced by the load
    reader = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path), load_step=2),
        model_parts=fresh,
        states={"optimizer": fresh_optimizers},
    )
    assert reader.load()
    loaded_model, loaded_optimizer = (
        _tensors(fresh.state_dict()),
        _tensors(fresh_optimizers.state_dict()),
    )
    assert loaded_model.keys() == saved_model.keys()
    assert all(torch.equal(loaded_model[k], v) for k, v in saved_model.items())
    assert loaded_optimizer.keys() == saved_optimizer.keys()
    assert all(torch.equal(loaded_optimizer[k], v) for k, v in saved_optimizer.items())
