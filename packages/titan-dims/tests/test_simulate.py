"""Real DeviceMeshes built by torch on a fake process group, up to 131,072 ranks.

Each mesh's rank groups, as torch reports them, are compared with the torchtitan-layout
oracle in conftest.py.
"""

import warnings

import pytest
import torch.distributed as dist

from titan_dims import ParallelDims, ParallelDimsError, fake_process_group, simulate


def _torch_groups(dims: ParallelDims) -> dict[str, list[int]]:
    return {n: dims.get_mesh(n).mesh.flatten().tolist() for n in dims.layout.names}


@pytest.mark.parametrize("world_size", [4, 8, 16])
def test_every_small_layout_matches_the_oracle(world_size, layouts_of, reference, group_containing):
    for degrees in layouts_of(world_size):
        expected = reference(world_size, **degrees)
        for rank in (0, world_size // 2 + 1, world_size - 1):
            with simulate(ParallelDims(world_size=world_size, **degrees), rank=rank) as dims:
                got = _torch_groups(dims)
            assert set(got) == set(expected), degrees
            for name, ranks in got.items():
                assert ranks == group_containing(expected[name], rank), (degrees, name, rank)


@pytest.mark.parametrize(
    "degrees",
    [
        dict(dp_replicate=4, tp=8, pp=16),  # dp_shard = 256
        dict(dp_replicate=2, cp=4, tp=8, pp=4, ep=32),  # EP borrows dp_shard x cp
        dict(cp=8, tp=8, pp=8),
    ],
)
@pytest.mark.parametrize("rank", [0, 77_777, 131_071])
def test_131072_rank_layouts_match_the_oracle(degrees, rank, reference, group_containing):
    world_size = 131_072
    dims = ParallelDims(world_size=world_size, **degrees)
    expected = reference(world_size, **{**degrees, "dp_shard": dims.dp_shard})
    with simulate(dims, rank=rank) as simulated:
        got = _torch_groups(simulated)
        assert simulated.world_mesh.size() == world_size
    assert set(got) == set(expected)
    for name, ranks in got.items():
        assert ranks == group_containing(expected[name], rank), (name, rank)
        assert ranks == dims.layout.group(name, rank)


def test_hsdp_two_dimensional_mesh_reuses_the_flattened_groups():
    dims = ParallelDims(world_size=16, dp_replicate=2, cp=2)
    with simulate(dims, rank=5) as simulated:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no deprecation noise reaches the user
            hsdp = simulated.get_mesh(("dp_replicate", "dp_shard_cp"))
        assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
        assert hsdp.mesh.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
        assert hsdp["dp_shard_cp"].get_group() is simulated.get_mesh("dp_shard_cp").get_group()


def test_missing_meshes_are_explained():
    with simulate(ParallelDims(world_size=8, dp_shard=1, tp=8)) as dims:
        with pytest.raises(
            ParallelDimsError, match="no 'dp_cp' mesh because dp_replicate, dp_shard"
        ):
            dims.get_mesh("dp_cp")
        with pytest.raises(
            ParallelDimsError, match=r"no 'pp' mesh because pp is 1.*Meshes here: tp"
        ):
            dims.get_mesh("pp")
        with pytest.raises(ParallelDimsError, match="Unknown mesh name 'batch'"):
            dims.get_mesh("batch")


def test_one_rank_world_has_an_empty_mesh():
    with simulate(ParallelDims(world_size=1)) as dims:
        assert dims.world_mesh.ndim == 0
        assert dims.layout.names == ()


def test_world_size_mismatch_is_refused():
    with (
        fake_process_group(world_size=8),
        pytest.raises(
            ParallelDimsError, match="made for world_size=4, but the process group has 8"
        ),
    ):
        _ = ParallelDims(world_size=4, device_type="cpu").world_mesh
    assert not dist.is_initialized()


def test_simulation_leaves_no_process_group_behind_and_refuses_nesting():
    with simulate(ParallelDims(world_size=8)):
        assert dist.get_world_size() == 8
        with (
            pytest.raises(RuntimeError, match="already initialized"),
            fake_process_group(world_size=2),
        ):
            pass
    assert not dist.is_initialized()
    with (
        pytest.raises(ParallelDimsError, match="rank 8 is outside a world of 8"),
        simulate(ParallelDims(world_size=8), rank=8),
    ):
        pass


def test_the_original_object_stays_unbuilt():
    dims = ParallelDims(world_size=8, tp=2)
    with simulate(dims) as simulated:
        assert simulated.device_type == "cpu"
        assert simulated.world_mesh is not None
    assert dims._meshes == {}
