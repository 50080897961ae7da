"""The ``Optimizers`` protocol: every container has its methods with the same signatures, so
a trainer holds any of them the same way."""

from __future__ import annotations

import inspect

import pytest

from titan_optim import (
    FTOptimizersContainer,
    Optimizers,
    OptimizersContainer,
    OptimizersInBackwardContainer,
)

METHODS = ("step", "zero_grad", "clip_grad_norm_", "state_dict", "load_state_dict")


@pytest.mark.parametrize(
    "container", [OptimizersContainer, OptimizersInBackwardContainer, FTOptimizersContainer]
)
def test_every_container_has_the_protocols_signatures(container):
    for name in METHODS:
        assert inspect.signature(getattr(container, name)) == inspect.signature(
            getattr(Optimizers, name)
        ), f"{container.__name__}.{name}"
    assert isinstance(container.param_groups, property)
