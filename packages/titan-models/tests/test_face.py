"""The public face: the top level holds only what every family shares; each family's names
come from its own module, and the names the top level used to export still import from it,
with a warning naming the new place, for one release."""

from __future__ import annotations

import importlib

import pytest

import titan_models

FAMILIES = ("llama3", "qwen3", "deepseek_v3")


def test_the_top_level_holds_only_what_the_families_share() -> None:
    family_names = {
        n for f in FAMILIES for n in importlib.import_module(f"titan_models.{f}").__all__
    }
    assert not set(titan_models.__all__) & family_names
    assert {"ModelSpec", "ParallelizeConfig", "step_context", "reduce_loss"} <= set(
        titan_models.__all__
    )
    assert len(titan_models.__all__) <= 16
    for name in titan_models.__all__:
        getattr(titan_models, name)


@pytest.mark.parametrize("name", sorted(titan_models._MOVED_TO))
def test_a_moved_name_still_imports_from_the_top_with_a_warning(name: str) -> None:
    module = importlib.import_module(f"titan_models.{titan_models._MOVED_TO[name]}")
    with pytest.warns(DeprecationWarning, match=f"moved to {module.__name__}.{name}"):
        old = getattr(titan_models, name)
    assert old is getattr(module, name)
    assert name in module.__all__


def test_a_family_is_one_attribute_away_after_a_bare_import() -> None:
    import subprocess
    import sys

    code = (
        "import titan_models; print(titan_models.qwen3.QWEN3.name, titan_models.llama3.LLAMA3.name)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["qwen3", "llama3"]
