"""``ModelState`` and ``OptimizerState`` give what torch's ``get_model_state_dict`` and
(flattened) ``get_optimizer_state_dict`` give, on every call, while they reuse the FQN keys
learned from torch's functions in an earlier call: through compile and activation
checkpointing wrappers, tied weights, and after the model or the optimizer changed. The
FSDP2 (DTensor) case, two gloo ranks, is in test_distributed.py (``same_as_torch``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import titan_ckpt.states as states
from titan_ckpt import OptimizerState
from titan_ckpt.states import ModelState

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)) * self.scale


class Net(nn.Module):
    """Compile's ``_orig_mod.``, activation checkpointing's ``_checkpoint_wrapped_module.``
    and a weight tied between the embedding and the output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleDict({"0": checkpoint_wrapper(Block()), "1": torch.compile(Block())})
        self.out = nn.Linear(4, 8, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks.values():
            x = block._orig_mod(x) if hasattr(block, "_orig_mod") else block(x)
        return self.out(x)


def _same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert states._same_tensor(ours[key], value), key
        else:
            assert ours[key] == value, key


def _counted(monkeypatch, name: str) -> list[int]:
    """Count the calls of torch's function ``name`` made by titan_ckpt.states."""
    calls = [0]
    real = getattr(states, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(states, name, counting)
    return calls


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.arange(8).reshape(2, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_model_state_is_torchs_state_dict_on_every_call_and_after_changes(monkeypatch):
    calls = _counted(monkeypatch, "get_model_state_dict")
    model = Net()
    state = ModelState(model)
    first = state.state_dict()
    assert "blocks.0.proj.weight" in first  # no wrapper in the names
    assert "blocks.1.norm.bias" in first
    assert "out.weight" in first  # tied to embed.weight: both names
    assert "blocks.0.scratch" not in first  # not persistent
    for _ in range(3):
        _same(state.state_dict(), get_model_state_dict(model))
    assert calls[0] == 1  # learned once, then the module's own state_dict renamed

    # A parameter replaced by another object (the keys unchanged): its new values.
    model.blocks["1"].proj.weight = nn.Parameter(torch.full((4, 4), 5.0))
    ours = state.state_dict()
    _same(ours, get_model_state_dict(model))
    assert torch.equal(ours["blocks.1.proj.weight"], torch.full((4, 4), 5.0))
    assert calls[0] == 1

    # A module added: other keys, learned again.
    model.head = nn.Linear(4, 2)
    _same(state.state_dict(), get_model_state_dict(model))
    assert calls[0] == 2
    _same(state.state_dict(), get_model_state_dict(model))
    assert calls[0] == 2


def test_model_state_of_two_parts_with_one_name_is_still_refused():
    with pytest.raises(states.CheckpointConfigError, match="share the parameter names"):
        ModelState([nn.Linear(2, 2), nn.Linear(2, 2)]).state_dict()


def test_optimizer_state_is_torchs_flattened_state_dict_on_every_call(monkeypatch):
    calls = _counted(monkeypatch, "get_optimizer_state_dict")
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = OptimizerState(model, opt)
    # No optimizer state yet: torch's function initializes it (a zero step), then the keys
    # are learned.
    before = state.state_dict()
    assert calls[0] == 1
    assert "state.blocks.0.proj.weight.exp_avg" in before
    for _ in range(2):
        _step(model, opt)
        ours = state.state_dict()
        _same(ours, get_optimizer_state_dict(model, opt, options=FLAT))
        assert ours["param_groups.embed.weight.lr"] == 0.01
    assert calls[0] == 1  # reused
    _step(model, opt)
    opt.param_groups[0]["lr"] = 0.5  # a new value, the same keys
    ours = state.state_dict()
    _same(ours, get_optimizer_state_dict(model, opt, options=FLAT))
    assert ours["param_groups.embed.weight.lr"] == 0.5
    assert calls[0] == 1

    # A new parameter group: other keys, learned again.
    model.head = nn.Linear(8, 2)
    opt.add_param_group({"params": list(model.head.parameters()), "lr": 0.1})
    (model.head(model(torch.arange(8).reshape(2, 4)))).sum().backward()
    opt.step()
    ours = state.state_dict()
    assert ours["param_groups.head.bias.lr"] == 0.1
    _same(ours, get_optimizer_state_dict(model, opt, options=FLAT))
    assert calls[0] == 2
    _same(state.state_dict(), get_optimizer_state_dict(model, opt, options=FLAT))
    assert calls[0] == 2

    # A model parameter replaced under the optimizer: torch's function decides (it
    # cannot name the optimizer's old parameter), as it would have without the learning.
    model.head.bias = nn.Parameter(torch.zeros(2))
    with pytest.raises(KeyError):
        get_optimizer_state_dict(model, opt, options=FLAT)
    with pytest.raises(KeyError):
        state.state_dict()


class WithExtraState(nn.Module):
    """A module whose extra state (not a tensor) keeps the FQN renaming from being learned;
    counts its own ``state_dict()`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.calls = 0

    def get_extra_state(self) -> dict[str, int]:
        return {"version": 1}

    def set_extra_state(self, state: Any) -> None:
        pass

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().state_dict(*args, **kwargs)


def test_a_failed_learning_is_not_tried_again_on_every_save(monkeypatch):
    model = WithExtraState()
    get_model_state_dict(model)
    torchs_calls, model.calls = model.calls, 0  # what torch's function costs alone
    calls = _counted(monkeypatch, "get_model_state_dict")
    state = ModelState(model)
    _same(state.state_dict(), get_model_state_dict(model))  # tried once: not learnable
    model.calls = 0
    for _ in range(3):
        assert state.state_dict()["_extra_state"] == {"version": 1}
    assert calls[0] == 1 + 3  # torch's function on every call
    assert model.calls == 3 * torchs_calls  # and no second state_dict() per call

    # The optimizer's state: learning fails when its flattening is not torch's (here an
    # extra top-level entry torch's function keeps out); not tried again either.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.proj(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt_calls = [0]
    real = opt.state_dict

    def counting() -> dict[str, Any]:
        opt_calls[0] += 1
        osd = real()
        osd["state"][0]["note"] = {"nested": torch.zeros(1)}
        return osd

    monkeypatch.setattr(opt, "state_dict", counting)
    torchs = _counted(monkeypatch, "get_optimizer_state_dict")
    ostate = OptimizerState(model, opt)
    ostate.state_dict()
    tried = opt_calls[0]
    for _ in range(3):
        ostate.state_dict()
    assert torchs[0] == 4  # not learned: torch's function on every call
    assert opt_calls[0] - tried == 3 * (tried - 1)  # torch's own calls only, per save
