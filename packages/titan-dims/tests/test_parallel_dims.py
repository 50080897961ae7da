"""ParallelDims: every validation rule (with its message), the properties, and the layout.

Expected values are torchtitan's ParallelDims semantics (July 2025) as documented there.
"""

import itertools
import re

import pytest

from titan_dims import ParallelDims, ParallelDimsError, ParallelismConfig, suggest_degrees


# ------------------------------------------------------------------------ validation rules
@pytest.mark.parametrize("name", ["dp_replicate", "cp", "tp", "pp", "ep"])
@pytest.mark.parametrize("value", [0, -1, -4])
def test_degrees_below_one_are_refused(name, value):
    with pytest.raises(
        ParallelDimsError, match=rf"^{name}={value} is not allowed; it must be a whole number >= 1"
    ):
        ParallelDims(world_size=8, **{name: value})


@pytest.mark.parametrize("value", [0, -2])
def test_dp_shard_allows_only_minus_one_below_one(value):
    with pytest.raises(
        ParallelDimsError,
        match=rf"dp_shard={value} is not allowed; it must be -1 \(use the remaining ranks\)",
    ):
        ParallelDims(world_size=8, dp_shard=value)


@pytest.mark.parametrize("value", [2.0, "2", True, None])
def test_degrees_must_be_whole_numbers(value):
    with pytest.raises(ParallelDimsError, match=r"tp=.* is not allowed; it must be a whole number"):
        ParallelDims(world_size=8, tp=value)


@pytest.mark.parametrize("value", [0, -8])
def test_world_size_must_be_positive(value):
    with pytest.raises(ParallelDimsError, match=rf"world_size={value} is not allowed"):
        ParallelDims(world_size=value)


def test_inferred_dp_shard_needs_a_divisor():
    with pytest.raises(ParallelDimsError) as error:
        ParallelDims(world_size=8, tp=3)
    assert str(error.value) == (
        "Cannot infer dp_shard: dp_replicate(1) * cp(1) * tp(3) * pp(1) = 3 does not divide "
        "world_size(8). A valid layout for world_size=8: dp_shard=4, tp=2."
    )


def test_inferred_dp_shard_cannot_be_zero():
    with pytest.raises(ParallelDimsError, match=r"= 16 does not divide world_size\(8\)"):
        ParallelDims(world_size=8, tp=4, pp=4)


def test_product_must_equal_world_size():
    with pytest.raises(ParallelDimsError) as error:
        ParallelDims(world_size=8, dp_shard=3, tp=2)
    assert str(error.value) == (
        "dp_replicate(1) * dp_shard(3) * cp(1) * tp(2) * pp(1) = 6, but world_size is 8. "
        "A valid layout for world_size=8: dp_shard=4, tp=2."
    )


def test_ep_must_be_a_multiple_of_cp():
    with pytest.raises(ParallelDimsError) as error:
        ParallelDims(world_size=16, cp=4, ep=2)
    assert str(error.value).startswith(
        "ep(2) must be a multiple of cp(4): expert parallelism borrows every context-parallel rank."
    )
    assert str(error.value).endswith("dp_shard=4, cp=4, ep=4.")


def test_ep_must_divide_dp_shard_times_cp():
    with pytest.raises(ParallelDimsError) as error:
        ParallelDims(world_size=16, tp=2, ep=16)
    assert str(error.value) == (
        "ep(16) must divide dp_shard(8) * cp(1) = 8: expert parallelism borrows its ranks from "
        "them. A valid layout for world_size=16: dp_shard=8, tp=2, ep=8."
    )


@pytest.mark.parametrize("world_size", [1, 6, 8, 12, 24, 64])
def test_every_suggestion_is_itself_valid(world_size):
    # Whatever nonsense is asked for, the suggestion in the message must construct.
    for pp, tp, cp, rep, ep in itertools.product([1, 2, 3, 5, 8], repeat=5):
        suggestion = suggest_degrees(
            world_size, {"pp": pp, "tp": tp, "cp": cp, "dp_replicate": rep, "ep": ep}
        )
        ParallelDims(world_size=world_size, **suggestion)


def test_the_message_suggestion_parses_back_into_a_valid_layout():
    with pytest.raises(ParallelDimsError) as error:
        ParallelDims(world_size=96, tp=5, pp=7, cp=3, ep=5)
    text = str(error.value).split("A valid layout for world_size=96: ")[1].rstrip(".")
    degrees = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}
    assert ParallelDims(world_size=96, **degrees).world_size == 96


# ----------------------------------------------------------------------------- properties
def test_dp_shard_minus_one_takes_the_rest():
    dims = ParallelDims(world_size=64, dp_replicate=2, cp=2, tp=4)
    assert dims.dp_shard == 4
    assert ParallelDims(world_size=8).dp_shard == 8


