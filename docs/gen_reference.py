"""Generate the pages of the API reference into docs/_build/src (then `mkdocs build`).

    python docs/gen_reference.py [--out DIR]

- per package, ``packages/<name>/index.md`` (its README, the list of its API pages, its
  changelog) and a page per group of its public objects (the names of a module's
  ``__all__`` imported from one submodule; mkdocstrings renders them from the docstrings);
- ``config.md``: every key of titan-train's ``JobConfig``, read from the dataclasses
  (section, key, type, default as ``titan-train`` starts with, help from the field's
  docstring, the torchtitan spelling where it differs);
- ``cli.md``: every command and subcommand, its usage and a table of its options, read
  from the argparse parsers and titan-train's own (titan-train's configuration keys are
  on ``config.md``);
- ``.nav.json``: the navigation, which docs/hooks.py hands to mkdocs.
Needs the five packages importable (the dev environment) for the config and the commands.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import html
import inspect
import io
import json
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
SOURCE_URL = "https://github.com/titan-pretraining/titan/tree/main/"
PACKAGES = ("titan-dims", "titan-ckpt", "titan-optim", "titan-models", "titan-train")
# Modules besides its top one whose ``__all__`` a package promises: titan-models' families.
FACES = {"titan-models": ("llama3", "qwen3", "deepseek_v3")}


def _link(match: re.Match[str], base: str) -> str:
    """A README's relative link: to a package's README, its page here (the pages lie as the
    READMEs do: packages/<name>/index.md); to anything else, the file on GitHub."""
    text, target = match.group(1), match.group(2)
    if re.match(r"^[a-z]+:|^#", target):
        return match.group(0)
    url = os.path.normpath(os.path.join(base, target)).replace(os.sep, "/")
    package = re.fullmatch(r"packages/([a-z-]+)(?:/README\.md)?/?(#.*)?", url)
    if package and package.group(1) in PACKAGES:
        page = os.path.relpath(f"packages/{package.group(1)}/index.md", base)
        return f"[{text}]({page}{package.group(2) or ''})"
    return f"[{text}]({SOURCE_URL}{url})"


def _markdown(path: Path, *, shift: int = 0) -> str:
    """A markdown file with links made absolute and headings moved down ``shift`` levels."""
    base = path.parent.relative_to(ROOT).as_posix()
    text = re.sub(r"\[([^\]]*)\]\(([^)\s]+)\)", lambda m: _link(m, base), path.read_text())
    if shift:
        text = re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + shift) + " ", text, flags=re.M)
    return text


def api_modules(name: str) -> list[str]:
    """The modules whose ``__all__`` a package promises (titan-train has no top module)."""
    module = name.replace("-", "_")
    src = ROOT / "packages" / name / "src" / module
    if (src / "__init__.py").is_file():
        return [module, *(f"{module}.{face}" for face in FACES.get(name, ()))]
    found = []
    for child in sorted(src.iterdir()):
        file = child if child.suffix == ".py" else child / "__init__.py"
        if file.is_file() and not child.name.startswith("_") and "__all__" in file.read_text():
            found.append(f"{module}.{child.stem if child.suffix == '.py' else child.name}")
    return found


def api_groups(module: str) -> dict[str, list[str]]:
    """The names of ``module.__all__`` grouped by the submodule each is imported from (its
    own module for names defined there): a reference page per group; a family's module
    (``titan_models.llama3``) is one page. Read from the source."""
    name = module.split(".")[0].replace("_", "-")
    src = ROOT / "packages" / name / "src" / Path(*module.split("."))
    file = src / "__init__.py" if src.is_dir() else src.with_suffix(".py")
    tree = ast.parse(file.read_text())
    public = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__"
    )
    origin = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or node.level):
            parts = (node.module or "").split(".")
            parts = parts[1:] if not node.level else parts  # the package's own name
            for alias in node.names:
                private = not parts or parts[0].startswith("_")  # __about__, _quiet_torch: own
                origin[alias.asname or alias.name] = "" if private or not src.is_dir() else parts[0]
    groups: dict[str, list[str]] = {}
    for item in (n for n in public if not n.startswith("__")):  # not __version__
        group = origin.get(item, "") if "." not in module else ""
        groups.setdefault(f"{module}.{group}" if group else module, []).append(item)
    return groups


def package_pages(name: str) -> dict[str, str]:
    """The pages of one package, by file name: ``index.md`` (its README, the list of its API
    pages, its changelog) and a page per group of its public objects."""
    folder = ROOT / "packages" / name
    pages, links = {}, []
    for module in api_modules(name):
        for group, names in api_groups(module).items():
            file = f"{group}.md"
            links.append(f"- [`{group}`]({file}): " + ", ".join(f"`{n}`" for n in names))
            objects = "\n".join(f"::: {module}.{n}\n" for n in names)
            pages[file] = f"# `{group}`\n\nImported as `from {module} import ...`.\n\n{objects}"
    changelog = _markdown(folder / "CHANGELOG.md", shift=1).split("\n", 1)[1]
    readme = _markdown(folder / "README.md")
    pages["index.md"] = "\n".join([readme, "\n## API reference\n", *links, "\n## Changelog"])
    pages["index.md"] += changelog
    return pages


def _field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a dataclass's fields (the ``--help`` text), by name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def config_rows(config: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) for every leaf key of a config dataclass tree."""
    rows = []
    docs = _field_docs(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            rows += config_rows(value, f"{key}.")
            continue
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        rows.append((key, kind, repr(value), docs.get(field.name, "")))
    return rows


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "&#124;")


