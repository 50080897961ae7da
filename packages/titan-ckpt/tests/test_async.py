"""Async modes in one process (CPU): save returns after staging, the written step holds the
values at save time even if training changes them at once, saves never overlap, close()
drains. The writer process of async_with_pinned_mem is exercised in test_distributed.py."""

from __future__ import annotations

import logging
import sys
import threading
import types

import pytest
import torch

from titan_ckpt import CheckpointConfig, CheckpointManager, OptimizerState, storage_for
from titan_ckpt.asyncmode import DeferringStager, check_main_guard
from titan_ckpt.layout import scan_steps

# DCP's background writer warns that it runs without torch.distributed: in one process, it does.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_save_keeps_values_at_save_time(common, tmp_path, mode, caplog):
    model = common.make_model()
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=1, async_mode=mode)
    caplog.set_level(logging.INFO, logger="titan_ckpt")
    manager = CheckpointManager(config, model_parts=model)
    if mode == "async_with_pinned_mem":
        assert "nothing to pin" in caplog.text
    snapshots = {}
    for step in (1, 2, 3):
        assert manager.save(step)  # the previous save is finished (and committed) first
        snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
        manager.maybe_wait_for_staging()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2.0)  # training moves on while the write runs
    manager.close()
    assert scan_steps(storage_for(str(tmp_path)), str(tmp_path)).committed == [1, 2, 3]
    # The log says what was still running when save() returned.
    background = "staging and writing in the background"
    assert (background in caplog.text) == (mode == "async_with_pinned_mem")
    assert ("; writing in the background" in caplog.text) == (mode == "async")

    for step in (1, 3):
        fresh = common.make_model(seed=5)
        reader = CheckpointManager(
            CheckpointConfig(enable=True, folder=str(tmp_path), load_step=step, load_only=True),
            model_parts=fresh,
        )
        assert reader.load()
        assert all(torch.equal(v, snapshots[step][k]) for k, v in fresh.state_dict().items())


def _late_staging(manager: CheckpointManager, start: threading.Event) -> None:
    """Make the manager's background staging wait for ``start`` (a slow copy): the whole
    staging (async_with_pinned_mem) or its deferred part (async)."""
    name = "_finish" if manager.config.async_mode == "async" else "_stage"
    stage = getattr(manager._async._stager, name)

    def late(*args, **kwargs):
        assert start.wait(timeout=60)
        return stage(*args, **kwargs)

    setattr(manager._async._stager, name, late)


