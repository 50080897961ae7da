"""TiedOptimizerState: a tied weight's copy on the last pipeline stage saves its optimizer
state under the first name and loads it from there, also on a rank holding both ends (a V
schedule). The checkpoint round trip across layouts is in integration_tests/test_qwen3.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from titan_optim import OptimizerConfig, build_optimizers
from titan_train.trainer.tied_state import TiedOptimizerState, tied_optimizer_state

NAMES = [("emb.weight", "out.weight")]


def parts(*, first: bool, last: bool) -> list[nn.Module]:
    out = []
    if first:
        out.append(nn.ModuleDict({"emb": nn.Linear(3, 4, bias=False)}))
    if last:
        out.append(nn.ModuleDict({"out": nn.Linear(3, 4, bias=False)}))
    return out


def stepped(modules: list[nn.Module], seed: int):
    optimizers = build_optimizers(modules, OptimizerConfig(lr=0.1))
    torch.manual_seed(seed)
    for module in modules:
        for p in module.parameters():
            p.grad = torch.randn_like(p)
    optimizers.step()
    return optimizers


def test_the_copy_saves_under_the_first_name_and_loads_from_it():
    last_only = stepped(parts(first=False, last=True), seed=1)
    saved = TiedOptimizerState(last_only, NAMES).state_dict()
    assert "state.emb.weight.exp_avg" in saved
    assert not any(k.startswith(("state.out.", "param_groups.out.")) for k in saved)
    fresh = parts(first=False, last=True)
    target = TiedOptimizerState(stepped(fresh, seed=2), NAMES)
    target.load_state_dict(saved)
    loaded = target.optimizers.state_dict()
    assert torch.equal(loaded["state.out.weight.exp_avg"], saved["state.emb.weight.exp_avg"])


def test_a_rank_with_both_ends_keeps_one_entry_and_fills_both():
    both = stepped(parts(first=True, last=True), seed=1)
    state = TiedOptimizerState(both, NAMES)
    saved = state.state_dict()
    first = both.state_dict()["state.emb.weight.exp_avg"]
    assert torch.equal(saved["state.emb.weight.exp_avg"], first)  # the first end's, kept
    assert not any(k.startswith("state.out.") for k in saved)
    state.load_state_dict(saved)
    after = both.state_dict()
    assert torch.equal(after["state.out.weight.exp_avg"], first)


def test_only_a_pipeline_with_tied_weights_is_wrapped():
    optimizers = object()
    assert tied_optimizer_state(optimizers, None) is optimizers
    assert tied_optimizer_state(optimizers, SimpleNamespace(tied=None)) is optimizers
    wrapped = tied_optimizer_state(optimizers, SimpleNamespace(tied=SimpleNamespace(names=NAMES)))
    assert isinstance(wrapped, TiedOptimizerState)


def test_background_staging_guards_the_container_it_saves(tmp_path):
    # async_with_pinned_mem stages in the background; the checkpointer makes the optimizer
    # container (wrapped or not) wait for the staging before it steps.
    from titan_ckpt import CheckpointConfig, CheckpointManager

    modules = parts(first=True, last=True)
    optimizers = stepped(modules, seed=1)
    for name, state in (("plain", optimizers), ("tied", TiedOptimizerState(optimizers, NAMES))):
        config = CheckpointConfig(
            enable=True,
            folder=str(tmp_path / name),
            interval=1,
            async_mode="async_with_pinned_mem",
        )
        manager = CheckpointManager(config, model_parts=modules, states={"optimizer": state})
        assert len(optimizers._pre_hooks) == 1
        assert manager.save(1)
        for module in modules:
            for p in module.parameters():
                p.grad = torch.ones_like(p)
        optimizers.step()  # no maybe_wait_for_staging: the hook waited
        assert manager._async._staging is None
        manager.close()
        assert len(optimizers._pre_hooks) == 0