def _code(text: str) -> str:
    """Inline code for a table cell: HTML, since a ``|`` inside backticks would end the cell
    (and ``\\|`` shows its backslash)."""
    return f"<code>{_cell(html.escape(text, quote=False))}</code>"


def train_help() -> str:
    """``titan-train train --help``, run in this process (torch is imported once)."""
    from titan_train.config import parse_job_config

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parse_job_config(["--help"])
    return out.getvalue()


def config_page(train_help: str) -> str:
    """Every TOML key of ``JobConfig``, section by section; ``train_help`` is the output of
    ``titan-train train --help``, to mark the keys that have no command-line flag."""
    from titan_train.compat import KEYS
    from titan_train.config import JobConfig

    # titan key -> the torchtitan names moved to it (July 2025 and later spellings).
    spellings: dict[str, list[str]] = {}
    for old, entry in KEYS.items():
        if entry.action == "move" and entry.to:
            spellings.setdefault(entry.to, []).append(f"not {old}" if entry.negate else old)
    torchtitan = {key: "`, `".join(names) for key, names in spellings.items()}
    job = JobConfig()
    lines = [
        "# Configuration reference",
        "",
        "Every setting of a `titan-train` run, generated from titan-train's `JobConfig`",
        "dataclasses. In a TOML file a key `section.key` is `key = value` under `[section]`",
        "(a nested key such as `parallelize.activation_checkpoint.mode` is",
        "`[parallelize.activation_checkpoint]`); on the command line it is",
        "`--section.key value`. Precedence: command line > TOML file > the defaults below,",
        "which are the ones `titan-train` starts with. Where torchtitan spells a key",
        "differently, its spelling is given; a torchtitan TOML using it loads unchanged.",
        "",
    ]
    for field in dataclasses.fields(job):
        section = getattr(job, field.name)
        doc = inspect.getdoc(type(section)) or ""
        lines += [f"## `[{field.name}]`", "", doc.split("\n\n")[0], ""]
        lines += ["| key | type | default | help |", "| --- | --- | --- | --- |"]
        for key, kind, default, help_ in config_rows(section, f"{field.name}."):
            if key in torchtitan:
                help_ += f" (torchtitan: `{torchtitan[key]}`)"
            if not re.search(rf"--{re.escape(key)}\b", train_help):
                help_ += " **TOML only**: no command-line flag."
            lines.append(f"| `{key}` | {_code(kind)} | {_code(default)} | {_cell(help_)} |")
        lines.append("")
    return "\n".join(lines)


