"""Which mixed-version installs the rehearsal runs, and how it finds the last releases."""

from __future__ import annotations

import subprocess

from common import packages
from matrix import last_release, mixes
from packaging.version import Version

DIMS_ABOUT = "packages/titan-dims/src/titan_dims/__about__.py"


def test_last_release_of_a_lower_package_mixes_with_the_tree(tree, edit) -> None:
    edit(tree / DIMS_ABOUT, '"0.1.0"', '"0.1.1"')
    found = set(mixes(packages(tree), {"titan-dims": Version("0.1.0")}, {}))
    assert found == {
        ("titan-models", Version("0.1.0"), "titan-dims", Version("0.1.0")),
        ("titan-train", Version("0.1.0"), "titan-dims", Version("0.1.0")),
    }


def test_a_release_outside_the_range_is_not_mixed(tree) -> None:
    assert list(mixes(packages(tree), {"titan-dims": Version("0.0.9")}, {})) == []


def test_last_release_of_a_higher_package_mixes_where_its_old_range_admits(tree, edit) -> None:
    edit(tree / DIMS_ABOUT, '"0.1.0"', '"0.2.0"')
    edit(tree / "packages/titan-models/src/titan_models/__about__.py", '"0.1.0"', '"0.1.1"')
    previous = {"titan-models": Version("0.1.0")}
    # titan-train from the tree takes titan-models 0.1.0 either way (its range is 0.1.x)
    train_mix = ("titan-train", Version("0.1.0"), "titan-models", Version("0.1.0"))
    old = {"titan-models": ["torch>=2.7", "titan-dims>=0.1,<0.2"]}
    assert list(mixes(packages(tree), previous, old)) == [train_mix]
    old = {"titan-models": ["torch>=2.7", "titan-dims>=0.1,<0.3"]}
    assert list(mixes(packages(tree), previous, old)) == [
        ("titan-models", Version("0.1.0"), "titan-dims", Version("0.2.0")),
        train_mix,
    ]


def test_last_release_reads_the_tags(tree, edit) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True)

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x")
    dims = packages(tree)[0]
    assert last_release(dims, tree) is None
    for tag in ("titan-dims-v0.0.9", "titan-dims-v0.1.0", "titan-dims-vbad", "titan-ckpt-v0.0.5"):
        git("tag", tag)
    # 0.1.0 is the tree's own version (being released), so the last one is 0.0.9
    assert last_release(dims, tree) == Version("0.0.9")
    assert last_release(packages(tree)[1], tree) == Version("0.0.5")
    edit(tree / DIMS_ABOUT, '"0.1.0"', '"0.1.1"')
    assert last_release(packages(tree)[0], tree) == Version("0.1.0")


def test_tagging_a_released_version(tree, capsys) -> None:
    from tagging import tag

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True)

    ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
    git("init", "-q")
    git("add", "-A")
    git(*ident, "commit", "-q", "-m", "x")
    dims = packages(tree)[:1]
    git("tag", "titan-dims-v0.1.0")
    git(*ident, "commit", "-q", "--allow-empty", "-m", "y")
    assert tag(dims, tree, dry_run=False) == 0  # released, nothing changed: nothing to do
    assert "released, unchanged since" in capsys.readouterr().out
    readme = tree / "packages/titan-dims/README.md"
    readme.write_text(readme.read_text() + "\nmore\n")
    git(*ident, "commit", "-q", "-am", "z")
    assert tag(dims, tree, dry_run=True) == 0  # the rehearsal notes it
    assert "changed since titan-dims-v0.1.0 (released): bump its version" in capsys.readouterr().out
    assert tag(dims, tree, dry_run=False) == 1  # a real release refuses
