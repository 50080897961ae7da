"""The API reference is complete (every config key, every command and option, every public
object) and built strictly."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
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
    assert "| `training.steps` | <code>int</code> | <code>30</code> |" in page
    assert "(torchtitan: `model.hf_assets_path`, `hf_assets_path`)" in page  # 2025, 2026


def test_every_titan_train_option_is_in_the_reference(cli_page: str, config_page: str) -> None:
    """train's and config's options are the configuration's keys (config.md, each with its
    flag or marked TOML only); estimate's, generate's and the launcher's are on cli.md."""
    from titan_train.generate.cli import GenerateOptions

    help_ = gen_reference.train_help()
    rows = {line.split("`")[1]: line for line in config_page.splitlines() if line.startswith("| `")}
    missing = [
        key
        for key in config_keys(JobConfig())
        if f"--{key}" not in help_ and "**TOML only**" not in rows[key]
    ]
    assert not missing, missing  # a key is a flag, or the reference says it is TOML only
    assert "[Configuration](config.md)" in cli_page.split("### `titan-train train`")[1]
    generate = cli_page.split("### `titan-train generate`")[1]
    # every key, spelled as tyro's parser (and generate --help) spells it: kebab-case
    flags = ["--" + key.replace("_", "-") for key in config_keys(GenerateOptions())]
    missing = [flag for flag in flags if f"<code>{flag}" not in generate]
    assert not missing, missing
    for option in ("--nproc-per-node N", "--rdzv-endpoint HOST:PORT", "--world-size N"):
        assert f"| <code>{option}</code> |" in cli_page, option
    # a table row, not a --help box: the default in its own column
    assert "| <code>--max-new-tokens INT</code> | <code>64</code> | Tokens to add" in generate


def test_every_command_has_its_section(cli_page: str) -> None:
    from titan_train.cli import COMMANDS

    commands = [f"titan-train {name}" for name in COMMANDS]
    for command, parser in (("titan-ckpt", ckpt_parser()), ("titan-dims", dims_parser())):
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands += [f"{command} {name}" for name in subparsers.choices]
    assert "titan-train estimate" in commands
    assert "titan-ckpt convert" in commands
    missing = [command for command in commands if f"\n### `{command}`\n" not in cli_page]
    assert not missing, missing


@pytest.mark.parametrize(
    ("command", "parser"), [("titan-ckpt", ckpt_parser), ("titan-dims", dims_parser)]
)
def test_every_option_of_the_argparse_commands_is_in_the_reference(
    cli_page: str, command: str, parser
) -> None:
    section = cli_page.split(f"## `{command}`", 1)[1].split("\n## ", 1)[0]
    options = parser_options(parser())
    assert "--json" in options
    options.remove("--help")  # the page says once that every command takes it
    missing = sorted(o for o in options if not re.search(rf"<code>[^<]*{re.escape(o)}\b", section))
    assert not missing, missing


def test_each_package_has_its_readme_api_pages_and_changelog(pages: Path) -> None:
    for name in gen_reference.PACKAGES:
        folder = pages / "packages" / name
        index = (folder / "index.md").read_text()
        assert index.startswith(f"# {name}\n")
        assert "\n### [Unreleased]" in index  # the changelog, one heading level down
        for module in gen_reference.api_modules(name):
            public = importlib.import_module(module).__all__
            shown = []
            for group, names in gen_reference.api_groups(module).items():
                assert f"]({group}.md)" in index  # the package page links each API page
                page = (folder / f"{group}.md").read_text()
                shown += [n for n in names if f"\n::: {module}.{n}\n" in page]
            assert sorted(shown) == sorted(n for n in public if not n.startswith("__"))
    # titan-models' objects are split into pages: a page per model family, the shared ones
    modules = gen_reference.api_modules("titan-models")
    groups = [group for module in modules for group in gen_reference.api_groups(module)]
    assert {"titan_models.llama3", "titan_models.qwen3", "titan_models.parallel"} <= set(groups)


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
    for local in ("hooks.py", "griffe_roles.py"):
        config = config.replace(f"- {local}", f"- {gen_reference.DOCS / local}")
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