def _row(flag: str, default: str, help_: str) -> str:
    return f"| {_code(flag)} | {_code(default) if default else ''} | {_cell(help_)} |"


OPTIONS_HEAD = ["| option | default | help |", "| --- | --- | --- |"]
_DEFAULT = re.compile(r"\s*\(default:? ([^()]*(?:\([^()]*\))?[^()]*)\)\s*$")


def _split_default(help_: str) -> tuple[str, str]:
    """``help (default X)`` -> (help, X), as the commands write their defaults."""
    found = _DEFAULT.search(help_)
    return (help_[: found.start()], found.group(1)) if found else (help_, "")


def argparse_section(parser: argparse.ArgumentParser, title: str) -> list[str]:
    """A heading, the usage, the description and a table of options of an argparse parser;
    then the same for each of its subcommands."""
    usage = " ".join(parser.format_usage().split()).removeprefix("usage: ")
    lines = [title, "", "```text", usage, "```", "", parser.description or "", ""]
    rows = option_rows(parser)
    if rows:
        lines += [*OPTIONS_HEAD, *rows, ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                lines += argparse_section(sub, f"### `{parser.prog} {name}`")
    return lines


def option_rows(parser: argparse.ArgumentParser) -> list[str]:
    """A table row per option of ``parser`` (its subcommands aside), flags as its help
    spells them; the default from the help's ``(default X)``, else a plain ``default``."""
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        # --help is said once, at the top of the page; subcommands get sections of their own
        if isinstance(action, argparse._SubParsersAction) or "--help" in action.option_strings:
            continue
        metavar = formatter._format_args(action, action.dest.upper()) if action.nargs != 0 else ""
        flag = ", ".join(action.option_strings) + (" " if action.option_strings else "") + metavar
        help_, default = _split_default(formatter._expand_help(action) if action.help else "")
        plain = isinstance(action.default, (str, int, float)) and action.default is not False
        if not default and plain and action.default != argparse.SUPPRESS:
            default = str(action.default)
        rows.append(_row(flag.strip(), default, help_ + (" (required)" if action.required else "")))
    return rows


def generate_parser() -> argparse.ArgumentParser:
    """The parser ``titan-train generate`` runs (tyro's, built from ``GenerateOptions`` with
    the same settings as ``parse_generate_options``)."""
    import warnings

    import tyro.extras

    from titan_train.config.loader import _plain_docstrings
    from titan_train.generate.cli import GenerateOptions

    with _plain_docstrings(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # tyro 1.0 keeps it, deprecated
        return tyro.extras.get_parser(
            GenerateOptions, prog="titan-train generate", use_underscores=False
        )


def docstring_section(doc: str) -> list[str]:
    """A command's docstring as markdown: the indented examples as a console block, each
    two-column list of options (``  --flag ARG   help``, help lines indented) as a table."""
    lines: list[str] = []
    block: list[str] = []  # the example lines being collected
    option: list[str] | None = None  # the option row being collected: [flag, help]
    rows: list[list[str]] = []
    for line in [*inspect.cleandoc(doc).replace("``", "`").splitlines(), ""]:
        starts = re.match(r"^  (--\S+(?: [A-Z:]+)?)\s{2,}(.*)", line)
        if option and line.startswith(" " * 6) and line.strip():
            option[1] += " " + line.strip()
            continue
        if starts:
            option = [starts.group(1), starts.group(2)]
            rows.append(option)
            continue
        option = None
        if rows:
            lines += ["", *OPTIONS_HEAD]
            lines += [_row(flag, *reversed(_split_default(help_))) for flag, help_ in rows]
            lines.append("")
            rows = []
        if line.startswith("    "):
            block.append(line[4:])
            continue
        if block:
            lines += ["", "```bash", *block, "```", ""]
            block = []
        lines.append(line)
    return lines


def titan_train_section() -> list[str]:
    """titan-train's commands: ``train`` and ``config`` take the configuration's keys (the
    Configuration page), ``estimate`` and ``generate`` have options of their own."""
    from titan_train import cli
    from titan_train.config.registry import list_models, load_model_spec
    from titan_train.estimate import cli as estimate_cli
    from titan_train.generate import cli as generate_cli

    keys = "[Configuration](config.md): a key `section.key` is the flag `--section.key VALUE`"
    lines = ["## `titan-train`", "", *docstring_section(cli.__doc__ or ""), ""]
    lines += ["Its commands: " + ", ".join(f"`{c}`" for c in cli.COMMANDS) + ".", ""]
    lines += ["### `titan-train train`", "", "Train (also what `titan-train` alone does).", ""]
    lines += [f"Options: every key of the {keys}, and the launcher flags above.", ""]
    lines += ["### `titan-train config`", "", *docstring_section(cli._CONFIG_HELP)]
    lines += [f"train's options are the keys of the {keys}.", ""]
    lines += ["### `titan-train estimate`", "", *docstring_section(estimate_cli.__doc__ or "")]
    lines += ["### `titan-train list-models`", "", *docstring_section(cli._LIST_MODELS_HELP)]
    lines += ["The model families and their flavors:", ""]
    lines += [f"- `{name}`: {', '.join(load_model_spec(name).flavors)}" for name in list_models()]
    lines += ["", "### `titan-train generate`", "", *docstring_section(generate_cli.__doc__ or "")]
    lines += ["", *OPTIONS_HEAD, *option_rows(generate_parser())]
    return [*lines, ""]


def cli_page() -> str:
    """Every command and subcommand: its usage, what it does and a table of its options."""
    from titan_ckpt.commands.cli import _parser as ckpt_parser
    from titan_dims.cli import _parser as dims_parser

    lines = ["# Command reference", "", "`titan-dims`, `titan-ckpt` and `titan-train`: each"]
    lines += ["command and its options. Every command also takes `-h`, `--help`.", ""]
    lines += argparse_section(dims_parser(), "## `titan-dims`")
    lines += argparse_section(ckpt_parser(), "## `titan-ckpt`")
    lines += titan_train_section()
    return "\n".join(lines)


def index_page() -> str:
    readme = _markdown(ROOT / "README.md")
    pages = "\n".join(f"- [{name}](packages/{name}/index.md)" for name in PACKAGES)
    return (
        f"{readme}\n\n## This reference\n\n{pages}\n"
        "- [Configuration](config.md): every key of `titan-train`'s TOML and command line\n"
        "- [Commands](cli.md): `titan-dims`, `titan-ckpt` and `titan-train`\n"
    )


def generate(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "index.md").write_text(index_page())
    nav: list[Any] = [{"Overview": "index.md"}]
    for name in PACKAGES:
        (out / "packages" / name).mkdir(parents=True)
        section = []
        for file, text in package_pages(name).items():
            (out / "packages" / name / file).write_text(text)
            title = name if file == "index.md" else file.removesuffix(".md")
            section.append({title: f"packages/{name}/{file}"})
        nav.append({name: sorted(section, key=lambda entry: "index.md" not in str(entry))})
    (out / "config.md").write_text(config_page(train_help()))
    (out / "cli.md").write_text(cli_page())
    nav += [{"Configuration": "config.md"}, {"Commands": "cli.md"}]
    shutil.copytree(DOCS / "assets", out / "assets")  # the file:// search shim
    (out / ".nav.json").write_text(json.dumps(nav, indent=1))  # read by docs/hooks.py
    print(f"wrote the reference pages to {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DOCS / "_build" / "src")
    generate(parser.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