def _saved_and_stepped(common, folder, *, guarded: bool, mode: str):
    """Save a step in ``mode``, then step the optimizer at once, without
    ``maybe_wait_for_staging``, while the background copy has not begun. Returns the state at
    save time, the state after the step, and what the step holds on disk."""
    model = common.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    common.train_steps(model, opt, range(1, 3), rank=0)
    optimizer = OptimizerState(model, opt)
    config = CheckpointConfig(enable=True, folder=str(folder), interval=1, async_mode=mode)
    manager = CheckpointManager(config, model_parts=model, states={"optimizer": optimizer})
    if mode == "async":
        assert manager.save(1)
        manager.wait()
    start = threading.Event()
    if guarded:  # the staging starts 0.3 s late; the step must wait for it
        threading.Timer(0.3, start.set).start()
    else:  # the staging starts only once the step is done
        for handle in manager._async._step_guards:
            handle.remove()
    _late_staging(manager, start)
    before = {**model.state_dict(), **optimizer.state_dict()}
    before = {k: v.clone() for k, v in before.items() if isinstance(v, torch.Tensor)}
    assert manager.save(2)
    common.train_steps(model, opt, range(3, 4), rank=0)  # no maybe_wait_for_staging
    # The guard waited for the staging (and cleared it) inside opt.step().
    assert (manager._async._staging is None) == guarded
    start.set()
    after = {**model.state_dict(), **optimizer.state_dict()}
    after = {k: v.clone() for k, v in after.items() if isinstance(v, torch.Tensor)}
    manager.close()
    assert opt._optimizer_step_pre_hooks == {}  # close() removed the guard
    fresh = common.make_model(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    common.train_steps(fresh, fresh_opt, range(7, 8), rank=0)  # its own state, replaced
    fresh_state = OptimizerState(fresh, fresh_opt)
    reader = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), load_step=2),
        model_parts=fresh,
        states={"optimizer": fresh_state},
    )
    assert reader.load()
    loaded = {**fresh.state_dict(), **fresh_state.state_dict()}
    return before, after, {k: loaded[k] for k in before}


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_optimizer_step_waits_for_background_staging(common, tmp_path, mode):
    # async_with_pinned_mem stages in the background, async the optimizer's state (after the
    # first save); a loop that steps its optimizer without maybe_wait_for_staging still
    # saves the values at save time, because the manager's step pre-hook on the optimizer
    # waits for the staging.
    before, after, saved = _saved_and_stepped(common, tmp_path / "guarded", guarded=True, mode=mode)
    assert saved.keys() == before.keys()
    assert any(k.startswith("state.") and k.endswith("exp_avg") for k in saved)
    assert all(torch.equal(saved[k], before[k]) for k in before)
    assert not all(torch.equal(after[k], before[k]) for k in before)  # the step changed them
    # Without the hook the same loop saves the values after the step where the copy was
    # deferred: the test can tell. Both modes copy the model's parameters and the
    # optimizer's state in the background (this model has no buffers).
    _, after, saved = _saved_and_stepped(common, tmp_path / "unguarded", guarded=False, mode=mode)
    assert any(not k.startswith("state.") for k in after)  # the model's parameters too
    assert all(torch.equal(saved[k], after[k]) for k in after)


