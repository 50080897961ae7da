"""The API guard catches breaking changes in a scratch copy of the tree and lets additions pass."""

from __future__ import annotations

from pathlib import Path

import api
import pytest

DIMS = "packages/titan-dims/src/titan_dims"
SUGGEST = "def suggest_degrees(world_size: int, wanted: dict[str, int]) -> dict[str, int]:"


@pytest.fixture
def snapshots(tree: Path, tmp_path: Path) -> Path:
    """Snapshots of the unchanged copy, as `hatch run api-snapshot` stores them."""
    folder = tmp_path / "snapshots"
    api.write_snapshots(tree, folder)
    return folder


def run_check(tree: Path, snapshots: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = api.check(tree, snapshots)
    return code, capsys.readouterr().out


def test_the_stored_snapshots_match_this_tree(capsys: pytest.CaptureFixture[str]) -> None:
    # What CI runs: the committed snapshots against the committed tree.
    assert api.check(api.ROOT, api.SNAPSHOTS) == 0, capsys.readouterr().out


def test_unchanged_tree_passes(tree, snapshots, capsys) -> None:
    code, out = run_check(tree, snapshots, capsys)
    assert code == 0
    assert out.count("no breaking change") == 5


def test_removed_name_fails_naming_it(tree, snapshots, capsys, edit) -> None:
    edit(tree / DIMS / "__init__.py", '    "suggest_degrees",\n', "")
    code, out = run_check(tree, snapshots, capsys)
    assert code == 1
    assert "error: titan-dims: breaking: titan_dims.suggest_degrees: removed" in out
    assert "titan-dims 0.1.0 breaks the API of 0.1.0" in out
    assert "0.x: to 0.2.0" in out


def test_changed_signature_fails_naming_it(tree, snapshots, capsys, edit) -> None:
    edit(
        tree / DIMS / "parallel_dims.py",
        SUGGEST,
        "def suggest_degrees(wanted: dict[str, int], *, strict: bool) -> dict[str, int]:",
    )
    code, out = run_check(tree, snapshots, capsys)
    assert code == 1
    assert "parameter 'world_size' removed" in out
    assert "parameter 'wanted' no longer at position 1" in out
    assert "new required parameter 'strict'" in out


def test_changed_default_of_a_config_field_fails(tree, snapshots, capsys, edit) -> None:
    edit(tree / DIMS / "parallel_dims.py", "    cp: int = 1\n", "    cp: int = 2\n")
    code, out = run_check(tree, snapshots, capsys)
    assert code == 1
    assert "titan_dims.ParallelDims: default of 'cp' changed from 1 to 2" in out


def test_compatible_addition_passes(tree, snapshots, capsys, edit) -> None:
    edit(
        tree / DIMS / "parallel_dims.py",
        SUGGEST,
        "def suggest_degrees(\n    world_size: int, wanted: dict[str, int], strict: bool = False\n"
        ") -> dict[str, int]:",
    )
    init = tree / DIMS / "__init__.py"
    edit(init, "__all__ = [\n", '__all__ = [\n    "shiny_new",\n')
    init.write_text(init.read_text() + "\n\ndef shiny_new(x: int = 0) -> int:\n    return x\n")
    code, out = run_check(tree, snapshots, capsys)
    assert code == 0, out
    assert "compatible: titan_dims.shiny_new: added" in out
    assert "compatible: titan_dims.suggest_degrees: signature extended" in out
    assert "refresh with `hatch run api-snapshot`" in out


def test_breaking_change_with_a_minor_bump_passes(tree, snapshots, capsys, edit) -> None:
    edit(tree / DIMS / "__init__.py", '    "suggest_degrees",\n', "")
    edit(tree / DIMS / "__about__.py", '"0.1.0"', '"0.2.0"')
    code, out = run_check(tree, snapshots, capsys)
    assert code == 0, out
    assert "note: titan-dims: breaking: titan_dims.suggest_degrees: removed" in out
    # a patch bump is not enough in 0.x
    edit(tree / DIMS / "__about__.py", '"0.2.0"', '"0.1.1"')
    code, out = run_check(tree, snapshots, capsys)
    assert code == 1


def test_missing_snapshot_fails(tree, tmp_path, capsys) -> None:
    code, out = run_check(tree, tmp_path / "empty", capsys)
    assert code == 1
    assert "no API snapshot" in out


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ([["a", "positional or keyword", "int", None]], [], "parameter 'a' removed"),
        (
            [["a", "positional or keyword", "int", "1"]],
            [["a", "positional or keyword", "int", None]],
            "parameter 'a' is now required",
        ),
        (
            [["a", "positional or keyword", "int", None]],
            [["a", "positional-only", "int", None]],
            "parameter 'a' can no longer be passed by keyword",
        ),
        ([["kw", "variadic keyword", None, None]], [], "no longer accepts **kw"),
    ],
)
def test_parameter_rules(old, new, expected) -> None:
    assert api._compare_params("f", old, new) == [f"f: {expected}"]


def test_a_new_keyword_with_a_default_is_compatible() -> None:
    old = [["a", "positional or keyword", "int", None]]
    new = [*old, ["b", "keyword-only", "int", "0"]]
    assert api._compare_params("f", old, new) == []