def _help_of(main, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``COMMAND ... --help`` prints, run in this process through the command's entry
    point (each command exits 0 after its help)."""
    capsys.readouterr()
    try:
        status = main(argv)
    except SystemExit as done:
        status = done.code
    out = capsys.readouterr().out
    assert status in (0, None), (argv, status)
    return out


# An option entry of a help text: a line that starts with its flags, two spaces in (argparse
# and the docstrings' option lists) or one inside tyro's box; a description line that wraps
# onto a flag is indented further, and prose starts in the first column.
_ENTRY = re.compile(r"^(?: {2}|│ )(?:-\w, )?--[\w.-]+")


def help_flags(text: str) -> set[str]:
    """The long flags of every option entry in a ``--help`` text."""
    flags = set()
    for line in text.splitlines():
        if _ENTRY.match(line):
            entry = re.split(r"\s{2,}", line.strip("│ "))[0]
            flags |= set(re.findall(r"--[a-zA-Z][\w.-]*", entry))
    return flags


def _commands() -> list[tuple[str, list[str]]]:
    from titan_train.cli import COMMANDS

    commands = []
    for command, parser in (("titan-dims", dims_parser), ("titan-ckpt", ckpt_parser)):
        subparsers = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
        commands += [(command, [name]) for name in subparsers.choices]
    return commands + [("titan-train", [name]) for name in COMMANDS]


@pytest.mark.parametrize(
    ("command", "argv"), _commands(), ids=lambda x: " ".join(x) if isinstance(x, list) else x
)
def test_every_commands_table_lists_the_flags_its_help_shows(
    cli_page: str, config_page: str, command: str, argv: list[str], capsys
) -> None:
    """Each option entry of ``COMMAND SUB --help`` (its own flags, spelled as the help spells
    them) is a row of an options table on the command's part of cli.md, or for titan-train's
    configuration keys (``--section.key``) a row of config.md."""
    from titan_ckpt.commands.cli import main as ckpt_main
    from titan_dims.cli import main as dims_main
    from titan_train.cli import main as train_main

    main = {"titan-dims": dims_main, "titan-ckpt": ckpt_main, "titan-train": train_main}[command]
    flags = help_flags(_help_of(main, [*argv, "--help"], capsys))
    flags.discard("--help")  # the page says once that every command takes it
    assert flags or argv == ["list-models"], argv
    page = cli_page.split(f"\n## `{command}`\n", 1)[1].split("\n## ", 1)[0]
    intro, sections = page.split("\n### ", 1)
    own = sections.split(f"`{command} {argv[0]}`\n", 1)[1].split("\n### ", 1)[0]
    # titan-train's launcher flags are in its introduction, shared by its commands.
    part = (intro if command == "titan-train" else "") + own
    rows = [line for line in part.splitlines() if line.startswith("| <code>")]
    keys = {line.split("`")[1] for line in config_page.splitlines() if line.startswith("| `")}
    # a boolean key's flag pair: --section.key and --section.no_key (or no-key)
    key_of = {flag: re.sub(r"\.no[_-]", ".", flag[2:]) for flag in flags}
    missing = sorted(
        flag
        for flag in flags
        if flag[2:] not in keys
        and key_of[flag] not in keys
        and not any(re.search(rf"<code>[^<]*{re.escape(flag)}(?![\w.-])", row) for row in rows)
    )
    assert not missing, missing


def test_the_flags_titan_train_parses_itself_are_in_their_help(capsys) -> None:
    """estimate's own flags and the launcher's are read by small parsers of their own
    (``parse_estimate_options``, ``pop_launch_options``): each flag they take is an entry of
    the help, so the test above finds it in a table of the page."""
    from titan_train.cli import main
    from titan_train.estimate.cli import _INT_FLAGS
    from titan_train.launch import LAUNCH_FLAGS

    assert {*_INT_FLAGS, "--json"} <= help_flags(_help_of(main, ["estimate", "--help"], capsys))
    assert set(LAUNCH_FLAGS) <= help_flags(_help_of(main, ["train", "--help"], capsys))
