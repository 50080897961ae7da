"""The wheel checks catch a missing py.typed, LICENSE or entry point, and tests in a wheel."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from artifacts import _sdist_problems, _wheel_problems, build, dists, publish_folder
from common import packages


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """titan-dims built once, as `release.py build titan-dims` does."""
    out = tmp_path_factory.mktemp("dist")
    dims = packages()[0]
    build([dims], out)
    return dims, out


def _rewrite(wheel: Path, target: Path, drop: str | None = None, add: str | None = None) -> Path:
    """A copy of ``wheel`` without the member ``drop`` and with an extra file ``add``."""
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w") as dst:
        for item in src.infolist():
            if item.filename != drop:
                dst.writestr(item, src.read(item))
        if add:
            dst.writestr(add, "def test_x():\n    pass\n")
    return target


def test_a_built_package_passes(built) -> None:
    dims, out = built
    wheel, sdist = dists(dims, out)
    assert _wheel_problems(dims, wheel) == []
    assert _sdist_problems(dims, sdist) == []


@pytest.mark.parametrize(
    ("drop", "add", "problem"),
    [
        ("titan_dims/py.typed", None, "no titan_dims/py.typed marker"),
        ("titan_dims-0.1.0.dist-info/licenses/LICENSE", None, "no LICENSE"),
        ("titan_dims-0.1.0.dist-info/entry_points.txt", None, "no entry_points.txt"),
        (None, "titan_dims/tests/test_x.py", "tests in the wheel"),
    ],
)
def test_a_broken_wheel_is_named(built, tmp_path, drop, add, problem) -> None:
    dims, out = built
    wheel = dists(dims, out)[0]
    bad = _rewrite(wheel, tmp_path / wheel.name, drop=drop, add=add)
    assert any(problem in p for p in _wheel_problems(dims, bad)), _wheel_problems(dims, bad)


def test_publishing_twice_never_replaces_a_file(built, tmp_path) -> None:
    dims, out = built
    index = tmp_path / "index"
    publish_folder([dims], out, index)
    page = (index / "titan-dims" / "index.html").read_text()
    assert "titan_dims-0.1.0-py3-none-any.whl#sha256=" in page
    assert '<a href="titan-dims/">' in (index / "index.html").read_text()
    publish_folder([dims], out, index)  # the same files again: fine
    wheel = index / "titan-dims" / dists(dims, out)[0].name
    wheel.write_bytes(b"something else")
    with pytest.raises(SystemExit, match="never republish"):
        publish_folder([dims], out, index)
