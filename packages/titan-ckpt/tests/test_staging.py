"""``titan_ckpt.staging.ReusingStager``: a later staging refills the earlier staged tensors
with the new values and takes every other value fresh; a state of another layout is staged
afresh. Checked against the values put in (and, through the manager, the values loaded
back). The DTensor path (FSDP2, both async modes, 2 gloo ranks) is in test_distributed.py."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from torch.distributed.checkpoint.staging import StagingOptions

from titan_ckpt import CheckpointConfig, CheckpointManager, OptimizerState
from titan_ckpt.staging import ReusingStager

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(scale: float, step: int) -> dict:
    return {
        "w": torch.arange(6.0).reshape(2, 3) * scale,
        "nested": {"pair": (torch.ones(4) * scale, "tag"), "list": [torch.zeros(2) + scale, 7]},
        "step": step,
        "lr": [{"lr": 0.1 * step}],
    }


def _stager() -> ReusingStager:
    return ReusingStager(StagingOptions(False, False, False, False))


def test_second_staging_refills_the_first_copy_and_takes_new_plain_values():
    stager = _stager()
    first = stager.stage(_state(1.0, 1))
    first_w = first["w"]
    source = _state(3.0, 2)
    second = stager.stage(source)
    assert stager.reused == 1
    assert second["w"] is first_w  # the same staged tensor, refilled
    assert second["w"].data_ptr() != source["w"].data_ptr()  # still a copy of the source
    assert torch.equal(second["w"], torch.arange(6.0).reshape(2, 3) * 3)
    assert torch.equal(second["nested"]["pair"][0], torch.ones(4) * 3)
    assert second["nested"]["pair"][1] == "tag"
    assert torch.equal(second["nested"]["list"][0], torch.zeros(2) + 3)
    assert second["step"] == 2
    assert second["lr"] == [{"lr": pytest.approx(0.2)}]
    assert second["lr"][0] is not source["lr"][0]  # plain values are copied too
    source["w"].add_(100.0)  # training moves on: the staged copy keeps the save-time values
    assert torch.equal(second["w"], torch.arange(6.0).reshape(2, 3) * 3)
    stager.close()


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.update(w=torch.zeros(3, 2)),  # another shape
        lambda s: s.update(w=torch.zeros(2, 3, dtype=torch.float64)),  # another dtype
        lambda s: s.update(extra=torch.zeros(1)),  # a new entry (optimizer state appearing)
        lambda s: s["nested"].update(list=[torch.zeros(2)]),  # a shorter list
        lambda s: s.update(step=torch.tensor(2)),  # a plain value became a tensor
        lambda s: s.update(w=torch.zeros(3, 2).t()),  # same shape, other strides
    ],
)
def test_another_layout_is_staged_afresh(change):
    stager = _stager()
    first = stager.stage(_state(1.0, 1))
    state = _state(2.0, 2)
    change(state)
    second = stager.stage(state)
    assert stager.reused == 0
    assert second["w"] is not first["w"]
    assert torch.equal(second["w"], state["w"])
    stager.close()


def test_deferred_entries_are_copied_after_stage_returns_the_rest_before():
    stager = _stager()
    stager.deferred = frozenset({"nested"})
    first_w = stager.stage(_state(1.0, 1))["w"]  # the first staging copies everything at once
    source = _state(3.0, 2)
    release = threading.Event()
    stager._deferrer = ThreadPoolExecutor(1)
    stager._deferrer.submit(release.wait, 60)  # hold the background copy back
    future = stager.stage(source)
    assert isinstance(future, Future)
    assert not future.done()
    source["w"].add_(100.0)  # copied before stage returned: keeps its save-time values
    source["nested"]["pair"][0].add_(100.0)  # deferred: the copy sees what is there then
    release.set()
    staged = future.result(timeout=60)
    assert stager.reused == 1
    assert torch.equal(staged["w"], torch.arange(6.0).reshape(2, 3) * 3)
    assert torch.equal(staged["nested"]["pair"][0], torch.ones(4) * 103)
    assert torch.equal(staged["nested"]["list"][0], torch.zeros(2) + 3)
    assert staged["nested"]["pair"][1] == "tag"
    assert staged["step"] == 2
    # A deferred entry of another layout is staged afresh in the background, the rest
    # refilled before stage returns.
    changed = _state(4.0, 3)
    changed["nested"]["list"] = [torch.zeros(5) + 4]
    future = stager.stage(changed)
    assert isinstance(future, Future)
    staged = future.result(timeout=60)
    assert stager.reused == 2
    assert staged["w"] is first_w
    assert torch.equal(staged["nested"]["list"][0], torch.zeros(5) + 4)
    assert staged["nested"]["list"][0].data_ptr() != changed["nested"]["list"][0].data_ptr()
    assert torch.equal(staged["nested"]["pair"][0], torch.ones(4) * 4)
    # Then that layout is refilled in turn.
    again = _state(6.0, 4)
    again["nested"]["list"] = [torch.zeros(5) + 6]
    staged = stager.stage(again).result(timeout=60)
    assert stager.reused == 3
    assert torch.equal(staged["nested"]["list"][0], torch.zeros(5) + 6)
    # Another layout outside the deferred entries stages everything afresh, before stage
    # returns; so does a stager without deferred entries.
    outside = _state(7.0, 5)
    outside["w"] = torch.zeros(3, 2)
    assert isinstance(stager.stage(outside), dict)
    assert stager.reused == 3
    stager.deferred = frozenset()
    assert isinstance(stager.stage(_state(5.0, 4)), dict)
    stager.close()
    assert stager._deferrer is None


def test_async_manager_saves_with_optimizer_state_load_back_as_saved(common, tmp_path):
    # Saves 2 and 3 refill save 1's staged copy (its AdamW state too: DCP's optimizer state
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
        assert manager._async._stager.reused == 2
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
