"""The dataloader resharding guard compares data-parallel degrees, not world sizes.

Two ranks that share one data stream (data-parallel degree 1, as under tensor parallel)
write a step; one process (degree 1) must then load its dataloader, even one that does not
declare ``supports_resharding``, while a step written at degree 2 is refused for it. The
degree is the dataloader's own ``dp_degree`` (default: the world size).
"""

from __future__ import annotations

import json

import pytest

from titan_ckpt import CheckpointConfig, CheckpointConfigError, CheckpointManager
from titan_ckpt.layout import COMMIT_MARKER


def load(common, folder, data, **kwargs) -> CheckpointManager:
    config = CheckpointConfig(enable=True, folder=str(folder))
    manager = CheckpointManager(
        config, model_parts=common.make_model(seed=3), states={"dataloader": data}, **kwargs
    )
    manager.load()
    return manager


@pytest.mark.slow
def test_guard_keys_on_the_data_parallel_degree(common, torchrun, tmp_path):
    proc = torchrun("save_dp.py", 2, str(tmp_path), str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for degree in (1, 2):
        marker = json.loads((tmp_path / f"dp{degree}" / "step-1" / COMMIT_MARKER).read_text())
        assert marker["world_size"] == 2
        assert marker["data_parallel_degree"] == degree

    # World 2 at degree 1 -> world 1 (degree 1 by default): the dataloader loads.
    data = common.DataPosition(supports_resharding=False)
    load(common, tmp_path / "dp1", data)
    assert data.position == 7

    # Degree 2 -> degree 1 is a resharding this dataloader cannot do: refused, by name.
    with pytest.raises(CheckpointConfigError, match="data-parallel degree 2, this run has 1"):
        load(common, tmp_path / "dp2", common.DataPosition(supports_resharding=False))
    # ... unless the dataloader says it is at degree 2 too (e.g. world 4 with TP 2).
    data = common.DataPosition(supports_resharding=False, dp_degree=2)
    load(common, tmp_path / "dp2", data)
    assert data.position == 7


def test_the_degree_is_the_dataloaders_own(common, tmp_path):
    """The degree recorded with a step is the dataloader's ``dp_degree`` (a trainer's loader
    knows how many ways it shards the data), not a constructor argument; without one, the
    world size."""
    config = CheckpointConfig(enable=True, folder=str(tmp_path / "own"), interval=1)
    data = common.DataPosition(supports_resharding=False, dp_degree=4)
    with CheckpointManager(
        config, model_parts=common.make_model(), states={"dataloader": data}
    ) as manager:
        manager.save(1)
    marker = json.loads((tmp_path / "own" / "step-1" / COMMIT_MARKER).read_text())
    assert (marker["world_size"], marker["data_parallel_degree"]) == (1, 4)
    # Resumed by a loader of another degree that cannot reshard: refused, naming both.
    with pytest.raises(CheckpointConfigError, match="data-parallel degree 4, this run has 1"):
        load(common, tmp_path / "own", common.DataPosition(supports_resharding=False))
    with pytest.raises(TypeError, match="data_parallel_degree"):
        CheckpointManager(config, model_parts=common.make_model(), data_parallel_degree=2)


def test_markers_without_the_degree_fall_back_to_the_world_size(common, tmp_path):
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=1)
    data = common.DataPosition(supports_resharding=False)
    with CheckpointManager(
        config, model_parts=common.make_model(), states={"dataloader": data}
    ) as manager:
        manager.save(1)
    marker_path = tmp_path / "step-1" / COMMIT_MARKER
    marker = json.loads(marker_path.read_text())
    assert marker["data_parallel_degree"] == 1
    del marker["data_parallel_degree"]  # as an older titan-ckpt wrote it
    marker["world_size"] = 2
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(CheckpointConfigError, match="data-parallel degree 2, this run has 1"):
        load(common, tmp_path, common.DataPosition(supports_resharding=False))