class _Counting(torch.nn.Module):
    """A layer with a persistent buffer its forward changes in place (as an MoE layer counts
    the tokens per expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.lin(x)


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
@pytest.mark.parametrize("with_optimizer", [True, False])
def test_buffers_changed_by_the_next_forward_are_saved_as_at_save_time(
    tmp_path, mode, with_optimizer
):
    # The next step's forward runs while async_with_pinned_mem stages (and async copies the
    # guarded optimizer's state and the model's parameters): a buffer the forward changes
    # must be saved as it was at save(), and the parameters as they were then too.
    torch.manual_seed(0)
    model = _Counting()
    model(torch.ones(2, 4))
    states = {}
    if with_optimizer:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        states = {"optimizer": OptimizerState(model, opt)}
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=1, async_mode=mode)
    manager = CheckpointManager(config, model_parts=model, states=states)
    assert manager.save(1)
    manager.wait()
    start = threading.Event()
    _late_staging(manager, start)
    weights = model.lin.weight.detach().clone()
    seen = float(model.seen)
    assert manager.save(2)
    if with_optimizer:  # the next step: its optimizer step waits for the copy
        threading.Timer(0.3, start.set).start()
        model(torch.ones(3, 4)).sum().backward()
        assert float(model.seen) == seen + 3
        opt.step()
        assert not torch.equal(model.lin.weight, weights)
    else:
        model(torch.ones(3, 4))  # the next step's forward, before the staging has begun
        assert float(model.seen) == seen + 3
        start.set()
    manager.close()
    fresh = _Counting()
    reader = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path), load_step=2), model_parts=fresh
    )
    assert reader.load()
    assert float(fresh.seen) == seen
    assert torch.equal(fresh.lin.weight, weights)


def test_last_step_save_is_synchronous(common, tmp_path):
    model = common.make_model()
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=10, async_mode="async")
    manager = CheckpointManager(config, model_parts=model)
    manager.save(7, last_step=True)
    # Committed on return, without close(): the last save does not run in the background.
    assert scan_steps(storage_for(str(tmp_path)), str(tmp_path)).committed == [7]
    manager.close()


def test_main_guard_check_refuses_unguarded_script(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("import torch\nprint('training')\n")
    fake_main = types.ModuleType("__main__")
    fake_main.__file__ = str(script)
    fake_main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    with pytest.raises(RuntimeError, match=r"train.py; that script has no `if __name__"):
        check_main_guard()
    script.write_text("def main():\n    pass\n\nif __name__ == '__main__':\n    main()\n")
    check_main_guard()


def test_too_little_shared_memory_for_pinned_staging_is_one_clear_error(
    common, tmp_path, monkeypatch
):
    """async_with_pinned_mem stages each rank's state in /dev/shm; a container's 64 MiB
    default used to fail with a bus error mid-copy. The first save checks the space this
    node's ranks need and raises DiskFullError with the fix; nothing is committed."""
    import shutil
    from collections import namedtuple

    from titan_ckpt import DiskFullError, asyncmode

    if not __import__("os").path.isdir(asyncmode.SHARED_MEMORY):
        pytest.skip("no /dev/shm here")
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(
        asyncmode.shutil,
        "disk_usage",
        lambda path: (
            usage(64 * 2**20, 64 * 2**20 - 100, 100)
            if path == asyncmode.SHARED_MEMORY
            else real(path)
        ),
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model = common.make_model()
    config = CheckpointConfig(
        enable=True, folder=str(tmp_path), interval=1, async_mode="async_with_pinned_mem"
    )
    manager = CheckpointManager(config, model_parts=model)
    state_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    with pytest.raises(DiskFullError, match="this node's 4 rank") as error:
        manager.save(1)
    assert error.value.needed == 4 * state_bytes
    assert "docker run --shm-size" in str(error.value)
    manager.close()
    assert scan_steps(storage_for(str(tmp_path)), str(tmp_path)).committed == []


def test_async_manager_saves_with_optimizer_state_load_back_as_saved(common, tmp_path):
    # Each save stages the AdamW state in the background (DCP's optimizer state
    # dict creates the state before the first step); each step loads back as it was saved.
    model = common.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    states = {"optimizer": OptimizerState(model, opt), "train_state": common.TrainState()}
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=1, async_mode="async")
    saved = {}
    with CheckpointManager(config, model_parts=model, states=states) as manager:
        for step in (1, 2, 3):
            states["train_state"].step = step
            manager.save(step)
            saved[step] = (
                {k: v.clone() for k, v in model.state_dict().items()},
                {k: v.clone() for k, v in opt.state_dict()["state"][0].items()},
            )
            common.train_steps(model, opt, range(step, step + 1), rank=0)
    for step in (1, 2, 3):
        fresh = common.make_model(seed=9)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        train_state = common.TrainState()
        reader = CheckpointManager(
            CheckpointConfig(enable=True, folder=str(tmp_path)),
            model_parts=fresh,
            states={"optimizer": OptimizerState(fresh, fresh_opt), "train_state": train_state},
        )
        assert reader.load(step)
        reader.close()
        params, opt_state = saved[step]
        assert all(torch.equal(v, params[k]) for k, v in fresh.state_dict().items())
        loaded = fresh_opt.state_dict()["state"][0]
        assert all(torch.equal(loaded[k], v) for k, v in opt_state.items())
        assert train_state.step == step


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
def test_deferred_copy_runs_on_its_own_stream_after_the_queued_step():
    # The deferred entries are copied on the stager's stream, not the caller's (the compute
    # stream), and only after the kernels queued before stage(): the copy holds the doubled
    # values even though nothing synchronized the device in between.
    seen = []

    class Watched(DeferringStager):
        def _stage(self, state_dict, **kwargs):
            seen.append(torch.accelerator.current_stream())
            return super()._stage(state_dict, **kwargs)

    device = torch.accelerator.current_accelerator()
    weights = torch.ones(4096, 4096, device=device)
    stager = Watched()
    stager.deferred = frozenset({"model"})
    weights.mul_(2)  # queued on the caller's stream
    staged = stager.stage({"model": {"w": weights}, "step": torch.tensor(1)}).result()
    stager.close()
    assert staged["model"]["w"].device.type == "cpu"
    assert bool((staged["model"]["w"] == 2).all())
    assert seen[-1] == stager.copy_stream != torch.accelerator.current_stream()
