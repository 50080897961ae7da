"""check_versions.py fails with a clear message when versions, ranges and changelogs disagree."""

from __future__ import annotations

import check_versions

MODELS = "packages/titan-models/pyproject.toml"
DIMS_ABOUT = "packages/titan-dims/src/titan_dims/__about__.py"


def test_this_tree_is_consistent() -> None:
    assert check_versions.check(check_versions.ROOT) == []


def test_copy_is_consistent(tree) -> None:
    assert check_versions.check(tree) == []


def test_range_that_does_not_admit_the_sibling_fails(tree, edit) -> None:
    # titan-dims moves to 0.2 (may break) but titan-models still asks for 0.1.x
    edit(tree / DIMS_ABOUT, '"0.1.0"', '"0.2.0"')
    problems = check_versions.check(tree)
    assert any(
        "titan-models/pyproject.toml: requirement 'titan-dims<0.2,>=0.1' does not admit "
        "titan-dims 0.2.0"
        in p
        and "titan-dims>=0.2,<0.3" in p
        for p in problems
    ), problems
    assert sum("does not admit titan-dims 0.2.0" in p for p in problems) == 2  # models, train


def test_missing_or_open_range_fails(tree, edit) -> None:
    edit(tree / MODELS, '"titan-dims>=0.1,<0.2"', '"titan-dims"')
    assert any("has no version range" in p for p in check_versions.check(tree))
    edit(tree / MODELS, '"titan-dims"', '"titan-dims>=0.1"')
    problems = check_versions.check(tree)
    assert any("admits titan-dims 0.2.0, which may break it" in p for p in problems)


def test_changelog_newer_than_version_fails(tree) -> None:
    log = tree / "packages/titan-dims/CHANGELOG.md"
    log.write_text(log.read_text() + "\n## [0.2.0] - 2026-12-01\n\n- x\n")
    problems = check_versions.check(tree)
    assert any("lists release 0.2.0, newer than the package's version 0.1.0" in p for p in problems)


def test_changelog_without_unreleased_or_with_bad_heading_fails(tree, edit) -> None:
    log = tree / "packages/titan-ckpt/CHANGELOG.md"
    edit(log, "## [Unreleased]", "## Unreleased")
    assert any("must be `## [Unreleased]`" in p for p in check_versions.check(tree))
    edit(log, "## Unreleased", "## [Unreleased]\n\n## 0.1.0")
    assert any("is not `## [X.Y.Z] - YYYY-MM-DD`" in p for p in check_versions.check(tree))


def test_cli_exit_codes(tree, capsys) -> None:
    assert check_versions.main(["--root", str(tree)]) == 0
    (tree / "packages/titan-optim/CHANGELOG.md").unlink()
    assert check_versions.main(["--root", str(tree)]) == 1
    assert "titan-optim/CHANGELOG.md: missing" in capsys.readouterr().err


def test_prepare_dates_the_changelog_and_keeps_the_tree_consistent(tree, edit) -> None:
    import datetime

    from common import packages
    from prepare import prepare
    from tagging import blockers

    dims = packages(tree)[0]
    assert any("no `## [0.1.0] - YYYY-MM-DD` heading" in b for b in blockers(dims, tree))
    prepare(dims, dims.version, datetime.date(2026, 12, 24))
    text = dims.changelog.read_text()
    assert "## [Unreleased]\n\n## [0.1.0] - 2026-12-24\n\n### Added\n- `ParallelDims`" in text
    assert "Nothing has been published yet" not in text
    assert check_versions.check(tree) == []
    assert not any("heading" in b for b in blockers(dims, tree))
    # a breaking release of titan-dims: its dependents' ranges must follow
    edit(dims.changelog, "## [Unreleased]\n", "## [Unreleased]\n\n### Removed\n- x\n")
    prepare(dims, packages(tree)[0].version.__class__("0.2.0"), datetime.date(2026, 12, 25))
    assert "## [0.2.0] - 2026-12-25\n\n### Removed\n- x\n\n## [0.1.0] - 2026-12-24" in (
        dims.changelog.read_text()
    )
    assert sum("does not admit titan-dims 0.2.0" in p for p in check_versions.check(tree)) == 2
