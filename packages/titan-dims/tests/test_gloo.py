"""Real process groups: 4 and 8 gloo processes under torchrun build every valid layout of
their world size; each rank's named groups, and the ranks an all-reduce over each group
actually sums, must equal the torchtitan-layout oracle in conftest.py."""

import json
from pathlib import Path

import pytest

from titan_dims.testing import run_torchrun

WORKER = Path(__file__).parent / "workers" / "mesh_groups.py"

LAYOUTS_OF_8 = [
    dict(dp_replicate=r, dp_shard=s, cp=c, tp=t, pp=p, ep=e)
    for r, s, c, t, p, e in [
        (1, 8, 1, 1, 1, 1),
        (8, 1, 1, 1, 1, 1),
        (1, 1, 8, 1, 1, 1),
        (1, 1, 1, 8, 1, 1),
        (1, 1, 1, 1, 8, 1),
        (2, 2, 1, 2, 1, 1),
        (1, 2, 2, 1, 2, 1),
        (2, 1, 2, 2, 1, 1),
        (2, 2, 1, 1, 2, 1),
        (1, 4, 2, 1, 1, 8),
        (1, 8, 1, 1, 1, 4),
        (2, 2, 2, 1, 1, 2),
        (1, 2, 2, 2, 1, 4),
        (1, 4, 1, 1, 2, 2),
    ]
]


@pytest.mark.parametrize("world_size", [4, 8])
def test_named_groups_and_all_reduce_on_gloo(
    world_size, tmp_path, layouts_of, reference, group_containing
):
    layouts = layouts_of(world_size)
    if world_size == 8:
        # All 71 layouts of 8 pass (checked by hand), but gloo groups pile up and the run
        # takes minutes on 2 cores; keep one layout for each mix of dimensions, EP included.
        layouts = [d for d in layouts if d in LAYOUTS_OF_8]
        assert len(layouts) == len(LAYOUTS_OF_8)
    spec = tmp_path / "layouts.json"
    spec.write_text(json.dumps(layouts))
    run_torchrun(WORKER, world_size, [str(spec), str(tmp_path)], timeout=240)

    checked = 0
    for rank in range(world_size):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [entry["degrees"] for entry in report] == layouts
        for entry in report:
            expected = reference(world_size, **entry["degrees"])
            assert set(entry["groups"]) == set(expected), entry["degrees"]
            for name, ranks in entry["groups"].items():
                want = group_containing(expected[name], rank)
                context = (entry["degrees"], name, rank)
                assert ranks == want, context
                assert entry["members"][name] == sorted(want), context
                assert entry["rank_sum"][name] == sum(want), context
                assert entry["local"][name] == want.index(rank), context
                checked += 1
            assert entry["dp_rank"] == entry["local"].get("dp", 0)
    assert checked > 0
