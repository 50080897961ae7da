"""Muon: the parameter split, its settings, and titan's ``Muon`` against ``torch.optim.Muon``.

The reference throughout is torch's own ``torch.optim.Muon`` (and ``AdamW``) on whole, plain
tensors. The multi-rank checks run ``workers/muon_worker.py`` under FSDP2, TP and FSDP2 + TP.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from titan_optim import (
    Muon,
    MuonConfig,
    OptimizerConfig,
    OptimizerConfigError,
    OptimizersInBackwardContainer,
    ParamGroupRule,
    build_optimizers,
)
from titan_optim.param_groups import group_parameters


class Net(nn.Module):
    def __init__(self, experts: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 10, bias=False)
        if experts:
            self.experts = nn.Parameter(torch.randn(3, 8, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x)
        h = h + self.down(torch.relu(self.up(h)))
        if hasattr(self, "experts"):
            h = h + torch.einsum("btd,edf->btf", h, self.experts).sum(-1, keepdim=True)
        return self.output(self.norm(h))


def split(model: nn.Module, config: OptimizerConfig) -> dict[str, list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, list[str]] = {}
    for g in group_parameters(model, config):
        out.setdefault(g["optimizer"], []).extend(names[id(p)] for p in g["params"])
    return out


def test_default_split_puts_hidden_matrices_and_expert_stacks_on_muon():
    groups = split(Net(experts=True), OptimizerConfig(name="Muon"))
    assert groups["Muon"] == ["experts", "up.weight", "down.weight"]
    assert groups["AdamW"] == [
        "tok_embeddings.weight",
        "up.bias",
        "norm.weight",
        "norm.bias",
        "output.weight",
    ]


def test_a_rule_names_the_optimizer_and_keeps_its_overrides():
    config = OptimizerConfig(
        name="Muon",
        param_group_rules=[
            ParamGroupRule(pattern="output.*", optimizer="Muon", lr=0.5),
            ParamGroupRule(pattern="down.*", optimizer="AdamW"),
        ],
    )
    groups = group_parameters(Net(), config)
    assert [(g["optimizer"], len(g["params"]), g.get("lr")) for g in groups] == [
        ("Muon", 1, 0.5),  # output.weight
        ("AdamW", 1, None),  # down.weight
        ("Muon", 1, None),  # up.weight
        ("AdamW", 4, None),  # embeddings, up.bias, norm weight and bias
    ]


def test_forcing_a_vector_onto_muon_is_refused_at_build():
    config = OptimizerConfig(
        name="Muon", param_group_rules=[ParamGroupRule(pattern="norm.*", optimizer="Muon")]
    )
    with pytest.raises(OptimizerConfigError) as err:
        build_optimizers(Net(), config)
    message = str(err.value)
    assert "\n" not in message
    assert "norm.weight (shape (8,))" in message
    assert "'AdamW'" in message


def test_a_rule_naming_an_optimizer_needs_muon():
    with pytest.raises(OptimizerConfigError, match="name='Muon'"):
        OptimizerConfig(
            name="AdamW", param_group_rules=[ParamGroupRule(pattern="*", optimizer="AdamW")]
        )
    with pytest.raises(OptimizerConfigError, match="'Muon', 'AdamW'"):
        ParamGroupRule(pattern="*", optimizer="Lion")


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"ns_steps": 100}, "fewer than 100"),
        ({"ns_steps": 0}, "ns_steps"),
        ({"adjust_lr_fn": "none"}, "'original', 'match_rms_adamw'"),
        ({"momentum": 1.0}, "momentum"),
        ({"ns_coefficients": (1.0, 2.0)}, "three numbers"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_bad_muon_settings_are_refused(settings, words):
    with pytest.raises(OptimizerConfigError, match=words):
        OptimizerConfig(name="Muon", muon=settings)


def test_muon_settings_reach_torch_muon_and_adamw():
    config = OptimizerConfig(
        name="Muon",
        lr=0.02,
        weight_decay=0.05,
        muon=MuonConfig(momentum=0.9, nesterov=False, ns_steps=3, adamw_lr=1e-3),
    )
    muon, adamw = build_optimizers(Net(), config).optimizers
    assert type(muon) is torch.optim.Muon  # plain 2-D parameters: torch's own
    group = muon.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"]) == (0.02, 0.05, 0.9)
    assert (group["nesterov"], group["ns_steps"], group["adjust_lr_fn"]) == (
        False,
        3,
        "match_rms_adamw",
    )
    assert type(adamw) is torch.optim.AdamW
    assert (adamw.param_groups[0]["lr"], adamw.param_groups[0]["weight_decay"]) == (1e-3, 0.05)


def train(model: nn.Module, optimizers, steps: int = 3) -> list[float]:
    x = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        optimizers.zero_grad()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        optimizers.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_titan_muon_on_matrices_and_expert_stacks_equals_torch_muon(adjust_lr_fn):
    """titan's Muon on a 3-D stack equals torch's Muon on each expert matrix alone."""
    torch.manual_seed(0)
    stack = torch.randn(3, 8, 6)
    params = [nn.Parameter(stack.clone()), nn.Parameter(torch.randn(5, 7))]
    ref = [nn.Parameter(m.clone()) for m in stack] + [nn.Parameter(params[1].detach().clone())]
    kwargs = {"lr": 0.05, "weight_decay": 0.1, "adjust_lr_fn": adjust_lr_fn}
    ours, theirs = Muon(params, **kwargs), torch.optim.Muon(ref, **kwargs)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=g) for p in params]
        params[0].grad, params[1].grad = grads
        for i, r in enumerate(ref):
            r.grad = grads[0][i].clone() if i < 3 else grads[1].clone()
        ours.step()
        theirs.step()
    assert torch.equal(params[0].detach(), torch.stack([r.detach() for r in ref[:3]]))
    assert torch.equal(params[1].detach(), ref[3].detach())
    # The same state and group keys as torch's, so checkpoints move between the two.
    assert ours.param_groups[0].keys() == theirs.param_groups[0].keys()
    assert ours.state[params[1]].keys() == theirs.state[ref[3]].keys() == {"momentum_buffer"}


def test_muon_trains_and_its_state_round_trips():
    torch.manual_seed(0)
    model = Net(experts=True)
    config = OptimizerConfig(name="Muon", lr=0.02)
    optimizers = build_optimizers(model, config)
    assert [type(o) for o in optimizers] == [Muon, torch.optim.AdamW]
    losses = train(model, optimizers)
    assert losses[-1] < losses[0]
    state = optimizers.state_dict()
    assert "state.experts.momentum_buffer" in state
    assert "state.output.weight.exp_avg" in state
    clone = copy.deepcopy(model)
    again = build_optimizers(clone, config)
    again.load_state_dict(copy.deepcopy(state))  # not the live tensors
    assert train(clone, again, 2) == train(model, optimizers, 2)


def test_pipeline_parts_each_get_muon_and_adamw_and_save_as_one_dict():
    torch.manual_seed(0)
    full = Net()
    first, second = nn.Module(), nn.Module()
    first.tok_embeddings, first.up = full.tok_embeddings, full.up
    second.down, second.norm, second.output = full.down, full.norm, full.output
    optimizers = build_optimizers([first, second], OptimizerConfig(name="Muon"))
    assert [type(o).__name__ for o in optimizers] == ["Muon", "AdamW", "Muon", "AdamW"]
    for p in full.parameters():
        p.grad = torch.ones_like(p)
    optimizers.step()
    keys = optimizers.state_dict()
    assert "state.up.weight.momentum_buffer" in keys
    assert "state.down.weight.momentum_buffer" in keys
    assert "state.tok_embeddings.weight.exp_avg" in keys


def test_in_backward_muon_equals_the_stepped_container():
    torch.manual_seed(0)
    model = Net()
    other = copy.deepcopy(model)
    config = OptimizerConfig(name="Muon", lr=0.02, implementation="for-loop")
    in_backward = OptimizersInBackwardContainer([other], config)
    assert {type(o).__name__ for o in in_backward} == {"Muon", "AdamW"}
    assert train(other, in_backward) == train(model, build_optimizers(model, config))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "nproc"), [("fsdp2", 2), ("tp2", 2), ("fsdp_tp4", 4), ("hsdp4", 4)]
)
def test_sharded_muon_equals_torch_muon_on_one_process(tmp_path, torchrun, layout, nproc):
    torchrun("muon_worker.py", nproc, layout, str(tmp_path), str(tmp_path / "ckpt"), timeout=120)
    result = json.loads((tmp_path / f"{layout}.json").read_text())
    assert result["kinds"] == ["Muon", "AdamW"]
    assert result["titan_muon"]
    # Matrices split only by rows (FSDP2, TP's colwise, HSDP's shards) are spread over the
    # ranks; the rest (TP's rowwise, FSDP2 + TP) gather each matrix.
    both = ["up.weight", "down.weight"]
    spread = {"fsdp2": both, "tp2": ["up.weight"], "fsdp_tp4": [], "hsdp4": both}
    assert result["spread"] == spread[layout]
    assert result["moved"] > 1e-2  # the steps really changed the parameters
    assert max(result["diffs"]) <= 1e-6  # same parameters as torch.optim.Muon after each step
    assert result["resume_diff"] <= 1e-6  # DCP save and resume continues identically
    assert "state.up.weight.momentum_buffer" in result["keys"]
    assert "state.experts.momentum_buffer" in result["keys"]  # per-expert, whole or gathered
    assert "state.output.weight.exp_avg" in result["keys"]


def test_an_expert_stack_split_by_fsdp_and_expert_parallel_stays_local():
    """FSDP2 over expert parallel leaves a stack's dim 0 split twice (``_StridedShard`` then
    ``Shard``): each rank holds whole experts and orthogonalises them without a gather."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_optim import muon

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
        local = torch.randn(2, 6, 5)
        placements = (_StridedShard(0, split_factor=2), Shard(0))
        stack = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=(8, 6, 5), stride=(30, 5, 1)
        )
        assert muon._whole_matrices(stack)
        group = {"ns_steps": 5, "ns_coefficients": (3.4445, -4.775, 2.0315), "eps": 1e-7}
        out = muon.orthogonalize(stack, group)  # the fake group would return no real gather
        assert out.placements == placements
        expected = torch.stack([muon._newton_schulz(m, group) for m in local])
        torch.testing.assert_close(out.to_local(), expected)
        split_rows = DTensor.from_local(local, mesh, (Shard(1), Shard(0)), run_check=False)
        assert not muon._whole_matrices(split_rows)  # experts cut by rows are not whole
    finally:
        dist.destroy_process_group()
