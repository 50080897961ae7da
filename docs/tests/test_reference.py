"""The API reference is complete (every config key, every CLI option) and built strictly."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import gen_reference
import pytest

from titan_ckpt.commands.cli import _parser as ckpt_parser
from titan_dims.cli import _parser as dims_parser
from titan_train.config import JobConfig


def config_keys(config: object, prefix: str = "") -> list[str]:
    """Every leaf key of a config dataclass tree, walked here independently of the docs."""
    keys = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            keys += config_keys(value, f"{prefix}{field.name}.")
        else:
            keys.append(f"{prefix}{field.name}")
    return keys


def parser_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every long option of an argparse parser and of its subcommands."""
    options = set()
    for action in parser._actions:
        options |= {o for o in action.option_strings if o.startswith("--")}
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= parser_options(sub)
    return options


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated reference pages: those CI just built and published to the site when
    TITAN_REFERENCE_PAGES names their folder (so the test checks the real artifact), else
    freshly generated ones."""
    built = os.environ.get("TITAN_REFERENCE_PAGES")
    if built:
        return Path(built)
    out = tmp_path_factory.mktemp("reference")
    gen_reference.generate(out)
    return out


@pytest.fixture(scope="module")
def cli_page(pages: Path) -> str:
    return (pages / "cli.md").read_text()


@pytest.fixture(scope="module")
def config_page(pages: Path) -> str:
    return (pages / "config.md").read_text()


def test_every_config_key_is_in_the_reference(config_page: str) -> None:
    page = config_page
    keys = config_keys(JobConfig())
    assert len(keys) > 100  # the walk found the whole tree
    missing = [key for key in keys if f"| `{key}` |" not in page]
    assert not missing, missing
    # a key's row carries its default as titan-train starts with it
    assert "| `training.steps` | `int` | `30` |" in page
    assert "(torchtitan: `model.hf_assets_path`)" in page


def test_every_titan_train_option_is_in_the_command_reference(
    cli_page: str, config_page: str
) -> None:
    rows = {line.split("`")[1]: line for line in config_page.splitlines() if line.startswith("| `")}
    missing = [
        key
        for key in config_keys(JobConfig())
        if f"--{key}" not in cli_page and "**TOML only**" not in rows[key]
    ]
    assert not missing, missing  # a key is a flag, or the reference says it is TOML only
    assert "--nproc-per-node" in cli_page


@pytest.mark.parametrize(
    ("command", "parser"), [("titan-ckpt", ckpt_parser), ("titan-dims", dims_parser)]
)
def test_every_option_of_the_argparse_commands_is_in_the_reference(
    cli_page: str, command: str, parser
) -> None:
    section = cli_page.split(f"## `{command}`", 1)[1].split("\n## ", 1)[0]
    options = parser_options(parser())
    assert "--json" in options
    missing = sorted(o for o in options if not re.search(rf"{re.escape(o)}\b", section))
    assert not missing, missing


def test_each_package_page_has_its_readme_api_and_changelog(pages: Path) -> None:
    for name in gen_reference.PACKAGES:
        page = (pages / "packages" / f"{name}.md").read_text()
        assert page.startswith(f"# {name}\n")
        modules = gen_reference.api_modules(name)
        assert modules, name
        for module in modules:
            assert f"\n::: {module}\n" in page
        assert "\n### [Unreleased]" in page  # the changelog, one heading level down


def test_a_broken_cross_reference_fails_the_build(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "index.md").write_text(
        "# x\n\nSee [ParallelDims][titan_dims.ParallelDims] and [gone][titan_dims.NoSuchThing].\n"
        "\n::: titan_dims.ParallelDims\n"
    )
    config = (gen_reference.DOCS / "mkdocs.yml").read_text()
    config = re.sub(r"(?ms)^nav:.*?(?=^validation:)", "", config)
    config = config.replace("docs_dir: _build/src", f"docs_dir: {src}")
    config = config.replace("site_dir: _build/site", f"site_dir: {tmp_path / 'site'}")
    config = config.replace("- ../packages/", f"- {gen_reference.ROOT}/packages/")
    (tmp_path / "mkdocs.yml").write_text(config)
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode != 0, done.stderr
    assert "titan_dims.NoSuchThing" in done.stderr
    # the good reference alone builds
    (src / "index.md").write_text(
        "# x\n\n[ParallelDims][titan_dims.ParallelDims]\n\n::: titan_dims.ParallelDims\n"
    )
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