@pytest.mark.parametrize(
    ("degrees", "enabled"),
    [
        (dict(world_size=1), set()),
        (dict(world_size=8), {"dp", "dp_shard", "dp_cp", "fsdp"}),
        (dict(world_size=8, dp_shard=1, dp_replicate=8), {"dp", "dp_replicate", "dp_cp"}),
        (dict(world_size=8, dp_shard=1, cp=8), {"cp", "dp_cp", "fsdp"}),
        (dict(world_size=8, dp_shard=1, tp=8), {"tp"}),
        (dict(world_size=8, dp_shard=1, pp=8), {"pp"}),
        (dict(world_size=8, ep=4), {"dp", "dp_shard", "dp_cp", "fsdp", "ep"}),
    ],
)
def test_enabled_flags(degrees, enabled):
    dims = ParallelDims(**degrees)
    flags = {"dp", "dp_replicate", "dp_shard", "cp", "dp_cp", "fsdp", "tp", "pp", "ep"}
    assert {f for f in flags if getattr(dims, f"{f}_enabled")} == enabled


def test_derived_sizes():
    dims = ParallelDims(world_size=128, dp_replicate=2, cp=2, tp=4, pp=2)
    assert dims.dp_shard == 4
    assert dims.non_data_parallel_size == 2 * 4 * 2
    assert dims.seq_len_divisor == 4 * 2 * 2
    assert dims.dense_params_mesh_ndim == 3
    assert dims.fsdp_gradient_divide_factor == 2 * 4 * 2
    assert dims.dp_degree == 8
    assert ParallelDims(world_size=4, dp_shard=1, tp=4).dense_params_mesh_ndim == 1
    assert ParallelDims(world_size=1).seq_len_divisor == 2


def test_dp_rank_is_the_data_shard_of_each_rank():
    dims = ParallelDims(world_size=16, dp_replicate=2, dp_shard=2, tp=4)
    # Ranks are (dp_replicate, dp_shard, tp) row-major; the data shard ignores tp.
    assert [dims.dp_rank(r) for r in range(16)] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert ParallelDims(world_size=4, dp_shard=1, tp=4).dp_rank(3) == 0
    with pytest.raises(ValueError, match="valid: 0 to 3"):
        ParallelDims(world_size=4, dp_shard=1, tp=4).dp_rank(4)


def test_dp_rank_without_rank_or_process_group_says_what_to_pass():
    with pytest.raises(ParallelDimsError, match="pass rank= explicitly"):
        ParallelDims(world_size=4).dp_rank()


def test_layout_dims_follow_torchtitan_order_and_omit_degree_one():
    assert ParallelDims(world_size=64, dp_replicate=2, cp=2, tp=2, pp=2).layout.dim_names == (
        "pp",
        "dp_replicate",
        "dp_shard",
        "cp",
        "tp",
    )
    assert ParallelDims(world_size=8, dp_shard=1, tp=8).layout.dim_names == ("tp",)
    assert ParallelDims(world_size=1).layout.dim_names == ()


def test_ep_layout_keeps_dp_shard_mod_ep_even_at_one():
    layout = ParallelDims(world_size=8, ep=8).layout
    assert layout.dim_names == ("dp_shard_mod_ep", "dp_shard_in_ep")
    assert layout.dim_sizes == (1, 8)
    assert layout.flattened == {
        "dp": ("dp_shard_mod_ep", "dp_shard_in_ep"),
        "dp_shard_cp": ("dp_shard_mod_ep", "dp_shard_in_ep"),
        "dp_cp": ("dp_shard_mod_ep", "dp_shard_in_ep"),
        "ep": ("dp_shard_in_ep",),
    }


def test_construction_touches_no_process_group():
    dims = ParallelDims(world_size=131072, tp=8, pp=16)
    assert dims._meshes == {}
    with pytest.raises(ParallelDimsError, match="needs an initialized process group"):
        _ = dims.world_mesh


def test_is_immutable_and_comparable():
    dims = ParallelDims(world_size=8, tp=2)
    with pytest.raises(AttributeError):
        dims.tp = 4
    assert dims == ParallelDims(world_size=8, dp_shard=4, tp=2)
    assert str(dims) == "ParallelDims(world_size=8: dp_shard=4, tp=2)"


# --------------------------------------------------------------------------------- config
def test_from_config_uses_torchtitan_key_names():
    config = ParallelismConfig(
        data_parallel_replicate_degree=2,
        tensor_parallel_degree=2,
        pipeline_parallel_degree=2,
        expert_parallel_degree=2,
    )
    dims = ParallelDims.from_config(config, world_size=16)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.ep) == (2, 2, 2, 2, 2)


def test_default_config_shards_over_everything():
    assert ParallelDims.from_config(ParallelismConfig(), world_size=8).dp_shard == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(tensor_parallel_degree=0),
            "parallelism.tensor_parallel_degree=0 is not allowed; it must be a whole number >= 1",
        ),
        (
            dict(data_parallel_shard_degree=-3),
            r"parallelism.data_parallel_shard_degree=-3 is not allowed; it must be -1",
        ),
        (
            dict(pipeline_parallel_degree=1.5),
            "parallelism.pipeline_parallel_degree=1.5 is not allowed; it must be a whole",
        ),
    ],
)
def test_config_validation_names_the_key(kwargs, message):
    with pytest.raises(ParallelDimsError, match=message):
        ParallelismConfig(**kwargs)
