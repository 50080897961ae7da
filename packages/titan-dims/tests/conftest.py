"""Shared test fixtures for titan-dims.

The ``reference_groups`` oracle restates torchtitan's ParallelDims rules (July 2025, commit
6204cdff9) as that code applies them, and computes each rank's groups by reshaping
``torch.arange(world_size)``. It shares no code with ``titan_dims.MeshLayout``'s stride
arithmetic, so agreement between the two (and torch's real DeviceMesh) means something.
"""

from __future__ import annotations

import math

import pytest
import torch


def reference_groups(
    world_size: int,
    *,
    dp_shard: int,
    dp_replicate: int = 1,
    cp: int = 1,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
) -> dict[str, torch.Tensor]:
    """name -> every group of that mesh dimension / flattened sub-mesh, as torchtitan builds
    them: a (number of groups, group size) tensor. ``dp_shard`` must be resolved (no -1)."""
    if ep > 1:
        candidates = [
            ("pp", pp),
            ("dp_replicate", dp_replicate),
            ("dp_shard_mod_ep", dp_shard * cp // ep),
            ("dp_shard_in_ep", ep // cp),
            ("cp", cp),
            ("tp", tp),
        ]
        names = [n for n, d in candidates if d > 1 or n == "dp_shard_mod_ep"]
        dp, shard_cp, dp_cp_, ep_dims = [], [], [], []
        if dp_replicate > 1:
            dp.append("dp_replicate")
            dp_cp_.append("dp_replicate")
        dp.append("dp_shard_mod_ep")
        shard_cp.append("dp_shard_mod_ep")
        dp_cp_.append("dp_shard_mod_ep")
        if "dp_shard_in_ep" in names:
            for lst in (dp, shard_cp, dp_cp_, ep_dims):
                lst.append("dp_shard_in_ep")
        if cp > 1:
            for lst in (shard_cp, dp_cp_, ep_dims):
                lst.append("cp")
        flattened = {"dp": dp, "dp_shard_cp": shard_cp, "dp_cp": dp_cp_, "ep": ep_dims}
    else:
        candidates = [
            ("pp", pp),
            ("dp_replicate", dp_replicate),
            ("dp_shard", dp_shard),
            ("cp", cp),
            ("tp", tp),
        ]
        names = [n for n, d in candidates if d > 1]
        dp, shard_cp, dp_cp_ = [], [], []
        if dp_replicate > 1:
            dp.append("dp_replicate")
            dp_cp_.append("dp_replicate")
        if dp_shard > 1:
            for lst in (dp, shard_cp, dp_cp_):
                lst.append("dp_shard")
        if cp > 1:
            for lst in (shard_cp, dp_cp_):
                lst.append("cp")
        flattened = {"dp": dp, "dp_shard_cp": shard_cp, "dp_cp": dp_cp_}
    sizes = dict(candidates)
    shape = [sizes[n] for n in names]
    grid = torch.arange(world_size).view(shape) if shape else torch.arange(1)
    spans = {n: [n] for n in names} | {k: v for k, v in flattened.items() if v}
    groups = {}
    for name, dims in spans.items():
        inner = [names.index(d) for d in dims]
        outer = [i for i in range(len(names)) if i not in inner]
        size = math.prod(sizes[d] for d in dims)
        groups[name] = grid.permute(outer + inner).reshape(-1, size)
    return groups


def group_of(groups: torch.Tensor, rank: int) -> list[int]:
    """The group (row of ``groups``) that holds ``rank``."""
    (row,) = (groups == rank).any(dim=1).nonzero().flatten().tolist()
    return groups[row].tolist()


@pytest.fixture
def reference():
    """The torchtitan-layout oracle: ``reference(world_size, dp_replicate, ...)``."""
    return reference_groups


@pytest.fixture
def group_containing():
    return group_of


def valid_layouts(world_size: int) -> list[dict[str, int]]:
    """Every (dp_replicate, dp_shard, cp, tp, pp, ep) whose product is ``world_size``, with
    every ep that torchtitan accepts (cp | ep | dp_shard * cp)."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    layouts = []
    for pp in divisors:
        for tp in divisors:
            for cp in divisors:
                for dp_replicate in divisors:
                    others = pp * tp * cp * dp_replicate
                    if world_size % others:
                        continue
                    dp_shard = world_size // others
                    eps = [1] + [
                        e
                        for e in range(2, dp_shard * cp + 1)
                        if e % cp == 0 and (dp_shard * cp) % e == 0
                    ]
                    for ep in eps:
                        layouts.append(
                            dict(
                                dp_replicate=dp_replicate,
                                dp_shard=dp_shard,
                                cp=cp,
                                tp=tp,
                                pp=pp,
                                ep=ep,
                            )
                        )
    return layouts


@pytest.fixture
def layouts_of():
    """``layouts_of(world_size)``: every valid layout of that world size."""
    return valid_layouts
