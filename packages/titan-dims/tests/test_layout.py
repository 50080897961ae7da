"""MeshLayout arithmetic, checked against the reshape-of-arange oracle in conftest.py."""

import pytest

from titan_dims import MeshLayout, ParallelDims


def test_coordinates_are_row_major():
    layout = MeshLayout(dim_names=("a", "b", "c"), dim_sizes=(2, 3, 4))
    assert layout.world_size == 24
    assert layout.coordinates(0) == {"a": 0, "b": 0, "c": 0}
    assert layout.coordinates(23) == {"a": 1, "b": 2, "c": 3}
    assert layout.coordinates(13) == {"a": 1, "b": 0, "c": 1}


def test_groups_and_local_ranks_of_a_flattened_mesh():
    layout = MeshLayout(
        dim_names=("a", "b", "c"), dim_sizes=(2, 3, 4), flattened={"ac": ("a", "c")}
    )
    assert layout.size("ac") == 8
    assert layout.group("ac", 5) == [4, 5, 6, 7, 16, 17, 18, 19]
    assert [layout.local_rank("ac", r) for r in layout.group("ac", 5)] == list(range(8))
    assert layout.group("b", 5) == [1, 5, 9]


@pytest.mark.parametrize("world_size", [1, 2, 4, 6, 8, 12, 16])
def test_every_layout_matches_the_torchtitan_oracle(world_size, layouts_of, reference):
    for degrees in layouts_of(world_size):
        layout = ParallelDims(world_size=world_size, **degrees).layout
        expected = reference(world_size, **degrees)
        assert set(layout.names) == set(expected), degrees
        for name, groups in expected.items():
            for group in groups.tolist():
                for rank in group:
                    assert layout.group(name, rank) == group, (degrees, name, rank)
                    assert layout.local_rank(name, rank) == group.index(rank)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dim_names=("a",), dim_sizes=(2, 2)), "one size per dimension"),
        (dict(dim_names=("a", "a"), dim_sizes=(2, 2)), "must be unique"),
        (dict(dim_names=("a",), dim_sizes=(2,), flattened={"a": ("a",)}), "reuses"),
        (dict(dim_names=("a",), dim_sizes=(2,), flattened={"f": ("z",)}), "not all dimensions"),
        (
            dict(dim_names=("a", "b"), dim_sizes=(2, 2), flattened={"f": ("b", "a")}),
            "in mesh order",
        ),
    ],
)
def test_malformed_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MeshLayout(**kwargs)


def test_unknown_names_and_ranks_are_refused():
    layout = MeshLayout(dim_names=("tp",), dim_sizes=(4,))
    with pytest.raises(KeyError, match="known names: tp"):
        layout.group("dp", 0)
    with pytest.raises(ValueError, match="valid: 0 to 3"):
        layout.coordinates(4)
