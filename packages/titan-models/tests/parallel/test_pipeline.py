"""Pipeline splitting and stage placement (no process group needed); errors for splits that
cannot work. Training through real schedules is in llama3/test_parallelize.py."""

from __future__ import annotations

import pytest

from titan_models import ModelConfigError, PipelineConfig
from titan_models.parallel import split_blocks, stages_of_rank


def test_default_split_is_even_one_stage_per_rank():
    assert split_blocks(8, 2, PipelineConfig(schedule="1F1B")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_blocks(5, 2, PipelineConfig(schedule="GPipe")) == [[0, 1, 2], [3, 4]]


def test_multi_stage_schedules_default_to_two_stages_per_rank():
    stages = split_blocks(8, 2, PipelineConfig(schedule="Interleaved1F1B"))
    assert stages == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_explicit_split_points_and_layers_per_stage():
    config = PipelineConfig(schedule="GPipe", split_points=["layers.1"])
    assert split_blocks(4, 2, config) == [[0], [1, 2, 3]]
    config = PipelineConfig(schedule="InterleavedZeroBubble", layers_per_stage=1)
    assert split_blocks(4, 2, config) == [[0], [1], [2], [3]]


def test_looped_and_v_placement():
    assert stages_of_rank(1, 2, 4, v_shape=False) == [1, 3]
    assert stages_of_rank(0, 2, 4, v_shape=True) == [0, 3]
    assert stages_of_rank(1, 2, 4, v_shape=True) == [1, 2]


@pytest.mark.parametrize(
    ("n_layers", "config", "match"),
    [
        (2, PipelineConfig(schedule="Interleaved1F1B"), "4 pipeline stages need at least"),
        (4, PipelineConfig(schedule="1F1B", layers_per_stage=1), "runs one stage per rank"),
        (4, PipelineConfig(schedule="ZBVZeroBubble", layers_per_stage=2), "exactly two stages"),
        (6, PipelineConfig(schedule="GPipe", layers_per_stage=4), "does not divide"),
        (4, PipelineConfig(schedule="GPipe", split_points=["layers.4"]), "increasing blocks"),
        (6, PipelineConfig(schedule="CSV", schedule_csv="x.csv", layers_per_stage=2), "evenly"),
    ],
)
def test_impossible_splits(n_layers, config, match):
    with pytest.raises(ModelConfigError, match=match):
        split_blocks(n_layers, 2, config)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "Looped"}, "pipeline.schedule='Looped'"),
        ({"schedule": "CSV"}, "schedule_csv must be given"),
        ({"microbatch_size": 0}, "microbatch_size=0"),
        ({"layers_per_stage": 2, "split_points": ["layers.2"]}, "not both"),
        ({"split_points": ["4"]}, "like 'layers.4'"),
    ],
)
def test_bad_pipeline_settings(kwargs, match):
    with pytest.raises(ModelConfigError, match=match):
        PipelineConfig(**kwargs)
